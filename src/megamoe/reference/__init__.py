"""The pure-PyTorch oracle: the layer, the FP8 formats' definitions, the layer over an expert-parallel group.

Deliberately plain and free of Triton: every kernel is checked against it.
"""

from megamoe.reference.layer import (activate, activation_backward, compute_dtype, expert_ffn, moe_forward,
                                    moe_forward_backward)

__all__ = ["activate", "activation_backward", "compute_dtype", "expert_ffn", "moe_forward", "moe_forward_backward"]
