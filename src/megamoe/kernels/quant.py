"""MXFP8 and FP8-block quantisation in Triton: fusable tile functions and standalone kernels.

Every result matches the pure-PyTorch definitions of :mod:`megamoe.formats`
bit for bit (data bytes, scale bytes, NaN payloads); read that module for the
formats' rules. Here is how the kernels compute them.

Tile functions (``@triton.jit``; later kernels inline them into dispatch,
GEMM epilogues and SwiGLU) take a register tile ``x [BLOCK_M, BLOCK_K]`` of
any float dtype and return ``(data, scale)`` for blocks along either axis:

    mxfp8_quantize_tile(x, AXIS, RCEIL=False, SOFT_E4M3=False)
        AXIS=1, rowwise (blocks of 32 along K):    data float8e4nv [BM, BK], scale uint8 [BM, BK/32]
        AXIS=0, columnwise (blocks of 32 along M): data float8e4nv [BM, BK], scale uint8 [BM/32, BK]
    fp8_block_quantize_tile(x, BLOCK_R, BLOCK_C, SOFT_E4M3=False)
        (BLOCK_R, BLOCK_C) = (1, 128) rowwise, (128, 1) columnwise, (128, 128) weights:
        data float8e4nv [BM, BK], scale float32 [BM/BLOCK_R, BK/BLOCK_C]

BLOCK_M and BLOCK_K must be multiples of the block along each axis. The
training GEMMs pick the axis they reduce over: forward reduces over D
(rowwise activations, weights blocked along D), dgrad over the output dim
(rowwise dY, weights blocked along their rows), wgrad over tokens
(columnwise x and dY).

Stages of one tile (both formats):
  1. ``x`` to float32 (exact; bf16 by a bit shift) and the int32 bit patterns of ``|x|``; for
     non-negative floats integer order is float order, with inf and NaN above
     every finite value.
  2. Block amax: an integer ``tl.max`` over each block (``tl.reshape`` to
     ``[.., blocks, block]``, or a plain reduction when one block spans the
     tile). Exact and NaN-aware, free of float min/max NaN rules.
  3. Per block, from the amax bits: mxfp8 -- E8M0 byte ``max(f - 8, 0)``
     (``f`` = biased exponent field; rceil adds 1 when the mantissa > 1.75)
     and the multiplier ``2**-e`` built as bits ``(254 - byte) << 23``, a
     normal float32 for every finite block (no exp2, no subnormal power);
     fp8-block -- ``amax' = max(amax, 448 * 2**-126)``, scale and multiplier
     ``div_rn(amax', 448)`` and ``div_rn(448, amax')`` (IEEE division; plain
     ``/`` is approximate on the GPU). NaN/inf blocks get a NaN multiplier.
  4. Multiplier broadcast back to ``[BM, BK]``; ``y = x * multiplier``.
  5. E4M3 round-to-nearest-even with saturation, see ``_e4m3_bits``.
  6. Elements whose ``y`` is NaN (exactly those of NaN/inf blocks) become 0x7F.

E4M3 conversion. Compiled, ``clamp(y, -448, 448).to(tl.float8e4nv)`` lowers to
``min.xorsign.abs.f32`` + ``cvt.rn.satfinite.e4m3x2.f32``: saturate, then round
to nearest even, as torch casts. The
interpreter's fp8 cast is not RNE (it rounds ties away from zero and drops
the carry out of the mantissa), so under ``TRITON_INTERPRET=1`` the tile
functions round in software (``SOFT_E4M3=True``, also runnable compiled): on
``a = |y|`` with ``E = max(floor(log2 a), -6)``, ``(a + c) - c`` with
``c = 1.5 * 2**(E + 20)`` rounds ``a`` to a multiple of ``2**(E - 3)`` (the
E4M3 spacing there, subnormals included) by the float32 adder's own RNE;
the result is then exactly representable, so any cast is exact. ``|y|`` is
taken through its bits, which also keeps the compiler from contracting
``x * m + c`` into an FMA; y's sign goes back on in float32, before the cast
(never as a byte OR on the FP8 bits, which ptxas 12.8 miscompiled for sm_90,
see ``_e4m3_bits``). Kernels that inline the tile functions pass
``SOFT_E4M3=soft_e4m3_default()``.

Hopper build check. ``compile_sm90`` compiles, on a machine without a GPU,
the exact kernel a launch would run (same arguments and JIT specialisation)
for sm_90, and ``sm90_facts`` reads its PTX and SASS: stack-pointer reads (the
signature of that ptxas miscompile), local memory, 16-byte data stores, CTA
barriers. ``python -m megamoe.kernels.quant`` runs it over every tile the GPU
test and the defaults use (tests/test_formats.py::test_sm90_builds_are_sane).

Standalone kernel ``_quantize_kernel`` (launched by ``quantize_activations``
and ``quantize_weights``), one program per ``[BLOCK_M, BLOCK_K]`` tile:

    x      [B, M, K] float32/bfloat16/float16, any strides;
           B = experts of a weight stack, 1 for activations
    data   [B, M, K] uint8 view of float8_e4m3fn, any strides (a transposed
           output is the strided view of a [B, K, M] tensor)
    scale  [B, M / BLOCK_R, K / BLOCK_C] uint8 (mxfp8) or float32 (fp8-block)

    program_id(0) = t, the tile of one matrix: tile row t // tiles_k, tile
                    column t % tiles_k (K-tiles fastest, so neighbouring
                    programs stream neighbouring memory)
    program_id(1) = b, the matrix (expert) index; its offset is int64

Rows >= M and columns >= K are loaded as 0 and not stored; M and K are
multiples of the block along the blocked axes, so every block is whole.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megamoe.checks import check_tensors
from megamoe.formats import (
    FORMATS,
    FP8_BLOCK,
    FP8_BLOCK_AMAX_FLOOR,
    MX_BLOCK,
    check_quant_input,
    check_rounding,
    normalize_dim,
)

__all__ = [
    "QuantConfig",
    "compile_sm90",
    "default_config",
    "fp8_block_quantize_tile",
    "mxfp8_quantize_tile",
    "quantize_activations",
    "quantize_weights",
    "sm90_facts",
    "sm90_report",
    "soft_e4m3_default",
]

_ABS_MASK: tl.constexpr = tl.constexpr(0x7FFFFFFF)
_INF_BITS: tl.constexpr = tl.constexpr(0x7F800000)
_NAN_BITS: tl.constexpr = tl.constexpr(0x7FC00000)
_MANT_1_75: tl.constexpr = tl.constexpr(0x600000)
_E4M3_NAN: tl.constexpr = tl.constexpr(0x7F)
_E4M3_MAX: tl.constexpr = tl.constexpr(448.0)
_AMAX_FLOOR: tl.constexpr = tl.constexpr(FP8_BLOCK_AMAX_FLOOR)


# ------------------------------------------------------------ tile functions


@triton.jit
def _block_max(v, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """int32 ``v [BM, BK]`` -> its max over each ``BLOCK_R x BLOCK_C`` block, ``[BM/BLOCK_R, BK/BLOCK_C]``."""
    BM: tl.constexpr = v.shape[0]
    BK: tl.constexpr = v.shape[1]
    if BLOCK_R == 1 and BLOCK_C == BK:  # one block across: no reshape
        r = tl.max(v, axis=1, keep_dims=True)
    elif BLOCK_C == 1 and BLOCK_R == BM:
        r = tl.max(v, axis=0, keep_dims=True)
    elif BLOCK_R == 1:
        r = tl.max(tl.reshape(v, [BM, BK // BLOCK_C, BLOCK_C]), axis=2)
    elif BLOCK_C == 1:
        r = tl.max(tl.reshape(v, [BM // BLOCK_R, BLOCK_R, BK]), axis=1)
    else:
        r4 = tl.reshape(v, [BM // BLOCK_R, BLOCK_R, BK // BLOCK_C, BLOCK_C])
        r = tl.max(tl.max(r4, axis=3), axis=1)
    return r


@triton.jit
def _block_expand(s, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Per-block ``s [BM/BLOCK_R, BK/BLOCK_C]`` -> ``[BM, BK]``, each value repeated over its block."""
    SM: tl.constexpr = s.shape[0]
    SK: tl.constexpr = s.shape[1]
    if (BLOCK_R == 1 and SK == 1) or (BLOCK_C == 1 and SM == 1):  # one block across: plain broadcast
        r = tl.broadcast_to(s, [SM * BLOCK_R, SK * BLOCK_C])
    elif BLOCK_R == 1:
        r = tl.reshape(tl.broadcast_to(s[:, :, None], [SM, SK, BLOCK_C]), [SM, SK * BLOCK_C])
    elif BLOCK_C == 1:
        r = tl.reshape(tl.broadcast_to(s[:, None, :], [SM, BLOCK_R, SK]), [SM * BLOCK_R, SK])
    else:
        r4 = tl.broadcast_to(s[:, None, :, None], [SM, BLOCK_R, SK, BLOCK_C])
        r = tl.reshape(r4, [SM * BLOCK_R, SK * BLOCK_C])
    return r


@triton.jit
def _to_float32(x):
    """``x`` as float32, exactly. bf16 goes through its bits (``<< 16``): the
    interpreter's own bf16 -> fp32 cast mangles subnormals; compiled, this is
    the same shift the cast lowers to."""
    if x.dtype == tl.bfloat16:
        xf = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        xf = x.to(tl.float32)
    return xf


@triton.jit
def _e4m3_bits(y, SOFT_E4M3: tl.constexpr):
    """uint8 E4M3 bits of ``rne(clamp(y, -448, 448))`` for float32 ``y`` (NaN ``y``: unspecified)."""
    if SOFT_E4M3:
        y_bits = y.to(tl.int32, bitcast=True)
        a_bits = y_bits & _ABS_MASK
        a = a_bits.to(tl.float32, bitcast=True)
        # E = max(floor(log2 a), -6): below 2**-6 E4M3 is subnormal with spacing 2**-9.
        e_bits = tl.maximum(a_bits & _INF_BITS, (127 - 6) << 23)
        # c = 1.5 * 2**(E + 20): a + c lies in [2**(E+20), 2**(E+21)), where float32 spacing is 2**(E-3).
        c = ((e_bits + (20 << 23)) | 0x400000).to(tl.float32, bitcast=True)
        r = tl.minimum((a + c) - c, _E4M3_MAX)
        # The sign goes back on in float32 (``y_bits ^ a_bits`` is y's sign bit), never on
        # the converted bytes: OR-ing a sign byte into the FP8 bits had LLVM pack the bytes
        # of two e4m3x2 conversions into 16-bit halves, which ptxas 12.8 (Triton 3.6's, for
        # sm_90) turned into F2FP...MERGE_C sequences reading R1, the stack pointer, for
        # some high bytes: a transposed store wrote 0xFC for ~20% of the elements.
        r = (r.to(tl.int32, bitcast=True) | (y_bits ^ a_bits)).to(tl.float32, bitcast=True)
        bits = r.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        bits = tl.clamp(y, -_E4M3_MAX, _E4M3_MAX).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return bits


@triton.jit
def mxfp8_quantize_tile(x, AXIS: tl.constexpr, RCEIL: tl.constexpr = False, SOFT_E4M3: tl.constexpr = False):
    """MXFP8 of a register tile ``x [BM, BK]`` with 32-blocks along ``AXIS``.

    Returns ``data`` float8e4nv ``[BM, BK]`` and ``scale`` uint8 E8M0
    (``[BM, BK/32]`` for AXIS=1, ``[BM/32, BK]`` for AXIS=0), as
    ``megamoe.formats.mxfp8_quantize`` (``rounding="rceil"`` when RCEIL).
    """
    tl.static_assert(AXIS == 0 or AXIS == 1, "AXIS must be 0 (columnwise) or 1 (rowwise)")
    BLOCK_R: tl.constexpr = 32 if AXIS == 0 else 1
    BLOCK_C: tl.constexpr = 1 if AXIS == 0 else 32
    xf = _to_float32(x)
    amax = _block_max(xf.to(tl.int32, bitcast=True) & _ABS_MASK, BLOCK_R, BLOCK_C)
    f = amax >> 23
    if RCEIL:
        f = f + ((amax & 0x7FFFFF) > _MANT_1_75).to(tl.int32)
    bad = amax >= _INF_BITS
    byte = tl.where(bad, 255, tl.maximum(f - 8, 0))
    mult = tl.where(bad, _NAN_BITS, (254 - byte) << 23).to(tl.float32, bitcast=True)
    y = xf * _block_expand(mult, BLOCK_R, BLOCK_C)
    bits = tl.where(y != y, _E4M3_NAN, _e4m3_bits(y, SOFT_E4M3))
    return bits.to(tl.float8e4nv, bitcast=True), byte.to(tl.uint8)


@triton.jit
def fp8_block_quantize_tile(x, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, SOFT_E4M3: tl.constexpr = False):
    """FP8-block of a register tile ``x [BM, BK]`` with ``BLOCK_R x BLOCK_C`` blocks.

    Returns ``data`` float8e4nv ``[BM, BK]`` and ``scale`` float32
    ``[BM/BLOCK_R, BK/BLOCK_C]``, as ``megamoe.formats.fp8_block_quantize``.
    """
    xf = _to_float32(x)
    amax_bits = _block_max(xf.to(tl.int32, bitcast=True) & _ABS_MASK, BLOCK_R, BLOCK_C)
    bad = amax_bits >= _INF_BITS
    amax = tl.maximum(amax_bits.to(tl.float32, bitcast=True), _AMAX_FLOOR)
    scale = tl.math.div_rn(amax, _E4M3_MAX)
    inv = tl.math.div_rn(_E4M3_MAX, amax)
    scale = tl.where(bad, _NAN_BITS, scale.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    inv = tl.where(bad, _NAN_BITS, inv.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    y = xf * _block_expand(inv, BLOCK_R, BLOCK_C)
    bits = tl.where(y != y, _E4M3_NAN, _e4m3_bits(y, SOFT_E4M3))
    return bits.to(tl.float8e4nv, bitcast=True), scale


# ------------------------------------------------------------ standalone kernel


@triton.jit
def _quantize_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    copy_ptr,
    M,
    K,
    stride_x_b,
    stride_x_m,
    stride_x_k,
    stride_d_b,
    stride_d_m,
    stride_d_k,
    stride_s_b,
    stride_s_m,
    stride_s_k,
    stride_c_b,
    stride_c_m,
    stride_c_k,
    COPY: tl.constexpr,
    MX: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    RCEIL: tl.constexpr,
    SOFT_E4M3: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    tiles_k = tl.cdiv(K, BLOCK_K)
    m0 = (pid // tiles_k) * BLOCK_M
    k0 = (pid % tiles_k) * BLOCK_K
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    mask = (rm[:, None] < M - m0) & (rk[None, :] < K - k0)

    x_tile = x_ptr + (b * stride_x_b + m0.to(tl.int64) * stride_x_m + k0.to(tl.int64) * stride_x_k)
    x = tl.load(x_tile + rm[:, None] * stride_x_m + rk[None, :] * stride_x_k, mask=mask, other=0.0)
    if COPY:  # x unchanged too (a staging copy fused into the one read of x)
        c_tile = copy_ptr + (b * stride_c_b + m0.to(tl.int64) * stride_c_m + k0.to(tl.int64) * stride_c_k)
        tl.store(c_tile + rm[:, None] * stride_c_m + rk[None, :] * stride_c_k, x, mask=mask)
    if MX:
        data, scale = mxfp8_quantize_tile(x, 0 if BLOCK_R == 32 else 1, RCEIL, SOFT_E4M3)
    else:
        data, scale = fp8_block_quantize_tile(x, BLOCK_R, BLOCK_C, SOFT_E4M3)

    d_tile = data_ptr + (b * stride_d_b + m0.to(tl.int64) * stride_d_m + k0.to(tl.int64) * stride_d_k)
    tl.store(d_tile + rm[:, None] * stride_d_m + rk[None, :] * stride_d_k, data.to(tl.uint8, bitcast=True), mask=mask)

    sm = tl.arange(0, BLOCK_M // BLOCK_R)
    sk = tl.arange(0, BLOCK_K // BLOCK_C)
    s_mask = (sm[:, None] < (M - m0) // BLOCK_R) & (sk[None, :] < (K - k0) // BLOCK_C)
    s_tile = scale_ptr + (
        b * stride_s_b + (m0 // BLOCK_R).to(tl.int64) * stride_s_m + (k0 // BLOCK_C).to(tl.int64) * stride_s_k
    )
    tl.store(s_tile + sm[:, None] * stride_s_m + sk[None, :] * stride_s_k, scale, mask=s_mask)


# ------------------------------------------------------------ launch wrappers


@dataclass(frozen=True)
class QuantConfig:
    """Tile shape and code path of one quantisation launch.

    Attributes:
        block_m: BLOCK_M, tile rows per program; a power of two, a multiple
            of the block's rows.
        block_k: BLOCK_K, tile columns per program; a power of two, a
            multiple of the block's columns.
        num_warps: warps per program (ignored by the interpreter).
        soft_e4m3: None picks the hardware E4M3 conversion when compiled and
            the software rounding under TRITON_INTERPRET=1; True pins the
            software rounding; False the hardware one (refused under the
            interpreter, whose fp8 cast is not round-to-nearest-even).
    """

    block_m: int
    block_k: int
    num_warps: int = 8
    soft_e4m3: bool | None = None

    def __post_init__(self) -> None:
        for name in ("block_m", "block_k", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value & (value - 1):
                raise ValueError(f"QuantConfig.{name} must be a power of two, got {value!r}")
        if self.soft_e4m3 not in (None, True, False):
            raise ValueError(f"QuantConfig.soft_e4m3 must be None, True or False, got {self.soft_e4m3!r}")


def default_config(block: tuple[int, int]) -> QuantConfig:
    """The tile for ``block`` (rows, cols).

    The fastest tile of the H200 sweep (benchmarks/quant_bench.py; bf16 [16384, 7168] activations,
    [32, 4096, 7168] weights, % of the 4252 GB/s copy ceiling). Rowwise blocks: 16 x 512, 4 warps
    (each warp owns whole rows: the block max is in-thread plus two shuffles). Columnwise blocks
    run across rows, and a tile whose warps split a block (every tile here with > 1 warp) reduces
    through shared memory (4-6 CTA barriers, ``BLOCK_K x warps`` partials): fewer warps per block
    was faster on the GPU (32 x 128 w2 71 % vs 32 x 256 w4 48 %, w8 29 %). One-warp tiles (the
    block max in-thread plus shuffles, no barrier) win for 32-row blocks; each columnwise default
    is the tile best for both output layouts (row-major and transposed), 2026-11-29 sweep in
    benchmarks/results/2026-11-29-quant-defaults.
    """
    br, bc = block
    if (br, bc) == (1, MX_BLOCK):
        return QuantConfig(block_m=16, block_k=512, num_warps=4)  # 93 % (32 x 512 w8: 91.5 %)
    if (br, bc) == (MX_BLOCK, 1):
        return QuantConfig(block_m=64, block_k=64, num_warps=1)  # 80 %, transposed 71.5 % (32 x 128 w2: 71 / 66 %)
    if (br, bc) == (1, FP8_BLOCK):
        return QuantConfig(block_m=16, block_k=512, num_warps=4)  # 83 %
    if (br, bc) == (FP8_BLOCK, 1):
        return QuantConfig(block_m=128, block_k=64, num_warps=2)  # 65 %, transposed 82 % (w4: 63 / 61 %)
    return QuantConfig(block_m=128, block_k=128, num_warps=8)  # 128x128 weights: 90 %


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def soft_e4m3_default() -> bool:
    """The ``SOFT_E4M3`` a launcher passes: True under TRITON_INTERPRET=1, False compiled."""
    return _interpreting()


def _resolve_soft(config: QuantConfig) -> bool:
    if config.soft_e4m3 is None:
        return soft_e4m3_default()
    if not config.soft_e4m3 and _interpreting():
        raise ValueError(
            "QuantConfig(soft_e4m3=False) asks for the hardware E4M3 conversion, which the "
            "Triton interpreter does not round to nearest even; use None or True under TRITON_INTERPRET=1"
        )
    return config.soft_e4m3


def _check_config(config: object, block: tuple[int, int]) -> QuantConfig:
    if config is None:
        return default_config(block)
    if not isinstance(config, QuantConfig):
        raise ValueError(f"config must be a QuantConfig or None, got {type(config).__name__}")
    br, bc = block
    if config.block_m % br or config.block_k % bc:
        raise ValueError(
            f"config tile [{config.block_m}, {config.block_k}] must hold whole {br}x{bc} blocks"
        )
    return config


def _check_device(t: torch.Tensor, name: str) -> None:
    if t.device.type != "cuda" and not _interpreting():
        raise ValueError(f"{name} must be a CUDA tensor (or set TRITON_INTERPRET=1 on the CPU), got {t.device}")


def _fmt_block(fmt: object, axis: int, weights: bool) -> tuple[bool, tuple[int, int]]:
    """(is mxfp8, block rows x cols) for a format and the axis (0 rows, 1 cols) blocks run along."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if fmt == "mxfp8":
        return True, ((MX_BLOCK, 1) if axis == 0 else (1, MX_BLOCK))
    if weights:
        return False, (FP8_BLOCK, FP8_BLOCK)
    return False, ((FP8_BLOCK, 1) if axis == 0 else (1, FP8_BLOCK))


def _prepare(
    x_BMK: torch.Tensor,
    mx: bool,
    block: tuple[int, int],
    rounding: str,
    transpose: bool,
    config: QuantConfig,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    copy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
    """Outputs and the ``_quantize_kernel`` launch ``(grid, args, kwargs)`` (None when empty) for
    quantising each ``[M, K]`` matrix of ``x_BMK``: ``data [B, M, K]`` and ``scale [B, M/br, K/bc]``
    (their last two dims swapped, contiguous, when ``transpose``), or ``out`` (not transposed) when given;
    ``copy`` (like ``x_BMK``) also receives x unchanged.
    Works on meta tensors too, which is how ``compile_sm90`` builds exactly the kernel a launch would run."""
    nb, m, k = x_BMK.shape
    br, bc = block
    for i, (size, b) in enumerate(((m, br), (k, bc))):
        if size % b:
            side = "rows" if i == 0 else "cols"
            raise ValueError(f"{side}={size} of shape {tuple(x_BMK.shape)} is not a multiple of the block {block}")
    if nb > 65535:
        raise ValueError(f"at most 65535 matrices per launch, got {nb}")
    dev = x_BMK.device
    scale_dtype = torch.uint8 if mx else torch.float32
    if out is not None:
        data, scale = out
        data_v, scale_v = data, scale
    elif transpose:
        data = torch.empty(nb, k, m, dtype=torch.float8_e4m3fn, device=dev)
        scale = torch.empty(nb, k // bc, m // br, dtype=scale_dtype, device=dev)
        data_v, scale_v = data.transpose(1, 2), scale.transpose(1, 2)
    else:
        data = torch.empty(nb, m, k, dtype=torch.float8_e4m3fn, device=dev)
        scale = torch.empty(nb, m // br, k // bc, dtype=scale_dtype, device=dev)
        data_v, scale_v = data, scale
    if data.numel() == 0:
        return data, scale, None
    bm, bk = config.block_m, config.block_k
    copy_v = x_BMK if copy is None else copy
    for name, t in (("x", x_BMK), ("data", data_v), ("copy", copy_v)):
        if bm * abs(t.stride(1)) + bk * abs(t.stride(2)) >= 2**31:
            raise ValueError(f"{name} strides {t.stride()} overflow int32 tile offsets for tile [{bm}, {bk}]")
    data_u8 = data_v.view(torch.uint8)
    grid = (triton.cdiv(m, bm) * triton.cdiv(k, bk), nb)
    # NOTE: with one matrix its batch strides are passed as 0: Triton then knows they are
    # multiples of 16, which the 16-byte vectorisation of every tile offset depends on.
    strides = [list(t.stride()) for t in (x_BMK, data_u8, scale_v, copy_v)]
    if nb == 1:
        for st in strides:
            st[0] = 0
    args = (x_BMK, data_u8, scale_v, copy_v, m, k, *strides[0], *strides[1], *strides[2], *strides[3])
    kwargs = dict(
        COPY=copy is not None,
        MX=mx,
        BLOCK_R=br,
        BLOCK_C=bc,
        RCEIL=rounding == "rceil",
        SOFT_E4M3=_resolve_soft(config),
        BLOCK_M=bm,
        BLOCK_K=bk,
        num_warps=config.num_warps,
    )
    return data, scale, (grid, args, kwargs)


def _launch(
    x_BMK: torch.Tensor,
    mx: bool,
    block: tuple[int, int],
    rounding: str,
    transpose: bool,
    config: QuantConfig,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    copy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each ``[M, K]`` matrix of ``x_BMK`` (see ``_prepare``)."""
    data, scale, launch = _prepare(x_BMK, mx, block, rounding, transpose, config, out, copy)
    if launch is not None:
        grid, args, kwargs = launch
        _quantize_kernel[grid](*args, **kwargs)
    return data, scale


def quantize_activations(
    x: torch.Tensor,
    fmt: str,
    axis: int = 1,
    *,
    rounding: str = "floor",
    transpose: bool = False,
    config: QuantConfig | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    copy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D activation ``x [M, K]`` with blocks along ``axis``.

    Args:
        x: float32/bfloat16/float16 ``[M, K]``, any strides; CUDA (or CPU
            under TRITON_INTERPRET=1).
        fmt: ``"mxfp8"`` (32-blocks, E8M0 scales) or ``"fp8-block"``
            (128-blocks, float32 scales).
        axis: the axis the blocks run along, the GEMM's reduction axis: 1
            (or -1) rowwise, 0 (or -2) columnwise; that dim must be a
            multiple of the block (32 or 128).
        rounding: mxfp8's exponent rule, ``"floor"`` or ``"rceil"``;
            fp8-block accepts only the default.
        transpose: return ``data.T`` and ``scale.T`` (contiguous ``[K, M]``
            and its scales) instead -- the K-major operand a GEMM reducing
            over M wants; the kernel writes them directly.
        config: tile shape and E4M3 path; None picks ``default_config``.
        out: ``(data, scale)`` to write into instead of new tensors (contiguous, on x's device, the shapes
            and dtypes returned otherwise; not with ``transpose``).
        copy: a contiguous tensor like x (shape, dtype, device) that also receives x unchanged, from the
            same read of x (a staging copy for free); must not overlap x.

    Returns:
        ``(data, scale)`` (``out`` when given) equal bit for bit to ``megamoe.formats``:
        ``mxfp8_quantize(x, dim=axis, rounding=rounding)`` or
        ``fp8_block_quantize(x, block=(1, 128) or (128, 1))``.
    """
    check_quant_input(x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    _check_device(x, "x")
    ax = normalize_dim(axis, 2, "axis")
    check_rounding(rounding)
    mx, block = _fmt_block(fmt, ax, weights=False)
    if not mx and rounding != "floor":
        raise ValueError(f"rounding={rounding!r} applies to mxfp8 only; fp8-block scales are amax / 448")
    if not isinstance(transpose, bool):
        raise ValueError(f"transpose must be a bool, got {transpose!r}")
    cfg = _check_config(config, block)
    if out is not None:
        if transpose:
            raise ValueError("out is not supported with transpose=True")
        (m, k), (br, bc) = x.shape, block
        if not isinstance(out, tuple) or len(out) != 2:
            raise ValueError("out must be a (data, scale) pair of tensors")
        check_tensors((("out data", out[0], (m, k), torch.float8_e4m3fn),
                       ("out scale", out[1], (m // br, k // bc), torch.uint8 if mx else torch.float32)), x.device)
        out = (out[0].unsqueeze(0), out[1].unsqueeze(0))
    if copy is not None:
        check_tensors((("copy", copy, tuple(x.shape), x.dtype),), x.device)
        copy = copy.unsqueeze(0)
    data, scale = _launch(x.unsqueeze(0), mx, block, rounding, transpose, cfg, out, copy)
    return data.squeeze(0), scale.squeeze(0)


def quantize_weights(
    w: torch.Tensor,
    fmt: str,
    *,
    axis: int = -1,
    rounding: str = "floor",
    config: QuantConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight matrix ``[rows, cols]`` or all experts of a stack ``[E, rows, cols]`` in one launch.

    Args:
        w: float32/bfloat16/float16, 2-D or 3-D, any strides; CUDA (or CPU
            under TRITON_INTERPRET=1).
        fmt: ``"mxfp8"`` or ``"fp8-block"``.
        axis: mxfp8 only: the dim the 32-blocks run along, -1 (cols, e.g. D of
            ``w_gate_up [E, 2I, D]`` for the forward GEMM) or -2 (rows, for
            dgrad). fp8-block uses 128x128 blocks, which serve both GEMMs;
            ``axis`` must still name one of the last two dims.
        rounding: mxfp8's exponent rule (``"floor"`` or ``"rceil"``).
        config: tile shape and E4M3 path; None picks ``default_config``.

    Returns:
        ``(data, scale)`` equal bit for bit to
        ``mxfp8_quantize(w, dim=axis, rounding=rounding)`` or
        ``fp8_block_quantize(w, block=(128, 128))``.
    """
    check_quant_input(w, "w")
    if w.dim() not in (2, 3):
        raise ValueError(f"w must be [rows, cols] or [E, rows, cols], got shape {tuple(w.shape)}")
    _check_device(w, "w")
    ax = normalize_dim(axis, w.dim(), "axis")
    if ax < w.dim() - 2:
        raise ValueError(f"axis={axis} must name rows or cols (-2 or -1) of w with shape {tuple(w.shape)}")
    check_rounding(rounding)
    mx, block = _fmt_block(fmt, ax - (w.dim() - 2), weights=True)
    if not mx and rounding != "floor":
        raise ValueError(f"rounding={rounding!r} applies to mxfp8 only; fp8-block scales are amax / 448")
    cfg = _check_config(config, block)
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    data, scale = _launch(w3, mx, block, rounding, False, cfg)
    if w.dim() == 2:
        return data.squeeze(0), scale.squeeze(0)
    return data, scale


# ------------------------------------------------------------ sm_90 build check (no GPU needed)

def compile_sm90(
    shape: tuple[int, ...],
    fmt: str,
    axis: int,
    *,
    weights: bool = False,
    transpose: bool = False,
    rounding: str = "floor",
    config: QuantConfig | None = None,
    dtype: torch.dtype = torch.bfloat16,
):
    """The ``_quantize_kernel`` a ``quantize_activations`` / ``quantize_weights`` call on a CUDA
    tensor of ``shape`` would run, compiled for Hopper (sm_90) on this machine: same arguments,
    same JIT specialisation (strides of 1, 16-divisibility), no GPU. TRITON_INTERPRET must be unset.
    Returns Triton's compiled kernel (``.asm`` has ``ttgir``, ``ptx``, ``cubin``, ``sass``)."""
    if _interpreting():
        raise RuntimeError("unset TRITON_INTERPRET to compile for sm_90")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    x = torch.empty(shape, dtype=dtype, device="meta")
    if weights:
        ax = normalize_dim(axis, x.dim(), "axis")
        mx, block = _fmt_block(fmt, ax - (x.dim() - 2), weights=True)
        x3 = x if x.dim() == 3 else x.unsqueeze(0)
    else:
        mx, block = _fmt_block(fmt, normalize_dim(axis, 2, "axis"), weights=False)
        x3 = x.unsqueeze(0)
    cfg = _check_config(config, block)
    _, _, launch = _prepare(x3, mx, block, rounding, transpose, cfg)
    assert launch is not None, "empty tensors launch nothing"
    _, args, kwargs = launch
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    kernel = _quantize_kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, {"num_warps": cfg.num_warps}, bound, specialization, options
    )
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=target, options={"num_warps": cfg.num_warps})


def _ptx_undefined_registers(ptx: str) -> list[str]:
    """PTX virtual registers that are read but never written: LLVM's undef/poison lanes (bytes a
    later ``prmt`` overwrites). ptxas may read any physical register for them, R1 included."""
    import re

    reg = re.compile(r"%[a-z]+\d+")
    defined: set[str] = set()
    read: set[str] = set()
    for line in ptx.splitlines():
        line = line.split("//", 1)[0].strip()
        if not line.endswith(";") or line.startswith("."):
            continue
        line = re.sub(r"^@!?%p\d+\s+", "", line[:-1])
        op, _, operands = line.partition(" ")
        operands = operands.strip()
        if op.startswith(("st.", "bar.", "red.", "bra", "ret", "prefetch")):
            read.update(reg.findall(operands))
            continue
        if operands.startswith("{"):
            dst, _, src = operands[1:].partition("}")
        else:
            dst, _, src = operands.partition(",")
        defined.update(reg.findall(dst))
        read.update(reg.findall(src))
    return sorted(read - defined)


def sm90_facts(compiled) -> dict:
    """What the Hopper build of one quantiser looks like, from its PTX and SASS.

    ``stack_pointer_reads`` counts SASS instructions other than the prologue's ``LDC R1,
    c[0x0][0x28]`` that read R1, the stack pointer. These kernels use no stack, so such a read
    can only stand for a PTX register that is never written (``ptx_undefined_registers``: bytes
    of a packed vector that a later ``prmt`` overwrites, harmless); with none of those, it is a
    ptxas miscompile (``suspect``). The ptxas bundled with Triton 3.6 (12.8) produced exactly that for
    the old byte-level ``fp8 | sign`` of the software E4M3 path, and transposed stores wrote the
    pointer's byte 0xFC for ~20% of the elements on an H200. ``data_stores_16b`` counts 16-byte
    global stores (the data tile; scales are narrower); ``barriers`` the CTA barriers (shared
    memory reductions and layout conversions)."""
    import re

    sass = [line.split("\t", 1)[-1].strip() for line in compiled.asm["sass"].splitlines()[1:]]
    sass = [line for line in sass if line and not line.startswith("NOP")]
    r1 = re.compile(r"(?<![\w.])R1(?!\w)")
    sp_reads = []
    for ins in sass:
        ins = re.sub(r"^@!?U?P\w+\s+", "", ins)  # guard predicate
        operands = ins.split(" ", 1)[1] if " " in ins else ""
        if re.match(r"R1\b", operands):  # R1 as the destination: skip it, look at the sources
            operands = operands.split(",", 1)[1] if "," in operands else ""
        if r1.search(operands):
            sp_reads.append(ins)
    ptx = compiled.asm["ptx"]
    undefined = _ptx_undefined_registers(ptx)
    return {
        "sass_instructions": len(sass),
        "stack_pointer_reads": len(sp_reads),
        "stack_pointer_read_example": sp_reads[0] if sp_reads else None,
        "ptx_undefined_registers": len(undefined),
        "suspect": bool(sp_reads) and not undefined,
        "data_stores_16b": ptx.count("st.global.v4.b32"),
        "barriers": ptx.count("bar.sync"),
        "shared_bytes": compiled.metadata.shared,
        "local_memory": "ld.local" in ptx or "st.local" in ptx or any(i.startswith(("STL", "LDL")) for i in sass),
    }


def sm90_check_cases() -> list[dict]:
    """The launches of tests/test_formats.py::test_compiled_kernels_match_torch_on_gpu (its explicit
    tile and every default tile), as ``compile_sm90`` keywords, with the hardware and with the
    software E4M3 rounding. (benchmarks/quant_bench.py checks its sweep tiles on the GPU.)"""
    cases = []
    for fmt in FORMATS:
        for axis in (1, 0):
            for transpose in (False, True):
                d = default_config(_fmt_block(fmt, axis, weights=False)[1])
                gpu_test_tile = (128, 128 if axis == 0 and fmt == "fp8-block" else 256, 8)
                tiles = {(d.block_m, d.block_k, d.num_warps), gpu_test_tile}
                for bm, bk, nw in sorted(tiles):
                    for soft in (False, True):
                        cases.append(dict(shape=(4096, 7168), fmt=fmt, axis=axis, transpose=transpose,
                                          config=QuantConfig(bm, bk, nw, soft_e4m3=soft)))
    for fmt, axis in (("mxfp8", -1), ("mxfp8", -2), ("fp8-block", -1)):
        for soft in (False, True):
            block = _fmt_block(fmt, axis + 2, weights=True)[1]
            d = default_config(block)
            cases.append(dict(shape=(4, 1024, 2048), fmt=fmt, axis=axis, weights=True,
                              config=QuantConfig(d.block_m, d.block_k, d.num_warps, soft_e4m3=soft)))
    return cases


def _describe_case(case: dict) -> str:
    c = case["config"]
    return (f"{'w' if case.get('weights') else 'act'} {case['fmt']} axis={case['axis']}"
            f"{' ->T' if case.get('transpose') else ''} tile {c.block_m}x{c.block_k} w{c.num_warps}"
            f"{' soft' if c.soft_e4m3 else ''}")


def _sm90_one(case: dict) -> dict:
    return {"case": _describe_case(case), **sm90_facts(compile_sm90(**case))}


def sm90_report(cases: list[dict] | None = None, processes: int | None = None) -> list[dict]:
    """``sm90_facts`` for each case (default ``sm90_check_cases()``), compiled in parallel."""
    from concurrent.futures import ProcessPoolExecutor

    cases = sm90_check_cases() if cases is None else cases
    processes = processes or min(8, os.cpu_count() or 1)
    if processes <= 1:
        return [_sm90_one(c) for c in cases]
    with ProcessPoolExecutor(processes) as pool:
        return list(pool.map(_sm90_one, cases))


if __name__ == "__main__":  # python -m megamoe.kernels.quant: the Hopper build check, one JSON line
    import json

    print(json.dumps(sm90_report()))
