"""Backward expert GEMM tiles (BF16): dgrads with SwiGLU backward and the router gradient fused, wgrads.

Per routed row r of local expert l (rows grouped by expert as in the forward):

    dy[r]  = d_out of the row's token, NOT scaled by its router weight w[r]
    g[r]   = dy[r] · w_down[l]                  [I]   (dact kernel, K = D)
    d_w[r] = <g[r], act[r]>  (= <dy[r], y[r]>)        (SonicMoE: no pass over y)
    d_act  = w[r] · g[r];  d_h = SwiGLU'(h[r]) ⊙ d_act        -> d_h [R, 2I]
    dx[r]  = d_h[r] · w_gate_up[l]              [D]   (dx kernel, K = 2I)
    dW_down[l]    = Σ_r dy[r]ᵀ (w[r] act[r])            (wgrad kernel, K = rows of l)
    dW_gate_up[l] = Σ_r d_h[r]ᵀ x[r]

act is recomputed from the saved pre-activation h in the dact epilogue, which
also writes act_w = w ⊙ act for the wgrad (and, for MXFP8 run as BF16 operands, d_h
rounded to the MXFP8 grid along 2I: dx's operand, D_H_GRID). The router gradient of a row is
summed over I in two steps: each n-tile writes its partial sum to
d_w_partial[r, n]; the launcher adds the partials in n order (no float
atomics anywhere: bitwise deterministic). wgrad tasks own one
(expert, m-tile, n-tile) output block and reduce the expert's rows in order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megamoe.kernels.activation import activation_bwd
from megamoe.kernels.convert import to_bf16
from megamoe.kernels.expert_gemm import tile_dot
from megamoe.kernels.quant import mxfp8_round_tile
from megamoe.kernels.tasks import first_task, tile_task
from megamoe.kernels.wgrad_carry import carry_end, carry_start, wgrad_mode


@triton.jit
def rows_times_kn(a_desc, w_desc, row0, w_row0, n0, K, DOT_FP32: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc = A[row0 : row0+BM, :K] · W[w_row0 : w_row0+K, n0 : n0+BN] (W stored [K, N], row-major). The
    interpreter sums each K block in FP64 (``tile_dot``): its FP32 matmul rounds a row by its place in the tile,
    so a row's dact differed between the composed kernels' tiles and the backward megakernel's cut ones on an
    AVX-512 CPU."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = a_desc.load([row0, k])
        w = w_desc.load([w_row0 + k, n0])
        acc = tile_dot(a, w, acc, DOT_FP32)
    return acc


@triton.jit
def dact_tile(
    dy_desc, w_down_desc, h_base, row_w_ptr, d_h_ptr, act_w_ptr, d_w_partial_ptr,
    stride_h, stride_d_h, stride_act_w, stride_partial, row0, row_end, expert, n, D, I, limit, alpha,
    ACT: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, d_h_grid_ptr=None,
    D_H_GRID: tl.constexpr = False,
):
    """One [BLOCK_M rows x BLOCK_N] tile of g = dy · w_down[l]; epilogue: router-gradient partials, SwiGLU
    backward -> d_h, act_w (D_H_GRID: and d_h on the MXFP8 grid, :func:`dact_epilogue`). ``h_base`` points at
    the tile's first row of h (the ring's, or a replay's); dy, row weights, d_h, act_w and the partials are
    addressed by routed row."""
    g = rows_times_kn(dy_desc, w_down_desc, row0, expert * D, n * BLOCK_N, D, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K)
    dact_epilogue(g, h_base, row_w_ptr, d_h_ptr, act_w_ptr, d_w_partial_ptr, stride_h, stride_d_h, stride_act_w,
                  stride_partial, row0, row_end, n, I, limit, alpha, ACT, DOT_FP32, BLOCK_M, BLOCK_N, d_h_grid_ptr,
                  D_H_GRID)


@triton.jit
def dact_epilogue(
    g, h_base, row_w_ptr, d_h_ptr, act_w_ptr, d_w_partial_ptr, stride_h, stride_d_h, stride_act_w, stride_partial,
    row0, row_end, n, I, limit, alpha, ACT: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, d_h_grid_ptr=None, D_H_GRID: tl.constexpr = False,
):
    """The dact tile's epilogue from g [BLOCK_M, BLOCK_N] (fp32, n-tile n): router-gradient partials, the
    SwiGLU backward in FP32 from h -> d_h, act_w (the BF16 and the FP8 dgrads share it). D_H_GRID: d_h rounded
    to the MXFP8 grid along 2I also stored at ``d_h_grid_ptr`` (d_h's strides; BLOCK_N a multiple of 128, so
    each column quarter is whole 32-blocks)."""
    n0 = n * BLOCK_N
    # The epilogue runs on column quarters: one [BM, BN] pass kept ~10 [BM, BN] fp32/pointer
    # tensors live and spilled 3.5 KB of stack per thread (cuobjdump --dump-resource-usage).
    g_lo, g_hi = tl.split(tl.permute(tl.reshape(g, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    w = tl.load(row_w_ptr + rows, mask=row_ok, other=0.0)
    # per-tile base pointers keep the element offsets in int32 (fewer registers than int64 pointers)
    row0_64 = row0.to(tl.int64)
    d_h_base = d_h_ptr + row0_64 * stride_d_h
    act_w_base = act_w_ptr + row0_64 * stride_act_w
    grid_base = d_h_grid_ptr + row0_64 * stride_d_h if D_H_GRID else d_h_base
    local = tl.arange(0, BLOCK_M)
    part = _dact_quarters(g_lo, w, local, row_ok, n0, h_base, d_h_base, act_w_base, stride_h, stride_d_h,
                          stride_act_w, I, limit, alpha, ACT, BLOCK_N // 2, DOT_FP32, grid_base, D_H_GRID)
    part += _dact_quarters(g_hi, w, local, row_ok, n0 + BLOCK_N // 2, h_base, d_h_base, act_w_base, stride_h,
                           stride_d_h, stride_act_w, I, limit, alpha, ACT, BLOCK_N // 2, DOT_FP32, grid_base,
                           D_H_GRID)
    tl.store(d_w_partial_ptr + rows.to(tl.int64) * stride_partial + n, part, mask=row_ok)


@triton.jit
def dact_swiglu_bwd_kernel(
    dy_desc, w_down_desc, h_ptr, row_w_ptr, d_h_ptr, act_w_ptr, d_w_partial_ptr,
    stride_h, stride_d_h, stride_act_w, stride_partial,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr,
    D, I, limit, alpha,
    ACT: tl.constexpr, DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr, d_h_grid_ptr=None, D_H_GRID: tl.constexpr = False,
):
    """Persistent :func:`dact_tile` over every (row tile, n-tile) task (D_H_GRID: also d_h on the MXFP8 grid
    along 2I into ``d_h_grid_ptr``, d_h's strides)."""
    num_n = tl.cdiv(I, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr)
    for task in tl.range(tl.program_id(0), num_tiles * num_n, NUM_PROGRAMS, flatten=FLATTEN):
        expert, row0, row_end, n = tile_task(
            task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, GROUP_M)
        dact_tile(dy_desc, w_down_desc, h_ptr + row0.to(tl.int64) * stride_h, row_w_ptr, d_h_ptr, act_w_ptr,
                  d_w_partial_ptr, stride_h, stride_d_h, stride_act_w, stride_partial, row0, row_end, expert, n,
                  D, I, limit, alpha, ACT, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K, d_h_grid_ptr, D_H_GRID)


@triton.jit
def router_grad_rows(d_w_partial_ptr, stride_partial, d_router_ptr, row0, row_end, num_n,
                     BLOCK_M: tl.constexpr):
    """d_router[r] = the partials of row r added in n order (fixed: the same bits wherever it runs)."""
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    base = d_w_partial_ptr + rows.to(tl.int64) * stride_partial
    acc = tl.load(base, mask=row_ok, other=0.0)
    for n in range(1, num_n):
        acc += tl.load(base + n, mask=row_ok, other=0.0)
    tl.store(d_router_ptr + rows, acc, mask=row_ok)


@triton.jit
def router_grad_kernel(d_w_partial_ptr, stride_partial, d_router_ptr, rows, num_n, BLOCK_M: tl.constexpr):
    """:func:`router_grad_rows` over ``rows`` rows, one program per BLOCK_M of them."""
    row0 = tl.program_id(0) * BLOCK_M
    router_grad_rows(d_w_partial_ptr, stride_partial, d_router_ptr, row0, rows, num_n, BLOCK_M)


@triton.jit
def _dact_quarters(g, w, local, row_ok, c0, h_ptr, d_h_ptr, act_w_ptr, stride_h, stride_d_h, stride_act_w,
                   I, limit, alpha, ACT: tl.constexpr, HALF: tl.constexpr, EXACT: tl.constexpr, grid_ptr,
                   D_H_GRID: tl.constexpr):
    """:func:`_dact_half` on the two column halves of ``g`` ([BM, HALF]) in turn."""
    BM: tl.constexpr = g.shape[0]
    g_lo, g_hi = tl.split(tl.permute(tl.reshape(g, (BM, 2, HALF // 2)), (0, 2, 1)))
    part = _dact_half(g_lo, w, local, row_ok, c0, h_ptr, d_h_ptr, act_w_ptr, stride_h, stride_d_h, stride_act_w,
                      I, limit, alpha, ACT, HALF // 2, EXACT, grid_ptr, D_H_GRID)
    part += _dact_half(g_hi, w, local, row_ok, c0 + HALF // 2, h_ptr, d_h_ptr, act_w_ptr, stride_h, stride_d_h,
                       stride_act_w, I, limit, alpha, ACT, HALF // 2, EXACT, grid_ptr, D_H_GRID)
    return part


@triton.jit
def _dact_half(g, w, local, row_ok, c0, h_ptr, d_h_ptr, act_w_ptr, stride_h, stride_d_h, stride_act_w,
               I, limit, alpha, ACT: tl.constexpr, HALF: tl.constexpr, EXACT: tl.constexpr, grid_ptr,
               D_H_GRID: tl.constexpr):
    """SwiGLU backward of columns c0..c0+HALF of a row tile; returns the rows' router-gradient partial.

    The pointers point at the tile's first row; ``local`` is 0..BLOCK_M-1. D_H_GRID: d_h's bf16 values rounded
    to the MXFP8 grid along 2I (each gate and up 32-block of the row its own scale) also stored at ``grid_ptr``.
    """
    cols = c0 + tl.arange(0, HALF)
    mask = row_ok[:, None] & (cols < I)[None, :]
    h_tile = h_ptr + (local[:, None] * stride_h + cols[None, :])
    gate = tl.load(h_tile, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_tile + I, mask=mask, other=0.0).to(tl.float32)
    part, act_w, d_gate, d_up = activation_bwd(g, gate, up, w[:, None], limit, alpha, ACT)
    act_w_tile = act_w_ptr + (local[:, None] * stride_act_w + cols[None, :])
    tl.store(act_w_tile, to_bf16(act_w, EXACT), mask=mask)
    d_h_tile = d_h_ptr + (local[:, None] * stride_d_h + cols[None, :])
    d_gate = to_bf16(d_gate, EXACT)
    tl.store(d_h_tile, d_gate, mask=mask)
    d_up = to_bf16(d_up, EXACT)
    tl.store(d_h_tile + I, d_up, mask=mask)
    if D_H_GRID:  # dx's operand as mx_round_activations(d_h) gives it, without a pass over d_h
        tl.static_assert(HALF % 32 == 0, "d_h on the MXFP8 grid needs column quarters of whole 32-blocks")
        grid_tile = grid_ptr + (local[:, None] * stride_d_h + cols[None, :])
        tl.store(grid_tile, to_bf16(mxfp8_round_tile(d_gate, 1), EXACT), mask=mask)
        tl.store(grid_tile + I, to_bf16(mxfp8_round_tile(d_up, 1), EXACT), mask=mask)
    return part


@triton.jit
def dx_tile(d_h_desc, w_gate_up_desc, d_x_ptr, stride_d_x, d_x_index_ptr, row0, row_end, expert, n, D, I,
            DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            SCATTER: tl.constexpr):
    """One tile of dx = d_h · w_gate_up[l] (K = 2I): row r to d_x row r, or with SCATTER to row d_x_index[r]
    (rows whose index is < 0 not stored)."""
    n0 = n * BLOCK_N
    acc = rows_times_kn(d_h_desc, w_gate_up_desc, row0, expert * 2 * I, n0, 2 * I, DOT_FP32,
                        BLOCK_M, BLOCK_N, BLOCK_K)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    dest = rows.to(tl.int64)
    if SCATTER:
        dest = tl.load(d_x_index_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        row_ok = row_ok & (dest >= 0)
    mask = row_ok[:, None] & (cols < D)[None, :]
    tl.store(d_x_ptr + dest[:, None] * stride_d_x + cols[None, :], to_bf16(acc, DOT_FP32), mask=mask)


@triton.jit
def dx_kernel(
    d_h_desc, w_gate_up_desc, d_x_ptr, stride_d_x, d_x_index_ptr,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr,
    D, I,
    DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr, SCATTER: tl.constexpr = False,
):
    """Persistent :func:`dx_tile` over every (row tile, n-tile) task."""
    num_n = tl.cdiv(D, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr)
    for task in tl.range(tl.program_id(0), num_tiles * num_n, NUM_PROGRAMS, flatten=FLATTEN):
        expert, row0, row_end, n = tile_task(
            task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, GROUP_M)
        dx_tile(d_h_desc, w_gate_up_desc, d_x_ptr, stride_d_x, d_x_index_ptr, row0, row_end, expert, n, D, I,
                DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K, SCATTER)


@triton.jit
def wgrad_kernel(
    a_ptr, b_ptr, out_ptr, offsets_ptr, counts_ptr, num_experts, OUT_M, OUT_N, modes_ptr, carry_in_ptr,
    carry_out_ptr,
    DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FLATTEN: tl.constexpr,
    CARRY: tl.constexpr = False,
):
    """out[l] = A[rows of l]ᵀ · B[rows of l]: `[OUT_M, OUT_N]` per expert, rows reduced in order.

    A is `[R, OUT_M]`, B `[R, OUT_N]` and out `[L, OUT_M, OUT_N]`, all contiguous.
    Tasks are (expert, m-tile, n-tile) blocks dealt round-robin to the
    programs. Each program makes TMA descriptors per expert that end at the
    expert's last row, so the hardware zero-fills the partial last K step (no
    masked register path) and every K step streams from shared memory to the
    tensor cores; the output descriptor ends at the expert's block, so the
    TMA store clips partial tiles. An expert with no rows gets zeros.
    CARRY: one window of the backward's rows (``megamoe.kernels.wgrad_carry``: ``modes [L]``, the fp32 blocks
    ``carry_in`` / ``carry_out`` `[OUT_M, OUT_N]`; unread without CARRY).
    Launch with a scratch allocator for the descriptors (`megamoe.ops.launch.scratch_allocator`).
    """
    num_n = tl.cdiv(OUT_N, BLOCK_N)
    per_expert = tl.cdiv(OUT_M, BLOCK_M) * num_n
    pid = tl.program_id(0)
    for expert in range(0, num_experts):
        # this program's first task of the expert: tasks are numbered expert-major, dealt round-robin
        first = first_task(pid, NUM_PROGRAMS, expert * per_expert)
        mode = wgrad_mode(modes_ptr, expert, CARRY)
        if (first < per_expert) & (mode != 0):
            row0 = tl.load(offsets_ptr + expert)
            row_end = row0 + tl.load(counts_ptr + expert)
            a_desc, b_desc, out_desc = wgrad_descriptors(a_ptr, b_ptr, out_ptr, expert, row_end, OUT_M, OUT_N,
                                                         BLOCK_M, BLOCK_N, BLOCK_K)
            for task in tl.range(first, per_expert, NUM_PROGRAMS, flatten=FLATTEN):
                wgrad_block(a_desc, b_desc, out_desc, row0, row_end, task // num_n * BLOCK_M,
                            task % num_n * BLOCK_N, mode, carry_in_ptr, carry_out_ptr, OUT_M, OUT_N, DOT_FP32,
                            CARRY, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def wgrad_descriptors(a_ptr, b_ptr, out_ptr, expert, row_end, OUT_M, OUT_N,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """TMA descriptors of one expert's wgrad: A `[R, OUT_M]` and B `[R, OUT_N]` ending at the expert's last row
    (the hardware zero-fills a partial last K step), the output block of the expert `[OUT_M, OUT_N]`."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[tl.maximum(row_end, 1), OUT_M], strides=[OUT_M, 1],
                                       block_shape=[BLOCK_K, BLOCK_M])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[tl.maximum(row_end, 1), OUT_N], strides=[OUT_N, 1],
                                       block_shape=[BLOCK_K, BLOCK_N])
    out_desc = tl.make_tensor_descriptor(out_ptr + tl.cast(expert, tl.int64) * OUT_M * OUT_N, shape=[OUT_M, OUT_N],
                                         strides=[OUT_N, 1], block_shape=[BLOCK_M, BLOCK_N])
    return a_desc, b_desc, out_desc


@triton.jit
def wgrad_block(a_desc, b_desc, out_desc, row0, row_end, m0, n0, mode, carry_in_ptr, carry_out_ptr, OUT_M, OUT_N,
                DOT_FP32: tl.constexpr, CARRY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """out[m0:, n0:] = A[row0:row_end, m0:]ᵀ · B[row0:row_end, n0:]: the rows reduced in order, K steps of
    BLOCK_K rows from row0, FP32 accumulation, one rounding; with CARRY from and to the window carry (``mode``:
    ``megamoe.kernels.wgrad_carry``)."""
    acc = carry_start(mode, carry_in_ptr, m0, n0, OUT_M, OUT_N, CARRY, BLOCK_M, BLOCK_N)
    for k in range(row0, row_end, BLOCK_K):
        a = a_desc.load([k, m0])
        b = b_desc.load([k, n0])
        acc = tile_dot(a.T, b, acc, DOT_FP32)
    if carry_end(acc, mode, carry_out_ptr, m0, n0, OUT_M, OUT_N, CARRY, BLOCK_M, BLOCK_N):
        out_desc.store([m0, n0], to_bf16(acc, DOT_FP32))
