"""Grouped expert GEMM tiles in MXFP8 (OCP MX: E4M3 elements, one E8M0 scale per 32 along K) on Hopper.

Hopper has no block-scaled MMA, so the tiles dequantise on load (exact), with the task structure of
`megamoe.kernels.expert_gemm` (persistent programs over (row tile, n-tile) tasks, `megamoe.kernels.tasks.tile_task`):

    x_q [R, D] e4m3, x_scale [R, D/32] u8             rows, 32-blocks along D
    w_gate_up_q [L*2I, D] e4m3, scale [L*2I, D/32] u8 weights, 32-blocks along D
    h [R, 2I] bf16 (optional)
    act_q [R, I] e4m3, act_scale [R, I/32] u8         SwiGLU output, 32-blocks along I
    w_down_q [L*D, I] e4m3, scale [L*D, I/32] u8
    y [R, D] bf16

Each TMA-loaded E4M3 tile is multiplied in registers by its blocks' powers of two and rounded to
bf16, then one bf16 wgmma per BLOCK_K step accumulates in fp32 (wgmma chaining across K as in the BF16
kernel). Exactness of the bf16 operand: an E4M3 value has at most 4 significant bits and |q| in
{0} U [2**-9, 448]; times 2**(s-127) the product has the same <= 4 bits with exponent in
[-9 + s - 127, 8 + s - 127]. bf16 has 8 significant bits, exponent range [-126, 127] normal and
subnormals down to 2**-133, and max (2 - 2**-7) * 2**127. 448 * 2**(s-127) = 1.75 * 2**(s-119) fits
for s <= 246; the smallest element bit 2**(s-136) stays >= 2**-133 for s >= 3. So the bf16 operand
is exact for scale bytes 3..246. The quantiser (formats.mxfp8_quantize: byte = max(f - 8, 0),
f <= 254 for finite amax) never emits a byte above 246; bytes 0..2 (blocks with amax < 2**-116) can
lose their smallest element bits to bf16's subnormal grid (|values| < 2**-110: below anything an
fp32 sum of normal-sized terms keeps). The power of two is built from bits in fp32 (``s << 23``;
byte 0 -> 2**-127 as the subnormal 0x00400000; 255 -> NaN); the fp32 product is exact (no FTZ), the
bf16 cast then only rounds in the case above.

The other exact formulation, e4m3 wgmma per 32-K step with each step's product rescaled by
2**(sa+sw-254) (constexprs RESCALE and INT_EXP, the integer-exponent form), ran at half the speed:
107 / 121 against 205 / 229 TFLOP/s on kimi-k2's expert shapes (benchmarks/results/2026-11-29-fp8-mxfp8).
It was retired; git keeps it.

The gate/up epilogue runs SwiGLU on column chunks (as expert_gemm does, to avoid spills),
quantises each chunk along I with the fused `mxfp8_quantize_tile` (32-blocks per row) and stores
act_q, act_scale (and h in bf16 when STORE_H). Rows past a region's end are loaded (TMA) with their
scales masked to 1.0 and their outputs masked off.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megamoe.kernels.convert import to_bf16
from megamoe.kernels.activation import activation
from megamoe.kernels.expert_bias import add_bias
from megamoe.kernels.expert_gemm import tile_dot
from megamoe.kernels.tasks import tile_task
from megamoe.kernels.quant import mxfp8_quantize_tile

MX = 32  # elements per E8M0 scale (the jitted code spells it 32)
_NAN_BITS: tl.constexpr = tl.constexpr(0x7FC00000)
_SUBNORMAL_2_M127: tl.constexpr = tl.constexpr(0x00400000)


@triton.jit
def _pow2_e8m0(s):
    """E8M0 bytes -> fp32 ``2**(s-127)`` built from bits (0 -> the subnormal 2**-127, 255 -> NaN)."""
    si = s.to(tl.int32)
    bits = tl.where(si == 0, _SUBNORMAL_2_M127, si << 23)
    bits = tl.where(si == 255, _NAN_BITS, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dequant(q, s, DOT_FP32: tl.constexpr):
    """E4M3 tile ``q [M, BK]`` with E8M0 ``s [M, BK/32]`` -> exact bf16 ``q * 2**(s-127)`` (fp32 under the
    interpreter, whose bf16 dot is wrong; the values are the same)."""
    M: tl.constexpr = q.shape[0]
    BK: tl.constexpr = q.shape[1]
    p = _pow2_e8m0(s)
    if BK == 32:
        pe = tl.broadcast_to(p, [M, BK])
    else:
        pe = tl.reshape(tl.broadcast_to(p[:, :, None], [M, BK // 32, 32]), [M, BK])
    v = q.to(tl.float32) * pe
    if not DOT_FP32:
        v = v.to(tl.bfloat16)
    return v


@triton.jit
def _block_scales(s_ptr, rows64, stride_s, k, K, mask, BLOCK_K: tl.constexpr):
    """Scale bytes ``[len(rows), BLOCK_K/32]`` of K columns k .. k+BLOCK_K; masked rows and blocks past K
    (whose data TMA fills with zeros) read 127 = 1.0, so no NaN byte meets those zeros."""
    ks = k // 32 + tl.arange(0, BLOCK_K // 32)
    return tl.load(s_ptr + rows64[:, None] * stride_s + ks[None, :], mask=mask[:, None] & (ks < K // 32)[None, :],
                   other=127)


@triton.jit
def _mx_gemm_pair(
    a_desc, w_desc, a_s_ptr, w_s_ptr, stride_as, stride_ws,
    row0, row_ok, w_row_a, w_row_b, W_ROWS, K,
    TWO: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """fp32 ``dequant(a) · dequant(w[w_row_a ..])ᵀ`` (and, with TWO, the same for w rows w_row_b) over K."""
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N if TWO else 16), dtype=tl.float32)
    rows64 = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    wa64 = (w_row_a + tl.arange(0, BLOCK_N)).to(tl.int64)
    wb64 = (w_row_b + tl.arange(0, BLOCK_N)).to(tl.int64)
    wa_ok = wa64 < W_ROWS  # a tile may run past I (gate/up) or D (down): rows past W are not read
    wb_ok = wb64 < W_ROWS
    for k in range(0, K, BLOCK_K):
        a = _dequant(a_desc.load([row0, k]), _block_scales(a_s_ptr, rows64, stride_as, k, K, row_ok, BLOCK_K),
                     DOT_FP32)
        wa = _dequant(w_desc.load([w_row_a, k]), _block_scales(w_s_ptr, wa64, stride_ws, k, K, wa_ok, BLOCK_K),
                      DOT_FP32)
        acc_a = tile_dot(a, wa.T, acc_a, DOT_FP32)
        if TWO:
            wb = _dequant(w_desc.load([w_row_b, k]),
                          _block_scales(w_s_ptr, wb64, stride_ws, k, K, wb_ok, BLOCK_K), DOT_FP32)
            acc_b = tile_dot(a, wb.T, acc_b, DOT_FP32)
    return acc_a, acc_b


@triton.jit
def _act_store(gate, up, h_base, q_base, s_base, stride_h, stride_act, stride_as, row_ok, c0, I, limit, alpha,
               ACT: tl.constexpr, STORE_H: tl.constexpr, SOFT_E4M3: tl.constexpr, DOT_FP32: tl.constexpr):
    """h (optional), act_q and act_scale for a [BM, W] column chunk (W a multiple of 32) of a row tile."""
    W: tl.constexpr = gate.shape[1]
    local = tl.arange(0, gate.shape[0])
    cols = c0 + tl.arange(0, W)
    mask = row_ok[:, None] & (cols < I)[None, :]
    if STORE_H:
        h_tile = h_base + (local[:, None] * stride_h + cols[None, :])
        tl.store(h_tile, to_bf16(gate, DOT_FP32), mask=mask)
        tl.store(h_tile + I, to_bf16(up, DOT_FP32), mask=mask)
    act = activation(gate, up, limit, alpha, ACT)
    act_q, act_s = mxfp8_quantize_tile(act, 1, False, SOFT_E4M3)  # [BM, W], [BM, W/32]
    tl.store(q_base + (local[:, None] * stride_act + cols[None, :]), act_q.to(tl.uint8, bitcast=True), mask=mask)
    s_cols = c0 // 32 + tl.arange(0, W // 32)
    tl.store(s_base + (local[:, None] * stride_as + s_cols[None, :]), act_s,
             mask=row_ok[:, None] & (s_cols < I // 32)[None, :])


@triton.jit
def gate_up_mxfp8_tile(
    x_desc, w_desc, x_scale_ptr, w_scale_ptr, h_ptr, act_q_ptr, act_scale_ptr,
    stride_xs, stride_ws, stride_h, stride_act, stride_as, row0, row_end, expert, n0, I, W_ROWS, K, limit, alpha,
    ACT: tl.constexpr, STORE_H: tl.constexpr,
    DOT_FP32: tl.constexpr, SOFT_E4M3: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, b_ptr=None,
):
    """One [BLOCK_M rows x BLOCK_N act columns] tile: gate and up (plus the optional bias ``b_ptr`` `[L, 2I]`),
    SwiGLU, act quantised along I (32-blocks) and optionally h, rows < row_end. W_ROWS: rows of the flattened
    [L*2I, D] weight."""
    row_ok = row0 + tl.arange(0, BLOCK_M) < row_end
    w_gate_row = expert * 2 * I + n0
    acc_gate, acc_up = _mx_gemm_pair(
        x_desc, w_desc, x_scale_ptr, w_scale_ptr, stride_xs, stride_ws,
        row0, row_ok, w_gate_row, w_gate_row + I, W_ROWS, K,
        True, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K)
    cols = n0 + tl.arange(0, BLOCK_N)
    acc_gate = add_bias(acc_gate, b_ptr, expert * 2 * I, cols, I)
    acc_up = add_bias(acc_up, b_ptr, expert * 2 * I + I, cols, I)
    # Epilogue on column halves with int32 offsets from per-tile base pointers (as expert_gemm).
    h_base = h_ptr + row0.to(tl.int64) * stride_h
    q_base = act_q_ptr + row0.to(tl.int64) * stride_act
    s_base = act_scale_ptr + row0.to(tl.int64) * stride_as
    g_lo, g_hi = tl.split(tl.permute(tl.reshape(acc_gate, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
    u_lo, u_hi = tl.split(tl.permute(tl.reshape(acc_up, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
    _act_store(g_lo, u_lo, h_base, q_base, s_base, stride_h, stride_act, stride_as, row_ok, n0, I, limit, alpha,
               ACT, STORE_H, SOFT_E4M3, DOT_FP32)
    _act_store(g_hi, u_hi, h_base, q_base, s_base, stride_h, stride_act, stride_as, row_ok,
               n0 + BLOCK_N // 2, I, limit, alpha, ACT, STORE_H, SOFT_E4M3, DOT_FP32)


@triton.jit
def down_mxfp8_tile(
    act_desc, w_desc, act_scale_ptr, w_scale_ptr, y_ptr, stride_as, stride_ws, stride_y,
    row0, row_end, expert, n0, D, W_ROWS, K,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, b_ptr=None,
):
    """One [BLOCK_M x BLOCK_N] tile of y = dequant(act_q) · dequant(w_down_q[expert])ᵀ (+ the optional bias
    ``b_ptr`` `[L, D]`; K = I), rows < row_end. W_ROWS: rows of the flattened [L*D, I] weight."""
    row_ok = row0 + tl.arange(0, BLOCK_M) < row_end
    acc, _unused = _mx_gemm_pair(
        act_desc, w_desc, act_scale_ptr, w_scale_ptr, stride_as, stride_ws,
        row0, row_ok, expert * D + n0, 0, W_ROWS, K,
        False, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K)
    cols = n0 + tl.arange(0, BLOCK_N)
    acc = add_bias(acc, b_ptr, expert * D, cols, D)
    mask = row_ok[:, None] & (cols < D)[None, :]
    y_base = y_ptr + row0.to(tl.int64) * stride_y
    local = tl.arange(0, BLOCK_M)
    tl.store(y_base + (local[:, None] * stride_y + cols[None, :]), to_bf16(acc, DOT_FP32), mask=mask)


@triton.jit
def gate_up_mxfp8_kernel(
    x_desc, w_desc, x_scale_ptr, w_scale_ptr, h_ptr, act_q_ptr, act_scale_ptr,
    stride_xs, stride_ws, stride_h, stride_act, stride_as,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr,
    I, W_ROWS, K, limit, alpha,
    ACT: tl.constexpr, STORE_H: tl.constexpr,
    DOT_FP32: tl.constexpr, SOFT_E4M3: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, b_ptr=None,
):
    """Persistent MXFP8 gate/up + SwiGLU + act quantisation (along I) over every (tile, n-tile) task (``b_ptr``:
    the optional bias `[L, 2I]`)."""
    tl.static_assert(BLOCK_N % 64 == 0, "gate/up BLOCK_N must hold two chunks of whole 32-blocks")
    num_n = tl.cdiv(I, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr)
    num_tasks = num_tiles * num_n
    for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS, flatten=FLATTEN):
        expert, row0, row_end, n = tile_task(
            task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, GROUP_M)
        gate_up_mxfp8_tile(
            x_desc, w_desc, x_scale_ptr, w_scale_ptr, h_ptr, act_q_ptr, act_scale_ptr,
            stride_xs, stride_ws, stride_h, stride_act, stride_as, row0, row_end, expert, n * BLOCK_N, I, W_ROWS, K,
            limit, alpha, ACT, STORE_H, DOT_FP32, SOFT_E4M3, BLOCK_M, BLOCK_N, BLOCK_K, b_ptr)


@triton.jit
def down_mxfp8_kernel(
    act_desc, w_desc, act_scale_ptr, w_scale_ptr, y_ptr,
    stride_as, stride_ws, stride_y,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr,
    D, W_ROWS, K,
    DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr, b_ptr=None,
):
    """Persistent MXFP8 down projection y = dequant(act_q) · dequant(w_down_q[expert])ᵀ (K = I; ``b_ptr``: the
    optional bias `[L, D]`)."""
    num_n = tl.cdiv(D, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr)
    num_tasks = num_tiles * num_n
    for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS, flatten=FLATTEN):
        expert, row0, row_end, n = tile_task(
            task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, GROUP_M)
        down_mxfp8_tile(act_desc, w_desc, act_scale_ptr, w_scale_ptr, y_ptr, stride_as, stride_ws, stride_y,
                        row0, row_end, expert, n * BLOCK_N, D, W_ROWS, K,
                        DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K, b_ptr)
