"""The pure-PyTorch oracle: the layer, the FP8 formats' definitions, the layer over an expert-parallel group.

Deliberately plain and free of Triton: every kernel is checked against it.
"""

from megamoe.reference.layer import compute_dtype, expert_ffn, moe_forward, moe_forward_backward, swiglu

__all__ = ["compute_dtype", "expert_ffn", "moe_forward", "moe_forward_backward", "swiglu"]
