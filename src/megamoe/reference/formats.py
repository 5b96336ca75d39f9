"""MXFP8 and FP8-block quantisation: the pure-PyTorch definitions.

These functions are the oracle for the Triton kernels of
``megamoe.kernels.quant`` (which match them bit for bit) and the CPU
fallback. The constants live in :mod:`megamoe.precision`. They use exact torch ops only: block maxima and exponents are read
from float32 bit patterns, powers of two are built from bits, and the one
rounding step is torch's round-to-nearest-even cast to ``float8_e4m3fn``,
applied to values already clamped to [-448, 448].

MXFP8 (OCP Microscaling Formats v1.0, E4M3 elements)
----------------------------------------------------
Blocks of 32 consecutive elements along ``dim``. For one block, with
``amax = max |x_i|`` (x upcast to float32, which is exact):

* a block holding NaN or +-inf: scale byte 255 (E8M0 NaN) and every data
  byte 0x7F (E4M3 NaN); dequantising gives NaN for the whole block.
* otherwise the shared exponent is
  ``floor``: ``e = clamp(floor(log2 amax) - 8, -127, 127)`` (8 = emax of
  E4M3; the spec's rule), ``rceil``: the smallest ``e >= -127`` with
  ``amax / 2**e <= 448``; an all-zero block gets ``e = -127``.
  Both are read from the bits of amax: with ``f`` its biased exponent field,
  ``floor`` gives ``e + 127 = max(f - 8, 0)`` and ``rceil`` adds one when the
  mantissa exceeds 1.75 (``amax / 2**(f-135) = 1.m * 2**8 > 448``). A zero or
  subnormal amax has ``floor(log2 amax) <= -127``, so its exponent is always
  clamped to -127 and needs no leading-zero count; ``e`` never exceeds 120.
* scale byte = ``e + 127`` (uint8, E8M0); data =
  ``E4M3_rne(clamp(x_i * 2**-e, -448, 448))``. ``2**-e`` lies in
  ``[2**-120, 2**127]``, a normal float32 built from bits, so the product is
  exact unless its magnitude is below ``2**-126`` -- and such values round
  to +-0 in E4M3 whatever happens. Signs of zeros are kept (-0 -> 0x80).
  With ``rceil`` the clamp never binds.

FP8-block (the DeepSeek-V3 recipe)
----------------------------------
E4M3 data with one float32 scale per block over the last two dims
``[..., rows, cols]``: ``block=(1, 128)`` for activations (128 along the
reduction axis, cols), ``(128, 1)`` for the transposed/wgrad operand (128
along rows, e.g. tokens), ``(128, 128)`` for weights ``[rows, cols]`` or a
stack ``[E, rows, cols]``. For one block:

* a block holding NaN or +-inf: scale NaN (0x7FC00000) and every data byte
  0x7F; dequantising gives NaN for the whole block.
* otherwise ``amax' = max(amax, 448 * 2**-126)``, ``scale = fl32(amax' / 448)``
  and ``data = E4M3_rne(clamp(x_i * fl32(448 / amax'), -448, 448))`` (the
  multiply-by-reciprocal form of DeepGEMM's ``per_token_cast_to_fp8``; fl32 is
  an IEEE float32 division). The floor keeps the scale at or above the
  smallest normal float32 and the reciprocal finite: an all-zero block gets
  scale exactly ``2**-126`` and zero data, so dequantising gives zeros; a
  block whose amax is tinier than the floor is quantised on the floor's grid
  (its scale never underflows to 0).
* no padding: the blocked dims must be multiples of the block (ValueError
  otherwise); pad tokens to 128 before a columnwise quantisation.

``dequantize(data, scale) = data * scale`` in float32, then cast to ``dtype``.
"""

from __future__ import annotations

import torch

from megamoe.checks import describe
from megamoe.precision import E4M3_MAX, FP8_BLOCK, FP8_BLOCK_AMAX_FLOOR, FP8_BLOCKS, MX_BLOCK, MX_ROUNDINGS

__all__ = [
    "QUANT_INPUT_DTYPES",
    "e8m0_to_float32",
    "fp8_block_dequantize",
    "fp8_block_quantize",
    "mxfp8_dequantize",
    "mxfp8_quantize",
]

#: Input dtypes the quantisers accept (each converts exactly to float32).
QUANT_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

E8M0_NAN = 255
E4M3_NAN_BITS = 0x7F
_F32_ABS_MASK = 0x7FFFFFFF
_F32_INF_BITS = 0x7F800000
_F32_NAN_BITS = 0x7FC00000
_F32_MANT_1_75 = 0x600000  # mantissa field of 1.75 (= 448 / 2**8)
_F32_MIN_SUBNORMAL_POW2 = 0x00400000  # bits of 2**-127


# ---------------------------------------------------------------- validation


def check_quant_input(x: object, name: str = "x") -> None:
    """``x`` is a float32/bfloat16/float16 tensor."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in QUANT_INPUT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def normalize_dim(dim: object, ndim: int, name: str = "dim") -> int:
    """``dim`` as a non-negative index into ``ndim`` dims."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise ValueError(f"{name} must be an int, got {dim!r}")
    if ndim < 1 or not -ndim <= dim < ndim:
        raise ValueError(f"{name}={dim} is out of range for a {ndim}-D tensor")
    return dim % ndim


def check_rounding(rounding: object) -> None:
    if rounding not in MX_ROUNDINGS:
        raise ValueError(f"rounding must be one of {MX_ROUNDINGS}, got {rounding!r}")


def check_fp8_block(block: object) -> tuple[int, int]:
    """``block`` is one of ``FP8_BLOCKS``; returns it as a tuple."""
    try:
        pair = tuple(block)  # type: ignore[arg-type]
    except TypeError:
        pair = None
    if pair not in FP8_BLOCKS:
        raise ValueError(f"block must be one of {FP8_BLOCKS}, got {block!r}")
    return pair  # type: ignore[return-value]


def _check_out_dtype(dtype: object) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")


def _check_divisible(shape: torch.Size, dim: int, block: int, what: str) -> None:
    if shape[dim] % block:
        raise ValueError(
            f"{what}: dim {dim} of shape {tuple(shape)} has size {shape[dim]}, "
            f"not a multiple of {block}"
        )


# --------------------------------------------------------------------- MXFP8


def mxfp8_quantize(
    x: torch.Tensor, dim: int = -1, rounding: str = "floor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MXFP8: E4M3 elements with one E8M0 scale per 32 along ``dim``.

    Args:
        x: float32, bfloat16 or float16 tensor; ``x.shape[dim]`` a multiple of 32.
        dim: the axis the 32-element blocks run along (a GEMM's reduction axis).
        rounding: ``"floor"`` (OCP: ``floor(log2 amax) - 8``, elements saturate
            to +-448) or ``"rceil"`` (smallest power of two that fits amax in 448).

    Returns:
        ``data``: float8_e4m3fn, ``x.shape``. ``scale``: uint8 E8M0 biased
        exponents (255 = NaN), ``x.shape`` with ``dim`` divided by 32. See the
        module docstring for the exact rule, zero and NaN/inf blocks.
    """
    check_quant_input(x)
    check_rounding(rounding)
    d = normalize_dim(dim, x.dim())
    _check_divisible(x.shape, d, MX_BLOCK, "mxfp8_quantize")
    xb = x.float().movedim(d, -1)
    xb = xb.unflatten(-1, (xb.shape[-1] // MX_BLOCK, MX_BLOCK))  # [..., K/32, 32]
    amax = (xb.view(torch.int32) & _F32_ABS_MASK).amax(-1)  # bits; NaN > inf > finite
    bad = amax >= _F32_INF_BITS
    f = amax >> 23
    if rounding == "rceil":
        f = f + ((amax & 0x7FFFFF) > _F32_MANT_1_75).to(torch.int32)
    byte = torch.where(bad, E8M0_NAN, (f - 8).clamp_min(0))
    mult = ((254 - byte) << 23).view(torch.float32)  # 2**-e; garbage where bad
    y = (xb * mult.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    bits = y.to(torch.float8_e4m3fn).view(torch.uint8)
    bits = torch.where(bad.unsqueeze(-1), E4M3_NAN_BITS, bits)
    data = bits.flatten(-2).movedim(-1, d).contiguous().view(torch.float8_e4m3fn)
    scale = byte.to(torch.uint8).movedim(-1, d).contiguous()
    return data, scale


def e8m0_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """``2**(scale - 127)`` exactly as float32 (255 -> NaN, 0 -> the subnormal 2**-127)."""
    s = scale.to(torch.int32)
    bits = torch.where(s == 0, _F32_MIN_SUBNORMAL_POW2, s << 23)
    bits = torch.where(s == E8M0_NAN, _F32_NAN_BITS, bits)
    return bits.view(torch.float32)


def mxfp8_dequantize(
    data: torch.Tensor, scale: torch.Tensor, dim: int = -1, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``data * 2**(scale - 127)`` per 32-block along ``dim`` (exact in float32), as ``dtype``.

    Args:
        data: float8_e4m3fn, any shape with ``data.shape[dim]`` a multiple of 32.
        scale: uint8 E8M0, ``data.shape`` with ``dim`` divided by 32; 255 = NaN.
        dim: the axis the blocks run along.
        dtype: the output dtype (one rounding from the exact float32 product).
    """
    if not isinstance(data, torch.Tensor) or data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"data must be a float8_e4m3fn tensor, got {describe(data)}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.uint8:
        raise ValueError(f"scale must be a uint8 (E8M0) tensor, got {describe(scale)}")
    _check_out_dtype(dtype)
    d = normalize_dim(dim, data.dim())
    _check_divisible(data.shape, d, MX_BLOCK, "mxfp8_dequantize")
    want = list(data.shape)
    want[d] //= MX_BLOCK
    if list(scale.shape) != want:
        raise ValueError(f"scale must have shape {tuple(want)} for data {tuple(data.shape)}, got {tuple(scale.shape)}")
    v = data.float().movedim(d, -1)
    v = v.unflatten(-1, (v.shape[-1] // MX_BLOCK, MX_BLOCK))
    v = v * e8m0_to_float32(scale).movedim(d, -1).unsqueeze(-1)
    return v.flatten(-2).movedim(-1, d).to(dtype).contiguous()


# ----------------------------------------------------------------- FP8-block


def _blocked(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``[..., R, C]`` -> ``[..., R/br, br, C/bc, bc]``."""
    br, bc = block
    t = t.unflatten(-1, (t.shape[-1] // bc, bc))
    return t.unflatten(-3, (t.shape[-3] // br, br))


def _check_fp8_block_shape(shape: torch.Size, block: tuple[int, int], what: str) -> None:
    if len(shape) < 2:
        raise ValueError(f"{what}: needs at least 2 dims [..., rows, cols], got shape {tuple(shape)}")
    for i, b in zip((-2, -1), block):
        if shape[i] % b:
            raise ValueError(
                f"{what}: block {block} needs {'rows' if i == -2 else 'cols'} a multiple of {b}, "
                f"got shape {tuple(shape)} (no padding: pad the tensor first)"
            )


def fp8_block_quantize(
    x: torch.Tensor, block: tuple[int, int] = (1, FP8_BLOCK)
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 FP8: E4M3 data and one float32 scale (amax/448) per block.

    Args:
        x: float32, bfloat16 or float16 tensor ``[..., rows, cols]``.
        block: ``(1, 128)`` activations, blocks along cols (the reduction axis);
            ``(128, 1)`` blocks along rows (wgrad operand, rows = tokens);
            ``(128, 128)`` weights ``[rows, cols]`` or ``[E, rows, cols]``.
            The blocked dims must be multiples of the block (no padding).

    Returns:
        ``data``: float8_e4m3fn, ``x.shape``. ``scale``: float32,
        ``[..., rows / block[0], cols / block[1]]``; ``dequantize = data * scale``.
        Zero blocks get scale 2**-126, NaN/inf blocks scale NaN and NaN data
        (module docstring).
    """
    check_quant_input(x)
    blk = check_fp8_block(block)
    _check_fp8_block_shape(x.shape, blk, "fp8_block_quantize")
    xb = _blocked(x.float(), blk)  # [..., R/br, br, C/bc, bc]
    amax_bits = (xb.view(torch.int32) & _F32_ABS_MASK).amax(dim=(-3, -1))
    bad = amax_bits >= _F32_INF_BITS
    amax = amax_bits.view(torch.float32).clamp_min(FP8_BLOCK_AMAX_FLOOR)
    # NOTE: tensor / tensor on purpose: torch turns `448.0 / t` into `t.reciprocal() * 448` and,
    # on CUDA, `t / 448.0` into `t * (1 / 448)`; neither is the correctly rounded quotient.
    e4m3_max = torch.full_like(amax, E4M3_MAX)
    scale = torch.where(bad, float("nan"), amax / e4m3_max)
    inv = (e4m3_max / amax)[..., :, None, :, None]
    y = (xb * inv).clamp(-E4M3_MAX, E4M3_MAX)
    bits = y.to(torch.float8_e4m3fn).view(torch.uint8)
    bits = torch.where(bad[..., :, None, :, None], E4M3_NAN_BITS, bits)
    data = bits.flatten(-2).flatten(-3, -2).contiguous().view(torch.float8_e4m3fn)
    return data, scale.contiguous()


def fp8_block_dequantize(
    data: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = (1, FP8_BLOCK),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``data * scale`` per block (float32 product), as ``dtype``.

    Args:
        data: float8_e4m3fn ``[..., rows, cols]``.
        scale: float32 ``[..., rows / block[0], cols / block[1]]``.
        block: as given to ``fp8_block_quantize``.
        dtype: the output dtype.
    """
    if not isinstance(data, torch.Tensor) or data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"data must be a float8_e4m3fn tensor, got {describe(data)}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be a float32 tensor, got {describe(scale)}")
    _check_out_dtype(dtype)
    blk = check_fp8_block(block)
    _check_fp8_block_shape(data.shape, blk, "fp8_block_dequantize")
    want = (*data.shape[:-2], data.shape[-2] // blk[0], data.shape[-1] // blk[1])
    if tuple(scale.shape) != want:
        raise ValueError(f"scale must have shape {want} for data {tuple(data.shape)}, got {tuple(scale.shape)}")
    v = _blocked(data.float(), blk) * scale[..., :, None, :, None]
    return v.flatten(-2).flatten(-3, -2).to(dtype).contiguous()
