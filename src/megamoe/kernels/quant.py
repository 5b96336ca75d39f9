"""MXFP8 and FP8-block quantisation in Triton: fusable tile functions and standalone kernels.

Every result matches the pure-PyTorch definitions of :mod:`megamoe.reference.formats`
bit for bit (data bytes, scale bytes, NaN payloads); read that module for the
formats' rules. Here is how the kernels compute them.

Tile functions (``@triton.jit``; later kernels inline them into dispatch,
GEMM epilogues and SwiGLU) take a register tile ``x [BLOCK_M, BLOCK_K]`` of
any float dtype and return ``(data, scale)`` for blocks along either axis:

    mxfp8_quantize_tile(x, AXIS, RCEIL=False, SOFT_E4M3=False)
        AXIS=1, rowwise (blocks of 32 along K):    data float8e4nv [BM, BK], scale uint8 [BM, BK/32]
        AXIS=0, columnwise (blocks of 32 along M): data float8e4nv [BM, BK], scale uint8 [BM/32, BK]
    mxfp8_round_tile(x, AXIS)
        the MXFP8 grid's values of x (quantise then dequantise), float32 [BM, BK]
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

Hopper build check. ``python -m megamoe.tools.sm90 quant`` compiles, on a
machine without a GPU, the exact kernel each launch would run (built from the
launch's own arguments) for sm_90 and reads its PTX and SASS: stack-pointer
reads (the signature of that ptxas miscompile), local memory, 16-byte data
stores, CTA barriers (tests/test_formats.py::test_sm90_builds_are_sane).

Standalone kernel ``quantize_kernel`` (launched by ``megamoe.ops.quant``'s
``quantize_activations`` and ``quantize_weights``), one program per
``[BLOCK_M, BLOCK_K]`` tile:

    x      [B, M, K] float32/bfloat16/float16, any strides;
           B = experts of a weight stack, 1 for activations
    rows   int64 [M] with GATHER (B = 1): output row m is x's row rows[m] (x
           then has any number of rows), a zero row where rows[m] < 0
    with SRC_BLOCK (32 or 128; B = 1): x is uint8 E4M3 bytes with scales
           src_scale [rows of x, K / SRC_BLOCK] (E8M0 or fp32), dequantised on
           load: rows already quantised along K, re-quantised along ``axis``
    data   [B, M, K] uint8 view of float8_e4m3fn, any strides (a transposed
           output is the strided view of a [B, K, M] tensor)
    scale  [B, M / BLOCK_R, K / BLOCK_C] uint8 (mxfp8) or float32 (fp8-block)
    with ROUND (mxfp8): data is bf16 [B, M, K], x rounded to the MXFP8 grid
           (``mxfp8_round_tile``: ``mxfp8_dequantize(*mxfp8_quantize(x))``
           cast to bf16), and no scale is written (MXFP8 as BF16 operands)

    program_id(0) = t, the tile of one matrix: tile row t // tiles_k, tile
                    column t % tiles_k (K-tiles fastest, so neighbouring
                    programs stream neighbouring memory)
    program_id(1) = b, the matrix (expert) index; its offset is int64

Rows >= M and columns >= K are loaded as 0 and not stored; M and K are
multiples of the block along the blocked axes, so every block is whole.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megamoe.kernels.convert import to_bf16
from megamoe.precision import FP8_BLOCK_AMAX_FLOOR

_ABS_MASK: tl.constexpr = tl.constexpr(0x7FFFFFFF)
_INF_BITS: tl.constexpr = tl.constexpr(0x7F800000)
_NAN_BITS: tl.constexpr = tl.constexpr(0x7FC00000)
_MANT_1_75: tl.constexpr = tl.constexpr(0x600000)
_E4M3_NAN: tl.constexpr = tl.constexpr(0x7F)
_SUBNORMAL_2_M127: tl.constexpr = tl.constexpr(0x00400000)
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
def _e4m3_value(y):
    """``rne(clamp(y, -448, 448))`` on the E4M3 grid, as float32, for float32 ``y`` (NaN ``y``: unspecified), in
    float32 arithmetic only (the software rounding of the module docstring)."""
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
    return (r.to(tl.int32, bitcast=True) | (y_bits ^ a_bits)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits(y, SOFT_E4M3: tl.constexpr):
    """uint8 E4M3 bits of ``rne(clamp(y, -448, 448))`` for float32 ``y`` (NaN ``y``: unspecified)."""
    if SOFT_E4M3:
        bits = _e4m3_value(y).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        bits = tl.clamp(y, -_E4M3_MAX, _E4M3_MAX).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return bits


@triton.jit
def mxfp8_quantize_tile(x, AXIS: tl.constexpr, RCEIL: tl.constexpr = False, SOFT_E4M3: tl.constexpr = False):
    """MXFP8 of a register tile ``x [BM, BK]`` with 32-blocks along ``AXIS``.

    Returns ``data`` float8e4nv ``[BM, BK]`` and ``scale`` uint8 E8M0
    (``[BM, BK/32]`` for AXIS=1, ``[BM/32, BK]`` for AXIS=0), as
    ``megamoe.reference.formats.mxfp8_quantize`` (``rounding="rceil"`` when RCEIL).
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
def mxfp8_round_tile(x, AXIS: tl.constexpr):
    """``x [BM, BK]`` rounded to the MXFP8 grid with 32-blocks along ``AXIS``, as float32: the values
    ``mxfp8_dequantize(*mxfp8_quantize(x))`` gives (floor rounding), exactly.

    The E4M3 rounding is ``_e4m3_value``'s float32 arithmetic (no FP8 conversion, the same bits compiled and
    interpreted); the dequantising power ``2**e`` is built from the scale byte's bits (byte 0: the subnormal
    2**-127), and the product is exact in float32 (at most 4 significant bits, none below 2**-136). Blocks holding
    NaN or inf give NaN. Cast to bf16 (round to nearest even) it is what the MXFP8 tiles' ``_dequant`` feeds
    their MMAs: exact but for blocks whose scale byte is below 3 (amax < 2**-116). The tile is worked on as
    ``[.., blocks, 32, ..]`` with the block values expanded back by ``expand_dims`` (no ``_block_expand``): Gluon
    callers' layouts then agree (their epilogues call it on an MMA-layout tile)."""
    tl.static_assert(AXIS == 0 or AXIS == 1, "AXIS must be 0 (columnwise) or 1 (rowwise)")
    BM: tl.constexpr = x.shape[0]
    BK: tl.constexpr = x.shape[1]
    if AXIS == 1:
        xb = tl.reshape(_to_float32(x), [BM, BK // 32, 32])
    else:
        xb = tl.reshape(_to_float32(x), [BM // 32, 32, BK])
    amax = tl.max(xb.to(tl.int32, bitcast=True) & _ABS_MASK, axis=2 if AXIS == 1 else 1)
    bad = amax >= _INF_BITS
    byte = tl.maximum((amax >> 23) - 8, 0)
    mult = tl.where(bad, _NAN_BITS, (254 - byte) << 23).to(tl.float32, bitcast=True)
    power = tl.where(bad, _NAN_BITS, tl.where(byte == 0, _SUBNORMAL_2_M127, byte << 23)).to(tl.float32, bitcast=True)
    if AXIS == 1:
        y = xb * tl.expand_dims(mult, 2)
        r = _e4m3_value(y) * tl.expand_dims(power, 2)
    else:
        y = xb * tl.expand_dims(mult, 1)
        r = _e4m3_value(y) * tl.expand_dims(power, 1)
    return tl.reshape(tl.where(y != y, float("nan"), r), [BM, BK])


@triton.jit
def fp8_block_quantize_tile(x, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, SOFT_E4M3: tl.constexpr = False):
    """FP8-block of a register tile ``x [BM, BK]`` with ``BLOCK_R x BLOCK_C`` blocks.

    Returns ``data`` float8e4nv ``[BM, BK]`` and ``scale`` float32
    ``[BM/BLOCK_R, BK/BLOCK_C]``, as ``megamoe.reference.formats.fp8_block_quantize``.
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
def quantize_kernel(
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
    rows_ptr,
    src_scale_ptr,
    stride_ss_m,
    COPY: tl.constexpr,
    GATHER: tl.constexpr,
    SRC_BLOCK: tl.constexpr,
    MX: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    RCEIL: tl.constexpr,
    SOFT_E4M3: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROUND: tl.constexpr = False,
):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    tiles_k = tl.cdiv(K, BLOCK_K)
    m0 = (pid // tiles_k) * BLOCK_M
    k0 = (pid % tiles_k) * BLOCK_K
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    mask = (rm[:, None] < M - m0) & (rk[None, :] < K - k0)

    if GATHER:  # output row m is x's row rows[m], a zero row where that is negative
        src = tl.load(rows_ptr + m0 + rm, mask=rm < M - m0, other=-1)
        load_mask = mask & (src >= 0)[:, None]
        src64 = src.to(tl.int64)
        x_at = x_ptr + (b * stride_x_b + src64[:, None] * stride_x_m) + (k0 + rk)[None, :].to(tl.int64) * stride_x_k
    else:
        load_mask = mask
        src64 = m0.to(tl.int64) + rm
        x_tile = x_ptr + (b * stride_x_b + m0.to(tl.int64) * stride_x_m + k0.to(tl.int64) * stride_x_k)
        x_at = x_tile + rm[:, None] * stride_x_m + rk[None, :] * stride_x_k
    x = tl.load(x_at, mask=load_mask, other=0.0 if SRC_BLOCK == 0 else 0)
    if SRC_BLOCK:  # x is E4M3 bytes with a scale per SRC_BLOCK along K: dequantised (one fp32 rounding)
        s_at = src_scale_ptr + src64[:, None] * stride_ss_m + ((k0 + rk) // SRC_BLOCK)[None, :]
        if SRC_BLOCK == 32:  # E8M0: 2**(e - 127), exact; 0 -> 2**-127, 255 -> NaN
            e = tl.load(s_at, mask=load_mask, other=127).to(tl.int32)
            x_scale = tl.where(e == 0, 0x400000, e << 23).to(tl.float32, bitcast=True)  # 0x400000: 2**-127
            x_scale = tl.where(e == 255, float("nan"), x_scale)
        else:
            x_scale = tl.load(s_at, mask=load_mask, other=0.0)
        x = x.to(tl.float8e4nv, bitcast=True).to(tl.float32) * x_scale
    if COPY:  # x unchanged too (a staging copy fused into the one read of x)
        c_tile = copy_ptr + (b * stride_c_b + m0.to(tl.int64) * stride_c_m + k0.to(tl.int64) * stride_c_k)
        tl.store(c_tile + rm[:, None] * stride_c_m + rk[None, :] * stride_c_k, x, mask=mask)
    d_tile = data_ptr + (b * stride_d_b + m0.to(tl.int64) * stride_d_m + k0.to(tl.int64) * stride_d_k)
    if ROUND:  # MXFP8 rounded to its grid, stored as bf16 (exact but for scale bytes below 3); no scales
        tl.static_assert(MX and not RCEIL, "ROUND rounds to MXFP8's grid, floor rule")
        rounded = mxfp8_round_tile(x, 0 if BLOCK_R == 32 else 1)
        tl.store(d_tile + rm[:, None] * stride_d_m + rk[None, :] * stride_d_k, to_bf16(rounded, SOFT_E4M3),
                 mask=mask)
        return
    if MX:
        data, scale = mxfp8_quantize_tile(x, 0 if BLOCK_R == 32 else 1, RCEIL, SOFT_E4M3)
    else:
        data, scale = fp8_block_quantize_tile(x, BLOCK_R, BLOCK_C, SOFT_E4M3)

    tl.store(d_tile + rm[:, None] * stride_d_m + rk[None, :] * stride_d_k, data.to(tl.uint8, bitcast=True), mask=mask)

    sm = tl.arange(0, BLOCK_M // BLOCK_R)
    sk = tl.arange(0, BLOCK_K // BLOCK_C)
    s_mask = (sm[:, None] < (M - m0) // BLOCK_R) & (sk[None, :] < (K - k0) // BLOCK_C)
    s_tile = scale_ptr + (
        b * stride_s_b + (m0 // BLOCK_R).to(tl.int64) * stride_s_m + (k0 // BLOCK_C).to(tl.int64) * stride_s_k
    )
    tl.store(s_tile + sm[:, None] * stride_s_m + sk[None, :] * stride_s_k, scale, mask=s_mask)
