"""The backward megakernel: one persistent launch pulls, differentiates and returns a window's routed rows (BF16).

The forward's mirror, driven by a window of its pull schedule (``megamoe.routing.windows``) and the window's
row tiles, one launch per window. Grid = one program per SM, co-resident; programs ``0 .. comm_sms-1``
communicate, the others compute; they meet through GPU-local int32 counters (zeroed before each launch):

    rows_ready[j]    comm workers that pulled their share of minibatch j (d_out and x rows)   (target comm_sms)
    dact_done[t]     dact n-tiles finished of row tile t                                      (target cdiv(I, BN_DA))
    dx_done[j]       dx tasks finished of minibatch j                          (target tiles(j) * cdiv(D, BN_DX))
    shared_done[t]   dact n-tiles finished of the shared expert's row tile t
    dgrads_done      dact tasks finished, all minibatches (the weight gradients wait for every one)
    comm_done        comm workers finished (the last one opens the end-of-pass barrier across ranks)

Per routed row t of the window (at its row of the window's buffers, so nothing of a row is overwritten before the
weight gradients read it):

    dy[t]   = d_out_{src_rank}[src_index // k]    unscaled (pulled)         x[t] = x_{src_rank}[...] (pulled)
    h[t]    = the window's h row t: the forward ring's, or recomputed before the launch (rows a wrapped ring lost)
    g       = dy · W_down; d_w = <g, act>; d_h = w · SwiGLU'(h) ⊙ g; act_w = w · act        (dact tile)
    dx[t]   = d_h · W_gate_up                                                               (dx tile, pushed home)
    dW_down = Σ dyᵀ act_w, dW_gate_up = Σ d_hᵀ x over each expert's rows, in order           (wgrad blocks)

Communication worker c: pull its share of every minibatch's d_out and x rows in order (release rows_ready[j]),
then push each minibatch's dx rows into the home ranks' ``[N*k, D]`` slots once its dx tasks are done, then the
end-of-pass barrier. Compute worker: the shared expert's dact and dx tiles over this rank's tokens (its d_out is
local), then per minibatch j in order: dact tasks (each waits for rows_ready of the minibatch holding its last
row), dx tasks (each waits for its row tile's dact; the first n-tile also adds the tile's router-gradient partials
in n order), and last the weight-gradient blocks of every routed and shared expert (after every dact task). Tasks
are dealt from one global list in that order, round robin; every wait targets an earlier task of the list, so the
waits cannot cycle. The rows a wrapped forward ring lost get their h before the window's launch
(``megamoe.megakernel.backward_ring.BackwardRing.replay``), so no task here waits for a recomputation.

Every tile is the standalone backward's (``megamoe.kernels.expert_gemm_bwd``) at the same K steps and n-tiles: the
gradients are the standalone path's bits. PHASE > 0 runs one step of one role for all its workers, waits compiled
out (CPU mode).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer, smid

from megamoe.kernels.comm import pull_tile, signal_and_wait
from megamoe.kernels.expert_gemm_bwd import dact_tile, dx_tile, router_grad_rows, wgrad_block, wgrad_descriptors
from megamoe.kernels.megakernel import comm_push
from megamoe.kernels.wgrad_carry import STORE, wgrad_mode
from megamoe.kernels.sync import (TRACE_END, TRACE_KIND_BWD_PULL, TRACE_KIND_DACT, TRACE_KIND_DX,
                                  TRACE_KIND_SHARED_DACT, TRACE_KIND_SHARED_DX, TRACE_KIND_WGRAD, TRACE_ROW,
                                  TRACE_SHARED_END, TRACE_SM, TRACE_START, WAIT_PASS_END, fence_async_proxy,
                                  release_add, trace_clock, trace_event, wait_counter)
from megamoe.kernels.tasks import first_task, grouped_task, row_tile_task

#: Wait ids of the error word (megamoe.megakernel.kernel names them; 1-6 are the forward's).
WAIT_BWD_ROWS = tl.constexpr(7)
WAIT_DACT = tl.constexpr(8)
WAIT_DX = tl.constexpr(9)
WAIT_SHARED_DACT = tl.constexpr(10)
WAIT_DGRADS = tl.constexpr(11)

#: PHASE values: 0 the whole pass; the others one step (CPU mode).
PHASE_ALL = tl.constexpr(0)
PHASE_SHARED_DACT = tl.constexpr(1)
PHASE_SHARED_DX = tl.constexpr(2)
PHASE_PULL = tl.constexpr(3)
PHASE_DACT = tl.constexpr(4)
PHASE_DX = tl.constexpr(5)
PHASE_PUSH = tl.constexpr(6)
PHASE_WGRAD = tl.constexpr(7)


@triton.jit
def pull_rows(
    j, c, comm_sms, num_rows, minibatch, src_peer_ptrs, src_ptr, stride_src, src_rank_ptr, src_index_ptr,
    dst_ptr, stride_dst,
    TOP_K: tl.constexpr, CHUNKS: tl.constexpr, CP: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """Worker c's share of minibatch j's rows: ``dst[t] = src_{src_rank[t]}[src_index[t] // k]`` (bf16)."""
    first_row = j.to(tl.int64) * minibatch
    end_row = tl.minimum(first_row + minibatch, num_rows)
    for t0 in range(first_row + c * ROWS, end_row, comm_sms * ROWS):
        pull_tile(t0, end_row, src_peer_ptrs, src_ptr, stride_src, src_rank_ptr, src_index_ptr, dst_ptr, stride_dst,
                  dst_ptr, stride_dst, TOP_K, CHUNKS, CP, W, ROWS, ALIGN, 0, False)


@triton.jit
def dact_tasks(
    j, c, workers, dealt, budget, minibatch, batches,
    dy_desc, w_down_desc, ring_h_ptr, stride_ring_h, row_w_ptr, d_h_ptr, act_w_ptr, partial_ptr, stride_d_h,
    stride_act_w, stride_partial,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, minibatch_tiles_ptr, rows_ready_ptr,
    dact_done_ptr, dgrads_done_ptr, error_ptr, trace_ptr, comm_sms, I, D, limit, alpha,
    ACT: tl.constexpr, DOT_FP32: tl.constexpr, FENCE: tl.constexpr, WAIT: tl.constexpr, TRACE: tl.constexpr,
    BLOCK_M: tl.constexpr, BN_DA: tl.constexpr, BK_DA: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Worker c's dact tasks of minibatch j (h at the tile's rows of the window's h)."""
    t0 = tl.load(minibatch_tiles_ptr + j)
    tiles = tl.load(minibatch_tiles_ptr + j + 1) - t0
    num_n = tl.cdiv(I, BN_DA)
    tasks = tiles * num_n
    for task in range(first_task(c, workers, dealt), tasks, workers):
        tile, n = row_tile_task(task, num_n, t0, tile_run_ptr, GROUP_M)
        expert = tl.load(tile_expert_ptr + tile)
        row0 = tl.load(tile_row0_ptr + tile)
        row_end = tl.load(tile_row_end_ptr + tile)
        # an uncut tile may end in the next minibatch: wait for the one holding its last row (pulled in order)
        last = tl.minimum((row_end - 1) // minibatch, batches - 1)
        budget = wait_counter(rows_ready_ptr + last, comm_sms, budget, error_ptr, last, trace_ptr, WAIT_BWD_ROWS,
                              WAIT, TRACE)
        fence_async_proxy(FENCE)
        start = trace_clock(TRACE)
        dact_tile(dy_desc, w_down_desc, ring_h_ptr + row0.to(tl.int64) * stride_ring_h, row_w_ptr, d_h_ptr, act_w_ptr,
                  partial_ptr, stride_ring_h, stride_d_h, stride_act_w, stride_partial, row0, row_end, expert, n, D, I,
                  limit, alpha, ACT, DOT_FP32, BLOCK_M, BN_DA, BK_DA)
        release_add(dact_done_ptr + tile)
        release_add(dgrads_done_ptr)
        trace_event(trace_ptr, start, TRACE_KIND_DACT, tile * 65536 + n, TRACE)
    return dealt + tasks, budget


@triton.jit
def dx_tasks(
    j, c, workers, dealt, budget,
    d_h_desc, w_gate_up_k_desc, dx_ptr, stride_dx, partial_ptr, stride_partial, d_router_ptr,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, minibatch_tiles_ptr, dact_done_ptr, dx_done_ptr,
    error_ptr, trace_ptr, I, D,
    DOT_FP32: tl.constexpr, FENCE: tl.constexpr, WAIT: tl.constexpr, TRACE: tl.constexpr,
    BLOCK_M: tl.constexpr, BN_DA: tl.constexpr, BN_DX: tl.constexpr, BK_DX: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Worker c's dx tasks of minibatch j (each after its row tile's dact); the first n-tile of a tile also adds
    its rows' router-gradient partials."""
    t0 = tl.load(minibatch_tiles_ptr + j)
    tiles = tl.load(minibatch_tiles_ptr + j + 1) - t0
    num_n = tl.cdiv(D, BN_DX)
    tasks = tiles * num_n
    for task in range(first_task(c, workers, dealt), tasks, workers):
        tile, n = row_tile_task(task, num_n, t0, tile_run_ptr, GROUP_M)
        budget = wait_counter(dact_done_ptr + tile, tl.cdiv(I, BN_DA), budget, error_ptr, tile, trace_ptr,
                              WAIT_DACT, WAIT, TRACE)
        fence_async_proxy(FENCE)
        start = trace_clock(TRACE)
        expert = tl.load(tile_expert_ptr + tile)
        row0 = tl.load(tile_row0_ptr + tile)
        row_end = tl.load(tile_row_end_ptr + tile)
        if n == 0:
            router_grad_rows(partial_ptr, stride_partial, d_router_ptr, row0, row_end, tl.cdiv(I, BN_DA), BLOCK_M)
        dx_tile(d_h_desc, w_gate_up_k_desc, dx_ptr, stride_dx, dx_ptr, row0, row_end, expert, n, D, I, DOT_FP32,
                BLOCK_M, BN_DX, BK_DX, False)
        release_add(dx_done_ptr + j)
        trace_event(trace_ptr, start, TRACE_KIND_DX, tile * 65536 + n, TRACE)
    return dealt + tasks, budget


@triton.jit
def shared_dact(
    c, workers, tokens, dy_desc, w_down_desc, h_ptr, ones_ptr, d_h_ptr, act_w_ptr, partial_ptr, stride_h,
    stride_d_h, stride_act_w, stride_partial, done_ptr, trace_ptr, I, D, limit, alpha,
    ACT: tl.constexpr, DOT_FP32: tl.constexpr, TRACE: tl.constexpr,
    BLOCK_M: tl.constexpr, BN_DA: tl.constexpr, BK_DA: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Worker c's dact tasks of the shared expert over this rank's tokens (weight 1); returns tasks dealt."""
    # This loop and shared_dx are the forward's shared_gate_up and shared_down over other tiles and stay twice:
    # each interleaves its own tile call, waits and trace kind with the task (megamoe.kernels.tasks).
    num_n = tl.cdiv(I, BN_DA)
    tiles = tl.cdiv(tokens, BLOCK_M)
    for task in range(c, tiles * num_n, workers):
        start = trace_clock(TRACE)
        tile, n = grouped_task(task, num_n, tiles, GROUP_M)
        row0 = tile * BLOCK_M
        dact_tile(dy_desc, w_down_desc, h_ptr + row0.to(tl.int64) * stride_h, ones_ptr, d_h_ptr, act_w_ptr,
                  partial_ptr, stride_h, stride_d_h, stride_act_w, stride_partial, row0, tokens, 0, n, D, I, limit,
                  alpha, ACT, DOT_FP32, BLOCK_M, BN_DA, BK_DA)
        release_add(done_ptr + tile)
        trace_event(trace_ptr, start, TRACE_KIND_SHARED_DACT, tile * 65536 + n, TRACE)
    return tiles * num_n


@triton.jit
def shared_dx(
    c, workers, dealt, budget, tokens, d_h_desc, w_gate_up_k_desc, dx_ptr, stride_dx, done_ptr, error_ptr, trace_ptr,
    I, D,
    DOT_FP32: tl.constexpr, FENCE: tl.constexpr, WAIT: tl.constexpr, TRACE: tl.constexpr,
    BLOCK_M: tl.constexpr, BN_DA: tl.constexpr, BN_DX: tl.constexpr, BK_DX: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Worker c's dx tasks of the shared expert; returns (dealt, budget)."""
    num_n = tl.cdiv(D, BN_DX)
    tiles = tl.cdiv(tokens, BLOCK_M)
    for task in range(first_task(c, workers, dealt), tiles * num_n, workers):
        tile, n = grouped_task(task, num_n, tiles, GROUP_M)
        budget = wait_counter(done_ptr + tile, tl.cdiv(I, BN_DA), budget, error_ptr, tile, trace_ptr,
                              WAIT_SHARED_DACT, WAIT, TRACE)
        fence_async_proxy(FENCE)
        start = trace_clock(TRACE)
        dx_tile(d_h_desc, w_gate_up_k_desc, dx_ptr, stride_dx, dx_ptr, tile * BLOCK_M, tokens, 0, n, D, I,
                DOT_FP32, BLOCK_M, BN_DX, BK_DX, False)
        trace_event(trace_ptr, start, TRACE_KIND_SHARED_DX, tile * 65536 + n, TRACE)
    return dealt + tiles * num_n, budget


@triton.jit
def wgrad_tasks(
    c, workers, dealt, budget, minibatch_tiles_ptr, batches, offsets_ptr, counts_ptr, experts, shared_rows,
    dy_ptr, act_w_ptr, d_h_ptr, x_ptr, d_w_down_ptr, d_w_gate_up_ptr, modes_ptr, down_in_ptr, down_out_ptr,
    gate_up_in_ptr, gate_up_out_ptr,
    shared_dy_ptr, shared_act_w_ptr, shared_d_h_ptr, shared_x_ptr, d_shared_down_ptr, d_shared_gate_up_ptr,
    dgrads_done_ptr, error_ptr, trace_ptr, I, D, shared_I,
    DOT_FP32: tl.constexpr, FENCE: tl.constexpr, WAIT: tl.constexpr, TRACE: tl.constexpr, HAS_SHARED: tl.constexpr,
    BN_DA: tl.constexpr, BM_W: tl.constexpr, BN_W: tl.constexpr, BK_W: tl.constexpr,
):
    """Worker c's weight-gradient blocks (after every dact task): per routed expert dW_down `[D, I]` = dyᵀ act_w
    then dW_gate_up `[2I, D]` = d_hᵀ x over its rows in this window, from and to the FP32 carries as its mode
    says (``megamoe.kernels.wgrad_carry``; an expert with nothing here is skipped); then the shared expert's over
    this rank's tokens."""
    first = first_task(c, workers, dealt)
    down_tasks = tl.cdiv(D, BM_W) * tl.cdiv(I, BN_W)
    gate_up_tasks = tl.cdiv(2 * I, BM_W) * tl.cdiv(D, BN_W)
    per_expert = down_tasks + gate_up_tasks
    routed = experts * per_expert
    tasks = routed
    if HAS_SHARED:
        tasks += tl.cdiv(D, BM_W) * tl.cdiv(shared_I, BN_W) + tl.cdiv(2 * shared_I, BM_W) * tl.cdiv(D, BN_W)
    if first < tasks:
        dgrads = tl.load(minibatch_tiles_ptr + batches) * tl.cdiv(I, BN_DA)  # every routed dact task
        budget = wait_counter(dgrads_done_ptr, dgrads, budget, error_ptr, 0, trace_ptr, WAIT_DGRADS, WAIT, TRACE)
        fence_async_proxy(FENCE)
    for task in range(first, tasks, workers):
        start = trace_clock(TRACE)
        if task < routed:
            expert = task // per_expert
            within = task - expert * per_expert
            mode = wgrad_mode(modes_ptr, expert, True)
            row0 = tl.load(offsets_ptr + expert)
            row_end = row0 + tl.load(counts_ptr + expert)
            if within < down_tasks:
                a_desc, b_desc, out_desc = wgrad_descriptors(dy_ptr, act_w_ptr, d_w_down_ptr, expert, row_end, D, I,
                                                             BM_W, BN_W, BK_W)
                num_n = tl.cdiv(I, BN_W)
                out_m, out_n, carry_in, carry_out = D, I, down_in_ptr, down_out_ptr
            else:
                within -= down_tasks
                a_desc, b_desc, out_desc = wgrad_descriptors(d_h_ptr, x_ptr, d_w_gate_up_ptr, expert, row_end, 2 * I,
                                                             D, BM_W, BN_W, BK_W)
                num_n = tl.cdiv(D, BN_W)
                out_m, out_n, carry_in, carry_out = 2 * I, D, gate_up_in_ptr, gate_up_out_ptr
        else:
            within = task - routed
            mode = task * 0 + STORE
            row0 = 0
            row_end = shared_rows
            shared_down = tl.cdiv(D, BM_W) * tl.cdiv(shared_I, BN_W)
            if within < shared_down:
                a_desc, b_desc, out_desc = wgrad_descriptors(shared_dy_ptr, shared_act_w_ptr, d_shared_down_ptr, 0,
                                                             row_end, D, shared_I, BM_W, BN_W, BK_W)
                num_n = tl.cdiv(shared_I, BN_W)
                out_m, out_n = D, shared_I
            else:
                within -= shared_down
                a_desc, b_desc, out_desc = wgrad_descriptors(shared_d_h_ptr, shared_x_ptr, d_shared_gate_up_ptr, 0,
                                                             row_end, 2 * shared_I, D, BM_W, BN_W, BK_W)
                num_n = tl.cdiv(D, BN_W)
                out_m, out_n = 2 * shared_I, D
            carry_in, carry_out = down_in_ptr, down_out_ptr  # never read: STORE alone
        if mode != 0:
            wgrad_block(a_desc, b_desc, out_desc, row0, row_end, within // num_n * BM_W, within % num_n * BN_W,
                        mode, carry_in, carry_out, out_m, out_n, DOT_FP32, True, BM_W, BN_W, BK_W)
        trace_event(trace_ptr, start, TRACE_KIND_WGRAD, task, TRACE)
    return dealt + tasks, budget


@triton.jit(do_not_specialize=["tokens", "my_rank", "comm_sms", "budget", "phase_minibatch", "limit", "alpha"])
def megakernel_bwd(
    # schedule and row tiles (device)
    num_rows_ptr, src_rank_ptr, src_index_ptr, offsets_ptr, counts_ptr,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, minibatch_tiles_ptr,
    # communication: the home ranks' staged d_out and x rows, pulled into full-size rows; the home ranks' d_x slots
    d_out_peer_ptrs, d_out_ptr, x_peer_ptrs, x_ptr, stride_rows, dy_ptr, x_rows_ptr, stride_pass,
    slots_peer_ptrs, slots_ptr, stride_slots,
    # routed experts: dact (h at the window's rows), dx, weight gradients
    dy_desc, w_down_desc, ring_h_ptr, stride_ring_h, row_w_ptr, d_h_ptr, act_w_ptr, partial_ptr, stride_d_h,
    stride_act_w, stride_partial, d_h_desc, w_gate_up_k_desc, dx_ptr, stride_dx, d_router_ptr, d_w_down_ptr,
    d_w_gate_up_ptr,
    # the weight gradients' carries across windows (megamoe.kernels.wgrad_carry)
    modes_ptr, down_in_ptr, down_out_ptr, gate_up_in_ptr, gate_up_out_ptr,
    # the shared expert over this rank's tokens
    shared_dy_desc, shared_w_down_desc, shared_h_ptr, stride_shared_h, ones_ptr, shared_d_h_ptr, shared_act_w_ptr,
    shared_partial_ptr, stride_shared_d_h, stride_shared_act_w, stride_shared_partial, shared_d_h_desc,
    shared_w_gate_up_k_desc, shared_dx_ptr, stride_shared_dx, d_shared_down_ptr, d_shared_gate_up_ptr,
    # counters, flags, error word
    rows_ready_ptr, dact_done_ptr, dx_done_ptr, shared_done_ptr, dgrads_done_ptr, comm_done_ptr,
    flag_peer_ptrs, flags_ptr, epoch_ptr, error_ptr, trace_base_ptr,
    # sizes and knobs
    tokens, my_rank, num_ranks, comm_sms, minibatch, experts, I, D, shared_I, limit, alpha, budget, phase_minibatch,
    TOP_K: tl.constexpr, CHUNKS: tl.constexpr, CP: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr,
    ALIGN: tl.constexpr, HAS_SHARED: tl.constexpr, ACT: tl.constexpr, DOT_FP32: tl.constexpr,
    FENCE: tl.constexpr, BLOCK_M: tl.constexpr, BN_DA: tl.constexpr, BK_DA: tl.constexpr, BN_DX: tl.constexpr,
    BK_DX: tl.constexpr, BM_W: tl.constexpr, BN_W: tl.constexpr, BK_W: tl.constexpr, GROUP_M: tl.constexpr,
    PHASE: tl.constexpr, TRACE: tl.constexpr,
):
    pid = tl.program_id(0)
    trace_ptr = trace_base_ptr + pid * TRACE_ROW
    if TRACE:
        tl.store(trace_ptr + TRACE_START, globaltimer())
        tl.store(trace_ptr + TRACE_SM, smid().to(tl.int64))
    num_rows = tl.load(num_rows_ptr).to(tl.int64)
    batches = tl.cdiv(num_rows, minibatch).to(tl.int32)
    WAIT: tl.constexpr = PHASE == PHASE_ALL
    if PHASE == PHASE_ALL:
        if pid < comm_sms:
            for j in range(batches):
                start = trace_clock(TRACE)
                pull_rows(j, pid, comm_sms, num_rows, minibatch, d_out_peer_ptrs, d_out_ptr, stride_rows, src_rank_ptr,
                          src_index_ptr, dy_ptr, stride_pass, TOP_K, CHUNKS, CP, W, ROWS, ALIGN)
                pull_rows(j, pid, comm_sms, num_rows, minibatch, x_peer_ptrs, x_ptr, stride_rows, src_rank_ptr,
                          src_index_ptr, x_rows_ptr, stride_pass, TOP_K, CHUNKS, CP, W, ROWS, ALIGN)
                release_add(rows_ready_ptr + j)
                trace_event(trace_ptr, start, TRACE_KIND_BWD_PULL, j, TRACE)
            for j in range(batches):
                budget = comm_push(j, pid, comm_sms, minibatch, batches + 1, budget, -1, dx_ptr, stride_dx,
                                   src_rank_ptr, src_index_ptr, slots_peer_ptrs, slots_ptr, stride_slots, dx_done_ptr,
                                   minibatch_tiles_ptr, tile_row0_ptr, tile_row_end_ptr, error_ptr, trace_ptr,
                                   tl.cdiv(D, BN_DX), CHUNKS, CP, W, ROWS, ALIGN, WAIT, TRACE, WAIT_DX)
            # End of pass: the last comm worker tells every rank its pushes landed and waits for theirs.
            tl.debug_barrier()
            arrived = tl.atomic_add(comm_done_ptr, 1, sem="acq_rel", scope="sys")
            if arrived == comm_sms - 1:
                epoch = tl.atomic_add(epoch_ptr, 1, sem="relaxed", scope="gpu") + 1
                signal_and_wait(flag_peer_ptrs, flags_ptr, my_rank, num_ranks, epoch, tl.maximum(budget, 1),
                                error_ptr, WAIT_PASS_END)
            tl.debug_barrier()
            if TRACE:
                tl.store(trace_ptr + TRACE_END, globaltimer())
        else:
            c = pid - comm_sms
            workers = tl.num_programs(0) - comm_sms
            dealt = c * 0
            if HAS_SHARED:
                dealt = shared_dact(c, workers, tokens, shared_dy_desc, shared_w_down_desc, shared_h_ptr, ones_ptr,
                                    shared_d_h_ptr, shared_act_w_ptr, shared_partial_ptr, stride_shared_h,
                                    stride_shared_d_h, stride_shared_act_w, stride_shared_partial, shared_done_ptr,
                                    trace_ptr, shared_I, D, limit, alpha, ACT, DOT_FP32, TRACE, BLOCK_M, BN_DA, BK_DA,
                                    GROUP_M)
                dealt, budget = shared_dx(c, workers, dealt, budget, tokens, shared_d_h_desc, shared_w_gate_up_k_desc,
                                          shared_dx_ptr, stride_shared_dx, shared_done_ptr, error_ptr, trace_ptr,
                                          shared_I, D, DOT_FP32, FENCE, WAIT, TRACE, BLOCK_M, BN_DA, BN_DX, BK_DX,
                                          GROUP_M)
            if TRACE:
                tl.store(trace_ptr + TRACE_SHARED_END, globaltimer())
            for j in range(batches):
                dealt, budget = dact_tasks(
                    j, c, workers, dealt, budget, minibatch, batches, dy_desc, w_down_desc, ring_h_ptr, stride_ring_h,
                    row_w_ptr, d_h_ptr, act_w_ptr, partial_ptr, stride_d_h, stride_act_w, stride_partial,
                    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, minibatch_tiles_ptr,
                    rows_ready_ptr, dact_done_ptr, dgrads_done_ptr, error_ptr, trace_ptr, comm_sms, I, D, limit, alpha,
                    ACT, DOT_FP32, FENCE, WAIT, TRACE, BLOCK_M, BN_DA, BK_DA, GROUP_M)
                dealt, budget = dx_tasks(
                    j, c, workers, dealt, budget, d_h_desc, w_gate_up_k_desc, dx_ptr, stride_dx, partial_ptr,
                    stride_partial, d_router_ptr, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr,
                    minibatch_tiles_ptr, dact_done_ptr, dx_done_ptr, error_ptr, trace_ptr, I, D, DOT_FP32, FENCE,
                    WAIT, TRACE, BLOCK_M, BN_DA, BN_DX, BK_DX, GROUP_M)
            dealt, budget = wgrad_tasks(
                c, workers, dealt, budget, minibatch_tiles_ptr, batches, offsets_ptr, counts_ptr, experts, tokens,
                dy_ptr, act_w_ptr, d_h_ptr, x_rows_ptr, d_w_down_ptr, d_w_gate_up_ptr, modes_ptr, down_in_ptr,
                down_out_ptr, gate_up_in_ptr, gate_up_out_ptr, d_out_ptr, shared_act_w_ptr, shared_d_h_ptr, x_ptr,
                d_shared_down_ptr, d_shared_gate_up_ptr, dgrads_done_ptr, error_ptr, trace_ptr, I, D, shared_I,
                DOT_FP32, FENCE, WAIT, TRACE, HAS_SHARED, BN_DA, BM_W, BN_W, BK_W)
            if TRACE:
                tl.store(trace_ptr + TRACE_END, globaltimer())
    else:
        # One step for all workers of one role: program pid is worker pid of tl.num_programs(0).
        workers = tl.num_programs(0)
        j = phase_minibatch
        if PHASE == PHASE_SHARED_DACT:
            shared_dact(pid, workers, tokens, shared_dy_desc, shared_w_down_desc, shared_h_ptr, ones_ptr,
                        shared_d_h_ptr, shared_act_w_ptr, shared_partial_ptr, stride_shared_h, stride_shared_d_h,
                        stride_shared_act_w, stride_shared_partial, shared_done_ptr, trace_ptr, shared_I, D, limit,
                        alpha, ACT, DOT_FP32, TRACE, BLOCK_M, BN_DA, BK_DA, GROUP_M)
        elif PHASE == PHASE_SHARED_DX:
            shared_dx(pid, workers, 0, budget, tokens, shared_d_h_desc, shared_w_gate_up_k_desc, shared_dx_ptr,
                      stride_shared_dx, shared_done_ptr, error_ptr, trace_ptr, shared_I, D, DOT_FP32, FENCE, WAIT,
                      TRACE, BLOCK_M, BN_DA, BN_DX, BK_DX, GROUP_M)
        elif PHASE == PHASE_PULL:
            pull_rows(j, pid, workers, num_rows, minibatch, d_out_peer_ptrs, d_out_ptr, stride_rows, src_rank_ptr,
                      src_index_ptr, dy_ptr, stride_pass, TOP_K, CHUNKS, CP, W, ROWS, ALIGN)
            pull_rows(j, pid, workers, num_rows, minibatch, x_peer_ptrs, x_ptr, stride_rows, src_rank_ptr,
                      src_index_ptr, x_rows_ptr, stride_pass, TOP_K, CHUNKS, CP, W, ROWS, ALIGN)
        elif PHASE == PHASE_DACT:
            dact_tasks(j, pid, workers, 0, budget, minibatch, batches, dy_desc, w_down_desc, ring_h_ptr, stride_ring_h,
                       row_w_ptr, d_h_ptr, act_w_ptr, partial_ptr, stride_d_h, stride_act_w, stride_partial,
                       tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, minibatch_tiles_ptr,
                       rows_ready_ptr, dact_done_ptr, dgrads_done_ptr, error_ptr, trace_ptr, comm_sms, I, D, limit,
                       alpha, ACT, DOT_FP32, FENCE, WAIT, TRACE, BLOCK_M, BN_DA, BK_DA, GROUP_M)
        elif PHASE == PHASE_DX:
            dx_tasks(j, pid, workers, 0, budget, d_h_desc, w_gate_up_k_desc, dx_ptr, stride_dx, partial_ptr,
                     stride_partial, d_router_ptr, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr,
                     minibatch_tiles_ptr, dact_done_ptr, dx_done_ptr, error_ptr, trace_ptr, I, D, DOT_FP32, FENCE,
                     WAIT, TRACE, BLOCK_M, BN_DA, BN_DX, BK_DX, GROUP_M)
        elif PHASE == PHASE_PUSH:
            comm_push(j, pid, workers, minibatch, batches + 1, budget, -1, dx_ptr, stride_dx, src_rank_ptr,
                      src_index_ptr, slots_peer_ptrs, slots_ptr, stride_slots, dx_done_ptr, minibatch_tiles_ptr,
                      tile_row0_ptr, tile_row_end_ptr, error_ptr, trace_ptr, tl.cdiv(D, BN_DX), CHUNKS, CP, W, ROWS,
                      ALIGN, WAIT, TRACE, WAIT_DX)
        elif PHASE == PHASE_WGRAD:
            wgrad_tasks(pid, workers, 0, budget, minibatch_tiles_ptr, batches, offsets_ptr, counts_ptr, experts, tokens,
                        dy_ptr, act_w_ptr, d_h_ptr, x_rows_ptr, d_w_down_ptr, d_w_gate_up_ptr, modes_ptr,
                        down_in_ptr, down_out_ptr, gate_up_in_ptr, gate_up_out_ptr, d_out_ptr, shared_act_w_ptr,
                        shared_d_h_ptr, x_ptr, d_shared_down_ptr, d_shared_gate_up_ptr, dgrads_done_ptr, error_ptr,
                        trace_ptr, I, D, shared_I, DOT_FP32, FENCE, WAIT, TRACE, HAS_SHARED, BN_DA, BM_W, BN_W, BK_W)
