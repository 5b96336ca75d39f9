"""Grouped expert GEMM tiles in FP8-block (DeepSeek-V3 recipe): gate/up + SwiGLU + act quantisation, and down.

Same task structure as `megamoe.kernels.expert_gemm` (persistent programs over
(row tile, n-tile) tasks built on the device; see `megamoe.kernels.tasks.tile_task`), with E4M3
operands and fp32 block scales:

    x_q [R, D] e4m3, x_scale [R, D/128] fp32              activations, 1x128 blocks along D
    w_gate_up_q [L*2I, D] e4m3, scale [L, 2I/128, D/128]  weights, 128x128 blocks
    h [R, 2I] bf16 (optional, kept for the backward)
    act_q [R, I] e4m3, act_scale [R, I/128] fp32          SwiGLU output, 1x128 blocks along I
    w_down_q [L*D, I] e4m3, scale [L, D/128, I/128]
    y [R, D] bf16

Promotion (DeepGEMM): BLOCK_K = 128, so every K step covers exactly one scale
per row of A and one per 128-row block of W. Each step runs the FP8 tensor-core
product into a fresh fp32 tile and folds it into the fp32 accumulator with the
step's scales: ``acc += dot(a_q, w_qᵀ) * (a_scale[:, kb] * w_scale[nb, kb])``.
The fresh tile is the price of per-block scales (no cross-step wgmma chaining).

Gate/up tiles are BLOCK_N = 128 act columns (a gate and an up tile), so the
epilogue's act tile holds exactly one 1x128 block per row and is quantised in
registers by `fp8_block_quantize_tile` before it is stored. Down tiles may be
BLOCK_N 64/128 (one weight scale) or a multiple of 128 (a scale per column).

Rows past a region's end are loaded (TMA) but their scales are read as 0 and
their outputs are masked off, as in the BF16 kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megamoe.kernels.convert import to_bf16
from megamoe.kernels.activation import activation
from megamoe.kernels.expert_bias import add_bias
from megamoe.kernels.tasks import tile_task
from megamoe.kernels.quant import fp8_block_quantize_tile


@triton.jit
def _dot_block(a, w, DOT_FP32: tl.constexpr):
    """a [BM, 128] · w [BN, 128]ᵀ in fp32 (FP8 wgmma compiled). Under the interpreter the products and their
    sum in FP64 (exact for E4M3), then rounded once: numpy's FP32 matmul rounds a row by its place in the tile."""
    if DOT_FP32:
        wide = tl.zeros((a.shape[0], w.shape[0]), dtype=tl.float64)
        a, w = a.to(tl.float32).to(tl.float64), w.to(tl.float32).to(tl.float64)  # E4M3 -> fp32 is exact
        return tl.dot(a, w.T, wide, out_dtype=tl.float64).to(tl.float32)
    return tl.dot(a, w.T)


@triton.jit
def _w_scales(w_scale_ptr, w_row0, kb, stride_ws_n, BLOCK_N: tl.constexpr):
    """Weight scales of W rows w_row0 .. w_row0+BN at K block kb: a scalar when the tile lies in one
    128-row block, else a [1, BN] row (one per column of the output tile)."""
    if BLOCK_N <= 128:
        s = tl.load(w_scale_ptr + (w_row0 // 128) * stride_ws_n + kb)
    else:
        nb = (w_row0 + tl.arange(0, BLOCK_N)) // 128
        s = tl.load(w_scale_ptr + nb * stride_ws_n + kb)[None, :]
    return s


@triton.jit
def gate_up_fp8_tile(
    x_desc, w_desc, x_scale_ptr, w_scale_ptr, h_ptr, act_q_ptr, act_scale_ptr,
    stride_xs, stride_ws_n, stride_h, stride_act, stride_as,
    row0, row_end, expert, n0, I, K, limit, alpha,
    ACT: tl.constexpr, STORE_H: tl.constexpr, DOT_FP32: tl.constexpr, SOFT_E4M3: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, b_ptr=None,
):
    """One [BLOCK_M rows x 128 act columns] tile: gate and up with per-block promotion (plus the optional bias
    ``b_ptr`` `[L, 2I]`), SwiGLU, act quantised 1x128 (act_q, act_scale) and optionally h (bf16), rows < row_end."""
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_gate_row = expert * 2 * I + n0  # row of the flattened [L*2I, D] weight
    w_up_row = w_gate_row + I
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    xs_rows = x_scale_ptr + rows.to(tl.int64) * stride_xs
    ws_base = w_scale_ptr + expert.to(tl.int64) * (2 * I // 128) * stride_ws_n
    for k in range(0, K, 128):
        kb = k // 128
        a = x_desc.load([row0, k])
        wg = w_desc.load([w_gate_row, k])
        wu = w_desc.load([w_up_row, k])
        a_s = tl.load(xs_rows + kb, mask=row_ok, other=0.0)
        sg = _w_scales(ws_base, n0, kb, stride_ws_n, BLOCK_N)
        su = _w_scales(ws_base, I + n0, kb, stride_ws_n, BLOCK_N)
        acc_gate += _dot_block(a, wg, DOT_FP32) * (a_s[:, None] * sg)
        acc_up += _dot_block(a, wu, DOT_FP32) * (a_s[:, None] * su)
    cols = n0 + tl.arange(0, BLOCK_N)
    acc_gate = add_bias(acc_gate, b_ptr, expert * 2 * I, cols, I)
    acc_up = add_bias(acc_up, b_ptr, expert * 2 * I + I, cols, I)
    mask = row_ok[:, None] & (cols < I)[None, :]
    if STORE_H:
        h_tile = h_ptr + rows.to(tl.int64)[:, None] * stride_h + cols[None, :]
        tl.store(h_tile, to_bf16(acc_gate, DOT_FP32), mask=mask)
        tl.store(h_tile + I, to_bf16(acc_up, DOT_FP32), mask=mask)
    act = activation(acc_gate, acc_up, limit, alpha, ACT)
    act_q, act_s = fp8_block_quantize_tile(act, 1, 128, SOFT_E4M3)  # [BM, BN], [BM, BN/128]
    act_tile = act_q_ptr + rows.to(tl.int64)[:, None] * stride_act + cols[None, :]
    tl.store(act_tile, act_q.to(tl.uint8, bitcast=True), mask=mask)
    s_cols = n0 // 128 + tl.arange(0, BLOCK_N // 128)
    s_tile = act_scale_ptr + rows.to(tl.int64)[:, None] * stride_as + s_cols[None, :]
    tl.store(s_tile, act_s, mask=row_ok[:, None])


@triton.jit
def down_fp8_tile(
    act_desc, w_desc, act_scale_ptr, w_scale_ptr, y_ptr,
    stride_as, stride_ws_n, stride_y,
    row0, row_end, expert, n0, D, K,
    DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, b_ptr=None, y_index_ptr=None,
):
    """One [BLOCK_M x BLOCK_N] tile of y = dequant(act_q) · dequant(w_down_q[expert])ᵀ (+ the optional bias
    ``b_ptr`` `[L, D]`; K = I), rows < row_end: row r to y row r, or with ``y_index_ptr`` (int32) to y row
    ``y_index[r]`` (rows whose index is < 0 not stored: the FP8 backward's dx into its rows' slots)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_row = expert * D + n0
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    as_rows = act_scale_ptr + rows.to(tl.int64) * stride_as
    ws_base = w_scale_ptr + expert.to(tl.int64) * (D // 128) * stride_ws_n
    for k in range(0, K, 128):
        kb = k // 128
        a = act_desc.load([row0, k])
        w = w_desc.load([w_row, k])
        a_s = tl.load(as_rows + kb, mask=row_ok, other=0.0)
        s = _w_scales(ws_base, n0, kb, stride_ws_n, BLOCK_N)
        acc += _dot_block(a, w, DOT_FP32) * (a_s[:, None] * s)
    cols = n0 + tl.arange(0, BLOCK_N)
    acc = add_bias(acc, b_ptr, expert * D, cols, D)
    dest = rows.to(tl.int64)
    if y_index_ptr is not None:
        dest = tl.load(y_index_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        row_ok = row_ok & (dest >= 0)
    mask = row_ok[:, None] & (cols < D)[None, :]
    tl.store(y_ptr + dest[:, None] * stride_y + cols[None, :], to_bf16(acc, DOT_FP32), mask=mask)


@triton.jit
def gate_up_fp8_kernel(
    x_desc, w_desc, x_scale_ptr, w_scale_ptr, h_ptr, act_q_ptr, act_scale_ptr,
    stride_xs, stride_ws_n, stride_h, stride_act, stride_as,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr,
    I, K, limit, alpha,
    ACT: tl.constexpr, STORE_H: tl.constexpr, DOT_FP32: tl.constexpr, SOFT_E4M3: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr, b_ptr=None,
):
    """Persistent FP8-block gate/up + SwiGLU + act quantisation over every (tile, n-tile) task (``b_ptr``: the
    optional bias `[L, 2I]`)."""
    tl.static_assert(BLOCK_N % 128 == 0, "gate/up tiles must hold whole 1x128 act blocks")
    num_n = tl.cdiv(I, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr)
    num_tasks = num_tiles * num_n
    for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS, flatten=FLATTEN):
        expert, row0, row_end, n = tile_task(
            task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, GROUP_M)
        gate_up_fp8_tile(
            x_desc, w_desc, x_scale_ptr, w_scale_ptr, h_ptr, act_q_ptr, act_scale_ptr,
            stride_xs, stride_ws_n, stride_h, stride_act, stride_as,
            row0, row_end, expert, n * BLOCK_N, I, K, limit, alpha,
            ACT, STORE_H, DOT_FP32, SOFT_E4M3, BLOCK_M, BLOCK_N, b_ptr,
        )


@triton.jit
def down_fp8_kernel(
    act_desc, w_desc, act_scale_ptr, w_scale_ptr, y_ptr,
    stride_as, stride_ws_n, stride_y,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr,
    D, K,
    DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, b_ptr=None,
    y_index_ptr=None,
):
    """Persistent FP8-block down projection over every (tile, n-tile) task (``b_ptr``: the optional bias
    `[L, D]`; ``y_index_ptr``: the rows' destinations, :func:`down_fp8_tile`)."""
    tl.static_assert(BLOCK_N % 128 == 0 or 128 % BLOCK_N == 0, "down BLOCK_N must divide or be a multiple of 128")
    num_n = tl.cdiv(D, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr)
    num_tasks = num_tiles * num_n
    for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS, flatten=FLATTEN):
        expert, row0, row_end, n = tile_task(
            task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, GROUP_M)
        down_fp8_tile(act_desc, w_desc, act_scale_ptr, w_scale_ptr, y_ptr, stride_as, stride_ws_n, stride_y,
                      row0, row_end, expert, n * BLOCK_N, D, K, DOT_FP32, BLOCK_M, BLOCK_N, b_ptr, y_index_ptr)
