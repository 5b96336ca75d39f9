"""bfloat16 <-> float32 conversions that give the GPU's bits under the interpreter too.

The interpreter's float32 -> bfloat16 cast truncates and its bfloat16 -> float32 cast mangles subnormals;
the GPU rounds to nearest even. Kernels convert through these (``EXACT``: the interpreter) so that a CPU run
rounds as a GPU run does.
"""

import triton
import triton.language as tl


@triton.jit
def bf16_to_f32(x):
    """bfloat16 -> float32 through the bits (exact; the interpreter's cast mangles subnormals)."""
    return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16(y):
    """float32 -> bfloat16, round to nearest even (as torch), through the bits.

    The interpreter's cast truncates; this is a few integer ops on the GPU
    and gives the same bits on both. NaN stays a quiet NaN of the same sign.
    """
    bits = y.to(tl.int32, bitcast=True)
    high = bits >> 16
    rounded = (bits + (0x7FFF + (high & 1))) >> 16
    out = tl.where(y != y, high | 0x40, rounded)  # few ops: each costs ~0.2 ms under the interpreter
    return out.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def to_bf16(y, EXACT: tl.constexpr):
    """float32 -> bfloat16, round to nearest even: the hardware cast compiled, through the bits under the
    interpreter (``EXACT``)."""
    if EXACT:
        return f32_to_bf16(y)
    return y.to(tl.bfloat16)
