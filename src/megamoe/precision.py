"""The precisions of the routed experts and the constants of their FP8 formats.

- ``bf16``: BF16 operands, FP32 accumulation.
- ``fp8-block`` (the DeepSeek-V3 recipe): E4M3 elements with one float32 scale
  per 1x128 block of an activation row and per 128x128 block of a weight.
- ``mxfp8`` (OCP MX): E4M3 elements with one E8M0 (power-of-two) scale per 32
  elements along the reduction axis.

The shared experts stay BF16 in every precision. The formats' rules are in
:mod:`megamoe.reference.formats` (the definitions) and
:mod:`megamoe.kernels.quant` (the kernels, bit for bit the same).
"""

from __future__ import annotations

#: Every precision of the routed experts.
PRECISIONS = ("bf16", "fp8-block", "mxfp8")
#: The quantised ones (the quantisation formats).
FORMATS = ("mxfp8", "fp8-block")

#: Largest finite E4M3 (float8_e4m3fn) magnitude; elements saturate to it.
E4M3_MAX = 448.0
#: Elements sharing one E8M0 scale in MXFP8.
MX_BLOCK = 32
#: Edge of an FP8-block tile.
FP8_BLOCK = 128
#: The block shapes ``(rows, cols)`` fp8-block supports.
FP8_BLOCKS = ((1, FP8_BLOCK), (FP8_BLOCK, 1), (FP8_BLOCK, FP8_BLOCK))
#: amax is clamped to at least this (448 * 2**-126) so the scale >= 2**-126.
FP8_BLOCK_AMAX_FLOOR = E4M3_MAX * 2.0**-126
#: Exponent rules of MXFP8 quantisation.
MX_ROUNDINGS = ("floor", "rceil")

#: Elements per activation scale along D or I (1: no scales).
SCALE_BLOCK = {"bf16": 1, "fp8-block": FP8_BLOCK, "mxfp8": MX_BLOCK}


def check_precision(precision: object, allowed: tuple[str, ...] = PRECISIONS) -> str:
    """``precision`` if it is one of ``allowed``; ValueError naming them otherwise."""
    if precision not in allowed:
        raise ValueError(f"precision must be one of {', '.join(allowed)}, got {precision!r}")
    return precision  # type: ignore[return-value]
