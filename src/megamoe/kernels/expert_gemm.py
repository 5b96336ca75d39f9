"""Grouped expert GEMM tiles (BF16): gate/up with SwiGLU in the epilogue, and down.

Index arrays (all on the device, built from the pull schedule without a host sync):

    rows of local expert l:  [offsets[l], offsets[l] + counts[l])  of x_rows / h / act / y
    tile_expert[t], tile_row0[t],  expert, first row and end row of row-tile t (at most
    tile_row_end[t]                BLOCK_M rows), for t < num_tiles[0]; tiles never straddle
                                   experts (nor minibatches, see megamoe.routing.row_tiles.build_row_tiles)
    tile_run[t] = (first, end)     the run of tile t: its expert's consecutive tiles (in its minibatch)
    task -> (tile, n-tile)         groups of GROUP_M tiles inside a run, n-tile outer inside a group
                                   (megamoe.kernels.tasks): the weight slice is read once per group, the
                                   group's rows stay in L2 across its n-tiles

Tensors (R = capacity rows of the routed buffer):

    x_rows [R, D] bf16         routed tokens           (TMA descriptor, block [BM, BK])
    w_gate_up [L*2I, D] bf16   gate rows, then up rows per expert (descriptor, [BN, BK])
    h [R, 2I] bf16             pre-activation, kept for the backward
    act [R, I] bf16            the activation of h (ACT: megamoe.kernels.activation)
    w_down [L*D, I] bf16       (descriptor, [BN, BK])
    y [R, D] bf16              expert output rows

Loads past a region's end read the next expert's rows (or zeros past the
buffer); stores are masked to the region, so that garbage never lands.
Program roles: a persistent grid; program p takes tasks p, p + P, ... Each kernel writes its own loop around
``tile_task`` (`megamoe.kernels.tasks` says why the loop is not shared).
"""

from __future__ import annotations

import triton
import triton.language as tl

from megamoe.kernels.activation import activation
from megamoe.kernels.convert import to_bf16
from megamoe.kernels.expert_bias import add_bias
from megamoe.kernels.quant import mxfp8_round_tile
from megamoe.kernels.tasks import tile_task

@triton.jit
def tile_dot(a, b, acc, DOT_FP32: tl.constexpr):
    """acc + a·b. DOT_FP32 (the interpreter, whose bf16 dot is wrong): the block's products summed in
    FP64, which is exact for bf16 inputs at these depths, then added in FP32 -- numpy's FP32 matmul
    rounds a row differently depending on its place in the tile, which would break bitwise equality
    across tilings."""
    if DOT_FP32:
        wide = tl.zeros((a.shape[0], b.shape[1]), dtype=tl.float64)
        return acc + tl.dot(a.to(tl.float64), b.to(tl.float64), wide, out_dtype=tl.float64).to(tl.float32)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def gate_up_act_tile(
    x_desc, w_desc, h_ptr, act_ptr, stride_h, stride_act,
    row0, row_end, expert, n0, I, K, limit, alpha,
    ACT: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, b_ptr=None, MX_ROUND: tl.constexpr = False,
):
    """One [BLOCK_M rows x BLOCK_N act columns] tile of expert ``expert``.

    Reads x_rows[row0 : row0+BM, :] and the gate and up weight rows n0..n0+BN;
    writes h (gate and up columns, plus the bias ``b_ptr`` `[L, 2I]` when given) and act for rows < row_end,
    columns < I. MX_ROUND: act rounded to the MXFP8 grid along I first (32-blocks; BLOCK_N a multiple of 64).
    """
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_gate_row = expert * 2 * I + n0
    w_up_row = w_gate_row + I
    for k in range(0, K, BLOCK_K):
        a = x_desc.load([row0, k])
        wg = w_desc.load([w_gate_row, k])
        wu = w_desc.load([w_up_row, k])
        acc_gate = tile_dot(a, wg.T, acc_gate, DOT_FP32)
        acc_up = tile_dot(a, wu.T, acc_up, DOT_FP32)
    cols = n0 + tl.arange(0, BLOCK_N)
    acc_gate = add_bias(acc_gate, b_ptr, expert * 2 * I, cols, I)
    acc_up = add_bias(acc_up, b_ptr, expert * 2 * I + I, cols, I)
    # The epilogue runs on column halves with int32 offsets from per-tile base pointers: one
    # [BM, BN] pass with int64 pointer tensors spilled ~1 KB per thread (cuobjdump).
    h_base = h_ptr + row0.to(tl.int64) * stride_h
    act_base = act_ptr + row0.to(tl.int64) * stride_act
    row_ok = row0 + tl.arange(0, BLOCK_M) < row_end
    g_lo, g_hi = tl.split(tl.permute(tl.reshape(acc_gate, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
    u_lo, u_hi = tl.split(tl.permute(tl.reshape(acc_up, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
    _gate_up_store(g_lo, u_lo, h_base, act_base, stride_h, stride_act, row_ok, n0, I, limit, alpha, ACT, DOT_FP32,
                   MX_ROUND)
    _gate_up_store(g_hi, u_hi, h_base, act_base, stride_h, stride_act, row_ok, n0 + BLOCK_N // 2, I, limit, alpha,
                   ACT, DOT_FP32, MX_ROUND)


@triton.jit
def _gate_up_store(gate, up, h_base, act_base, stride_h, stride_act, row_ok, c0, I, limit, alpha, ACT: tl.constexpr,
                   DOT_FP32: tl.constexpr, MX_ROUND: tl.constexpr = False):
    """Store h (gate and up columns c0..) and act = SwiGLU for a [BM, W] column chunk of a row tile (DOT_FP32:
    the interpreter, whose bfloat16 cast truncates; MX_ROUND: act rounded to the MXFP8 grid along I, W a multiple
    of 32 and c0 on a block)."""
    local = tl.arange(0, gate.shape[0])
    cols = c0 + tl.arange(0, gate.shape[1])
    mask = row_ok[:, None] & (cols < I)[None, :]
    h_tile = h_base + (local[:, None] * stride_h + cols[None, :])
    tl.store(h_tile, to_bf16(gate, DOT_FP32), mask=mask)
    tl.store(h_tile + I, to_bf16(up, DOT_FP32), mask=mask)
    act = activation(gate, up, limit, alpha, ACT)
    if MX_ROUND:  # MXFP8 as BF16 operands: the down GEMM's input on the MX grid (megamoe.ops.experts_mxfp8_bf16)
        act = mxfp8_round_tile(act, 1)
    tl.store(act_base + (local[:, None] * stride_act + cols[None, :]), to_bf16(act, DOT_FP32), mask=mask)


@triton.jit
def down_tile(
    act_desc, w_desc, y_ptr, stride_y,
    row0, row_end, expert, n0, D, K,
    DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, b_ptr=None,
):
    """One [BLOCK_M x BLOCK_N] tile of y = act · w_down[expert]ᵀ (+ b_down[expert] when ``b_ptr`` `[L, D]` is
    given; K = I), rows < row_end."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_row = expert * D + n0
    for k in range(0, K, BLOCK_K):
        a = act_desc.load([row0, k])
        w = w_desc.load([w_row, k])
        acc = tile_dot(a, w.T, acc, DOT_FP32)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    acc = add_bias(acc, b_ptr, expert * D, cols, D)
    mask = (rows < row_end)[:, None] & (cols < D)[None, :]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :], to_bf16(acc, DOT_FP32), mask=mask)


@triton.jit
def gate_up_kernel(
    x_desc, w_desc, h_ptr, act_ptr, stride_h, stride_act,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr,
    I, K, limit, alpha,
    ACT: tl.constexpr, DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr, b_ptr=None, MX_ROUND: tl.constexpr = False,
):
    """Persistent gate/up + SwiGLU over every (tile, n-tile) task (``b_ptr``: the optional bias `[L, 2I]`; MX_ROUND:
    act rounded to the MXFP8 grid along I, ``gate_up_act_tile``'s)."""
    num_n = tl.cdiv(I, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr)
    num_tasks = num_tiles * num_n
    # FLATTEN lets the pipeliner fetch the next task's first K tiles during this task's epilogue.
    for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS, flatten=FLATTEN):
        expert, row0, row_end, n = tile_task(
            task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, GROUP_M)
        gate_up_act_tile(
            x_desc, w_desc, h_ptr, act_ptr, stride_h, stride_act, row0, row_end, expert, n * BLOCK_N, I, K, limit,
            alpha, ACT, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K, b_ptr, MX_ROUND,
        )


@triton.jit
def down_kernel(
    act_desc, w_desc, y_ptr, stride_y,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr,
    D, K,
    DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr, b_ptr=None,
):
    """Persistent down projection over every (tile, n-tile) task (``b_ptr``: the optional bias `[L, D]`)."""
    num_n = tl.cdiv(D, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr)
    num_tasks = num_tiles * num_n
    for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS, flatten=FLATTEN):
        expert, row0, row_end, n = tile_task(
            task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, GROUP_M)
        down_tile(act_desc, w_desc, y_ptr, stride_y, row0, row_end, expert, n * BLOCK_N, D, K,
                  DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K, b_ptr)
