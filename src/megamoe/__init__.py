"""megamoe: an expert-parallel Mixture-of-Experts layer for training.

The whole layer (scheduling, cross-GPU dispatch, expert FFNs, combine and the
weighted sum) is meant to run as one persistent Triton kernel per pass; this
package also holds the pure-PyTorch oracle, the pull schedule, the
expert-parallel world and the NCCL + PyTorch baseline it is measured against.
"""

from megamoe.config import PRESETS, MoEConfig, preset

__all__ = ["MoEConfig", "PRESETS", "preset"]
__version__ = "0.1.0"
