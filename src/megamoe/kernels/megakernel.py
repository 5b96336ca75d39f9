"""The forward megakernel: one persistent launch moves, computes and returns every routed row.

docs/design.md, docs/megakernel.md. Grid = one program per SM, co-resident
(the launcher refuses a grid the GPU cannot hold at once, since programs
wait for each other). Programs ``0 .. comm_sms-1`` are communication
workers, the others compute workers; they meet only through GPU-local int32
counters (zeroed before each pass):

    rows_ready[j]     comm workers that pulled their share of minibatch j   (target comm_sms)
    tile_done[t]      gate/up n-tiles finished of row tile t                (target cdiv(I, BN_GU))
    y_done[j]         down tasks finished of minibatch j                     (target tiles(j) * cdiv(D, BN_DN))
    shared_done[t]    gate/up n-tiles finished of shared row tile t
    comm_done         comm workers finished (the last one opens the end-of-pass barrier across ranks)

Minibatch j holds routed rows ``[j*mb, min((j+1)*mb, num_rows))`` and lives in
ring slot ``j mod slots`` (ring rows ``slot*mb ..``): row t sits at ring row
``t + (slot - j) * mb``. Minibatches are visited in reverse (``M-1 .. 0``), so
the ring left after the pass holds the first ``slots`` minibatches. When the
ring holds every row (it never wraps) the row tiles are not cut at minibatch
boundaries: minibatch j's tiles are those starting in it, and the last may
reach into j + 1, which was pulled before j (comm workers release
rows_ready in visit order, so rows_ready[j] also covers j + 1's rows). Its
push then covers its tiles' rows, from its first tile's start to its last
tile's end.

Communication worker c, for each visited minibatch j: if the slot was used
(by j + slots), push that minibatch's outputs home first (wait y_done); then
pull its share of j's rows into the slot and release rows_ready[j]. After the
last pull it pushes the minibatches still in the ring, in visit order. When
the ring holds every row, the rows this rank owns are not pushed: their
outputs stay in y, where the weighted sum reads them.

Compute worker: the shared expert's gate/up and down tiles over this rank's
tokens (no wait on communication), then per visited minibatch: wait
rows_ready[j], gate/up + SwiGLU tasks (release tile_done), down tasks (each
waits for its row tile's gate/up) into the ring's y rows (release y_done).
Tasks are dealt from one global list in that order, round robin over the
compute workers; every wait targets an earlier task of the list, so the
waits cannot cycle.

Waits poll with acquire atomics within a per-program budget of polls; on
timeout the first failing wait writes ``[wait id, index, target, seen]`` to
the error word, the program's budget drops to 0 (later waits fail at once,
so the grid drains) and the host raises after the pass
(:mod:`megamoe.kernels.sync`). The weighted sum after the pass is
:mod:`megamoe.kernels.weighted_sum`.

PHASE > 0 runs one step of one role for all its workers (grid = those
workers), with waits compiled out: the interpreter runs programs one after
another, so the launcher sequences the steps (CPU mode). Each tile is
computed by the same code either way, so results are bitwise equal.

Over 400 lines: the forward megakernel's roles and the persistent kernel that deals them read as one
program (their shared waits and copies are kernels/sync.py and kernels/comm.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from triton.language.extra.cuda import globaltimer, smid

from megamoe.kernels.comm import pull_tile, push_tile, signal_and_wait
from megamoe.kernels.expert_gemm import down_tile, gate_up_act_tile
from megamoe.kernels.expert_gemm_fp8 import down_fp8_tile, gate_up_fp8_tile
from megamoe.kernels.expert_gemm_mxfp8 import down_mxfp8_tile, gate_up_mxfp8_tile
from megamoe.kernels.sync import (TRACE_END, TRACE_KIND_DOWN, TRACE_KIND_GATE_UP, TRACE_KIND_PULL, TRACE_KIND_PUSH,
                                  TRACE_KIND_SHARED_DOWN, TRACE_KIND_SHARED_GATE_UP, TRACE_ROW, TRACE_SHARED_END,
                                  TRACE_SM, TRACE_START, WAIT_PASS_END, WAIT_ROWS_READY, WAIT_SHARED_DONE,
                                  WAIT_TILE_DONE, WAIT_Y_DONE, fence_async_proxy, release_add, trace_clock,
                                  trace_event, wait_counter)
from megamoe.kernels.tasks import first_task, grouped_task, row_tile_task

#: PHASE values: 0 the whole pass; the others one step (CPU mode).
PHASE_ALL = tl.constexpr(0)
PHASE_SHARED_GATE_UP = tl.constexpr(1)
PHASE_SHARED_DOWN = tl.constexpr(2)
PHASE_PULL = tl.constexpr(3)
PHASE_GATE_UP = tl.constexpr(4)
PHASE_DOWN = tl.constexpr(5)
PHASE_PUSH = tl.constexpr(6)

#: FMT values: how the routed rows, act and weights are stored (the pull's QUANT codes).
FMT_BF16 = tl.constexpr(0)
FMT_MXFP8 = tl.constexpr(1)
FMT_FP8_BLOCK = tl.constexpr(2)


@triton.jit
def ring_shift(j, minibatch, slots):
    """Ring row minus routed row for minibatch j (it lives in slot j mod slots)."""
    return ((j % slots) - j).to(tl.int64) * minibatch


@triton.jit
def comm_pull(
    j, c, comm_sms, num_rows, minibatch, slots,
    rows_peer_ptrs, rows_ptr, stride_rows, scales_peer_ptrs, scales_ptr, stride_scales,
    src_rank_ptr, src_index_ptr, ring_ptr, stride_ring, ring_scale_ptr, stride_ring_scale, rows_ready_ptr,
    TOP_K: tl.constexpr, FMT: tl.constexpr,
    P_CHUNKS: tl.constexpr, P_CP: tl.constexpr, P_W: tl.constexpr, P_ROWS: tl.constexpr, P_ALIGN: tl.constexpr,
    S_CHUNKS: tl.constexpr, S_CP: tl.constexpr, S_W: tl.constexpr, S_ROWS: tl.constexpr, S_ALIGN: tl.constexpr,
):
    """Worker c's share of minibatch j's rows into its ring slot, then rows_ready[j] += 1.

    The rows are copied as their owners staged them: BF16 x, or (FMT quantised) E4M3 bytes and their scales,
    quantised once per token by the owner (P_*, S_*: the copy tiles of rows and scales).
    """
    first_row = j.to(tl.int64) * minibatch
    end_row = tl.minimum(first_row + minibatch, num_rows)
    shift = ring_shift(j, minibatch, slots)
    dst = ring_ptr + shift * stride_ring
    dst_scale = ring_scale_ptr + shift * stride_ring_scale
    for t0 in range(first_row + c * P_ROWS, end_row, comm_sms * P_ROWS):
        pull_tile(t0, end_row, rows_peer_ptrs, rows_ptr, stride_rows, src_rank_ptr, src_index_ptr, dst, stride_ring,
                  dst_scale, stride_ring_scale, TOP_K, P_CHUNKS, P_CP, P_W, P_ROWS, P_ALIGN, 0, False)
    if FMT != FMT_BF16:
        for t0 in range(first_row + c * S_ROWS, end_row, comm_sms * S_ROWS):
            pull_tile(t0, end_row, scales_peer_ptrs, scales_ptr, stride_scales, src_rank_ptr, src_index_ptr,
                      dst_scale, stride_ring_scale, dst_scale, stride_ring_scale,
                      TOP_K, S_CHUNKS, S_CP, S_W, S_ROWS, S_ALIGN, 0, False)
    release_add(rows_ready_ptr + j)


@triton.jit
def comm_push(
    j, c, comm_sms, minibatch, slots, budget, skip_rank,
    y_ptr, stride_y, src_rank_ptr, src_index_ptr, combine_peer_ptrs, combine_ptr, stride_combine,
    y_done_ptr, minibatch_tiles_ptr, tile_row0_ptr, tile_row_end_ptr, error_ptr, trace_ptr, num_n_down,
    CHUNKS: tl.constexpr, CP: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr, ALIGN: tl.constexpr,
    WAIT: tl.constexpr, TRACE: tl.constexpr, WAIT_ID: tl.constexpr = WAIT_Y_DONE,
):
    """Once minibatch j's down tasks are done, worker c's share of its tiles' rows to their home combine slots
    (the rows of minibatch j, or, with uncut tiles, from its first tile's start to its last tile's end).
    Rows whose home is ``skip_rank`` stay in the ring (-1: push every row). ``y_done[j]`` counts the tasks that
    wrote the rows (the backward's dx tasks push the same way: its WAIT_ID names them)."""
    t0 = tl.load(minibatch_tiles_ptr + j)
    tiles = tl.load(minibatch_tiles_ptr + j + 1) - t0
    budget = wait_counter(y_done_ptr + j, tiles * num_n_down, budget, error_ptr, j, trace_ptr, WAIT_ID, WAIT,
                          TRACE)
    has = tiles > 0
    first_row = tl.load(tile_row0_ptr + t0, mask=has, other=0).to(tl.int64)
    end_row = tl.load(tile_row_end_ptr + t0 + tiles - 1, mask=has, other=0).to(tl.int64)
    src = y_ptr + ring_shift(j, minibatch, slots) * stride_y
    start = trace_clock(TRACE)
    for t0 in range(first_row + c * ROWS, end_row, comm_sms * ROWS):
        push_tile(t0, end_row, src, stride_y, src_index_ptr, src_rank_ptr, src_index_ptr, combine_peer_ptrs,
                  combine_ptr, stride_combine, skip_rank, 1, True, CHUNKS, CP, W, ROWS, ALIGN)
    trace_event(trace_ptr, start, TRACE_KIND_PUSH, j, TRACE)
    return budget


@triton.jit
def compute_gate_up(
    j, c, workers, dealt, minibatch, slots, budget,
    ring_desc, w_gate_up_desc, h_ptr, act_ptr, stride_h, stride_act,
    ring_scale_ptr, w_gate_up_scale_ptr, act_scale_ptr, stride_ring_scale, stride_wgu_scale, stride_act_scale,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, minibatch_tiles_ptr, rows_ready_ptr, tile_done_ptr,
    error_ptr, trace_ptr, comm_sms, experts, I, D, limit, alpha,
    ACT: tl.constexpr, DOT_FP32: tl.constexpr, FENCE: tl.constexpr, WAIT: tl.constexpr, TRACE: tl.constexpr,
    FMT: tl.constexpr, SOFT_E4M3: tl.constexpr,
    BLOCK_M: tl.constexpr, BN_GU: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, b_ptr=None,
):
    """Worker c's gate/up + SwiGLU tasks of minibatch j (``b_ptr``: the optional expert bias `[L, 2I]`); returns
    (tasks dealt so far, budget)."""
    t0 = tl.load(minibatch_tiles_ptr + j)
    tiles = tl.load(minibatch_tiles_ptr + j + 1) - t0
    num_n = tl.cdiv(I, BN_GU)
    tasks = tiles * num_n
    shift = ring_shift(j, minibatch, slots).to(tl.int32)
    first = first_task(c, workers, dealt)
    if first < tasks:
        budget = wait_counter(rows_ready_ptr + j, comm_sms, budget, error_ptr, j, trace_ptr, WAIT_ROWS_READY,
                              WAIT, TRACE)
        fence_async_proxy(FENCE)
    for task in range(first, tasks, workers):
        start = trace_clock(TRACE)
        tile, n = row_tile_task(task, num_n, t0, tile_run_ptr, GROUP_M)
        expert = tl.load(tile_expert_ptr + tile)
        row0 = tl.load(tile_row0_ptr + tile) + shift
        row_end = tl.load(tile_row_end_ptr + tile) + shift
        if FMT == FMT_FP8_BLOCK:
            gate_up_fp8_tile(ring_desc, w_gate_up_desc, ring_scale_ptr, w_gate_up_scale_ptr, h_ptr, act_ptr,
                             act_scale_ptr, stride_ring_scale, stride_wgu_scale, stride_h, stride_act, stride_act_scale,
                             row0, row_end, expert, n * BN_GU, I, D, limit, alpha, ACT, True, DOT_FP32, SOFT_E4M3,
                             BLOCK_M, BN_GU, b_ptr)
        elif FMT == FMT_MXFP8:
            gate_up_mxfp8_tile(ring_desc, w_gate_up_desc, ring_scale_ptr, w_gate_up_scale_ptr, h_ptr, act_ptr,
                               act_scale_ptr, stride_ring_scale, stride_wgu_scale, stride_h, stride_act,
                               stride_act_scale, row0, row_end, expert, n * BN_GU, I, experts * 2 * I, D, limit, alpha,
                               ACT, True, DOT_FP32, SOFT_E4M3, BLOCK_M, BN_GU, BLOCK_K, b_ptr)
        else:
            gate_up_act_tile(ring_desc, w_gate_up_desc, h_ptr, act_ptr, stride_h, stride_act, row0, row_end,
                                expert, n * BN_GU, I, D, limit, alpha, ACT, DOT_FP32, BLOCK_M, BN_GU, BLOCK_K, b_ptr)
        release_add(tile_done_ptr + tile)
        trace_event(trace_ptr, start, TRACE_KIND_GATE_UP, tile * 65536 + n, TRACE)
    return dealt + tasks, budget


@triton.jit
def compute_down(
    j, c, workers, dealt, minibatch, slots, budget,
    act_desc, w_down_desc, y_ptr, stride_y, act_scale_ptr, w_down_scale_ptr, stride_act_scale, stride_wdn_scale,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, minibatch_tiles_ptr, tile_done_ptr, y_done_ptr,
    error_ptr, trace_ptr, experts, I, D,
    DOT_FP32: tl.constexpr, FENCE: tl.constexpr, WAIT: tl.constexpr, TRACE: tl.constexpr, FMT: tl.constexpr,
    BLOCK_M: tl.constexpr, BN_GU: tl.constexpr, BN_DN: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    b_ptr=None,
):
    """Worker c's down tasks of minibatch j (each after its row tile's gate/up; ``b_ptr``: the optional expert
    bias `[L, D]`); returns (dealt, budget)."""
    t0 = tl.load(minibatch_tiles_ptr + j)
    tiles = tl.load(minibatch_tiles_ptr + j + 1) - t0
    num_n = tl.cdiv(D, BN_DN)
    tasks = tiles * num_n
    shift = ring_shift(j, minibatch, slots).to(tl.int32)
    for task in range(first_task(c, workers, dealt), tasks, workers):
        tile, n = row_tile_task(task, num_n, t0, tile_run_ptr, GROUP_M)
        budget = wait_counter(tile_done_ptr + tile, tl.cdiv(I, BN_GU), budget, error_ptr, tile, trace_ptr,
                              WAIT_TILE_DONE, WAIT, TRACE)
        fence_async_proxy(FENCE)
        start = trace_clock(TRACE)
        expert = tl.load(tile_expert_ptr + tile)
        row0 = tl.load(tile_row0_ptr + tile) + shift
        row_end = tl.load(tile_row_end_ptr + tile) + shift
        if FMT == FMT_FP8_BLOCK:
            down_fp8_tile(act_desc, w_down_desc, act_scale_ptr, w_down_scale_ptr, y_ptr, stride_act_scale,
                          stride_wdn_scale, stride_y, row0, row_end, expert, n * BN_DN, D, I, DOT_FP32, BLOCK_M, BN_DN,
                          b_ptr)
        elif FMT == FMT_MXFP8:
            down_mxfp8_tile(act_desc, w_down_desc, act_scale_ptr, w_down_scale_ptr, y_ptr, stride_act_scale,
                            stride_wdn_scale, stride_y, row0, row_end, expert, n * BN_DN, D, experts * D, I,
                            DOT_FP32, BLOCK_M, BN_DN, BLOCK_K, b_ptr)
        else:
            down_tile(act_desc, w_down_desc, y_ptr, stride_y, row0, row_end, expert, n * BN_DN, D, I,
                      DOT_FP32, BLOCK_M, BN_DN, BLOCK_K, b_ptr)
        release_add(y_done_ptr + j)
        trace_event(trace_ptr, start, TRACE_KIND_DOWN, tile * 65536 + n, TRACE)
    return dealt + tasks, budget


@triton.jit
def shared_gate_up(
    c, workers, tokens, x_desc, w_desc, h_ptr, act_ptr, stride_h, stride_act, done_ptr, trace_ptr, I, D, limit, alpha,
    ACT: tl.constexpr, DOT_FP32: tl.constexpr, TRACE: tl.constexpr,
    BLOCK_M: tl.constexpr, BN_GU: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Worker c's gate/up tasks of the shared expert over this rank's tokens; returns tasks dealt."""
    # This loop and shared_down have their twins in the backward (megakernel_bwd.shared_dact, shared_dx) and stay
    # twice: each interleaves its own tile call, waits and trace kind with the task (megamoe.kernels.tasks).
    num_n = tl.cdiv(I, BN_GU)
    tiles = tl.cdiv(tokens, BLOCK_M)
    for task in range(c, tiles * num_n, workers):
        start = trace_clock(TRACE)
        tile, n = grouped_task(task, num_n, tiles, GROUP_M)
        row0 = tile * BLOCK_M
        gate_up_act_tile(x_desc, w_desc, h_ptr, act_ptr, stride_h, stride_act, row0, tokens, 0, n * BN_GU, I, D,
                            limit, alpha, ACT, DOT_FP32, BLOCK_M, BN_GU, BLOCK_K)
        release_add(done_ptr + tile)
        trace_event(trace_ptr, start, TRACE_KIND_SHARED_GATE_UP, tile * 65536 + n, TRACE)
    return tiles * num_n


@triton.jit
def shared_down(
    c, workers, dealt, budget, tokens, act_desc, w_desc, y_ptr, stride_y, done_ptr, error_ptr, trace_ptr, I, D,
    DOT_FP32: tl.constexpr, FENCE: tl.constexpr, WAIT: tl.constexpr, TRACE: tl.constexpr,
    BLOCK_M: tl.constexpr, BN_GU: tl.constexpr, BN_DN: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Worker c's down tasks of the shared expert; returns (dealt, budget)."""
    num_n = tl.cdiv(D, BN_DN)
    tiles = tl.cdiv(tokens, BLOCK_M)
    for task in range(first_task(c, workers, dealt), tiles * num_n, workers):
        tile, n = grouped_task(task, num_n, tiles, GROUP_M)
        budget = wait_counter(done_ptr + tile, tl.cdiv(I, BN_GU), budget, error_ptr, tile, trace_ptr,
                              WAIT_SHARED_DONE, WAIT, TRACE)
        fence_async_proxy(FENCE)
        start = trace_clock(TRACE)
        down_tile(act_desc, w_desc, y_ptr, stride_y, tile * BLOCK_M, tokens, 0, n * BN_DN, D, I,
                  DOT_FP32, BLOCK_M, BN_DN, BLOCK_K)
        trace_event(trace_ptr, start, TRACE_KIND_SHARED_DOWN, tile * 65536 + n, TRACE)
    return dealt + tiles * num_n, budget


@triton.jit(do_not_specialize=["tokens", "my_rank", "comm_sms", "slots", "budget", "phase_minibatch",
                               "limit", "alpha"])
def megakernel(
    # schedule and row tiles (device)
    num_rows_ptr, src_rank_ptr, src_index_ptr,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, minibatch_tiles_ptr,
    # communication: the symmetric rows the owners staged (BF16 x, or E4M3 x and its scales) pulled into the
    # ring's rows (and scales), symmetric combine slots (pushed)
    rows_peer_ptrs, rows_ptr, stride_rows, scales_peer_ptrs, scales_ptr, stride_scales, ring_ptr, stride_ring,
    combine_peer_ptrs, combine_ptr, stride_combine,
    # routed experts over the ring; their optional biases (None: compiled out)
    ring_desc, w_gate_up_desc, h_ptr, act_ptr, stride_h, stride_act, act_desc, w_down_desc, y_ptr, stride_y,
    b_gate_up_ptr, b_down_ptr,
    # FP8 scales of the ring rows, the gate/up and down weights and act (MXFP8: E8M0 1x32; FP8-block: fp32
    # 1x128, weights 128x128)
    ring_scale_ptr, w_gate_up_scale_ptr, act_scale_ptr, w_down_scale_ptr,
    stride_ring_scale, stride_wgu_scale, stride_act_scale, stride_wdn_scale,
    # shared expert over this rank's tokens
    shared_x_desc, shared_w_gate_up_desc, shared_h_ptr, shared_act_ptr, stride_shared_h, stride_shared_act,
    shared_act_desc, shared_w_down_desc, shared_y_ptr, stride_shared_y,
    # counters, flags, error word
    rows_ready_ptr, tile_done_ptr, y_done_ptr, shared_done_ptr, comm_done_ptr,
    flag_peer_ptrs, flags_ptr, epoch_ptr, error_ptr, trace_base_ptr,
    # sizes and knobs
    tokens, my_rank, num_ranks, comm_sms, minibatch, slots, experts, I, D, shared_I, limit, alpha, budget,
    phase_minibatch,
    TOP_K: tl.constexpr, CHUNKS: tl.constexpr, CP: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr,
    ALIGN: tl.constexpr, HAS_SHARED: tl.constexpr, ACT: tl.constexpr, DOT_FP32: tl.constexpr, FENCE: tl.constexpr,
    BLOCK_M: tl.constexpr, BN_GU: tl.constexpr, BN_DN: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_GU: tl.constexpr, GROUP_DN: tl.constexpr, PHASE: tl.constexpr, TRACE: tl.constexpr,
    FMT: tl.constexpr, SOFT_E4M3: tl.constexpr,
    SHARED_BN_GU: tl.constexpr, SHARED_BN_DN: tl.constexpr, SHARED_BK: tl.constexpr,
    P_CHUNKS: tl.constexpr, P_CP: tl.constexpr, P_W: tl.constexpr, P_ROWS: tl.constexpr, P_ALIGN: tl.constexpr,
    S_CHUNKS: tl.constexpr, S_CP: tl.constexpr, S_W: tl.constexpr, S_ROWS: tl.constexpr, S_ALIGN: tl.constexpr,
):
    pid = tl.program_id(0)
    trace_ptr = trace_base_ptr + pid * TRACE_ROW
    if TRACE:
        tl.store(trace_ptr + TRACE_START, globaltimer())
        tl.store(trace_ptr + TRACE_SM, smid().to(tl.int64))
    num_rows = tl.load(num_rows_ptr).to(tl.int64)
    batches = tl.cdiv(num_rows, minibatch).to(tl.int32)
    # When the ring holds every row, the outputs of this rank's own routes stay in y, where the
    # weighted sum reads them (the schedule's own_rows): only the other ranks' rows are pushed home.
    skip_rank = tl.where(batches <= slots, my_rank, -1)
    WAIT: tl.constexpr = PHASE == PHASE_ALL
    if PHASE == PHASE_ALL:
        if pid < comm_sms:
            for p in range(batches):
                j = batches - 1 - p
                if p >= slots:  # the slot still holds minibatch j + slots: send it home first
                    budget = comm_push(
                        j + slots, pid, comm_sms, minibatch, slots, budget, skip_rank,
                        y_ptr, stride_y, src_rank_ptr, src_index_ptr, combine_peer_ptrs, combine_ptr, stride_combine,
                        y_done_ptr, minibatch_tiles_ptr, tile_row0_ptr, tile_row_end_ptr, error_ptr, trace_ptr,
                        tl.cdiv(D, BN_DN),
                        CHUNKS, CP, W, ROWS, ALIGN, WAIT, TRACE)
                start = trace_clock(TRACE)
                comm_pull(j, pid, comm_sms, num_rows, minibatch, slots,
                          rows_peer_ptrs, rows_ptr, stride_rows, scales_peer_ptrs, scales_ptr, stride_scales,
                          src_rank_ptr, src_index_ptr, ring_ptr, stride_ring, ring_scale_ptr, stride_ring_scale,
                          rows_ready_ptr, TOP_K, FMT, P_CHUNKS, P_CP, P_W, P_ROWS, P_ALIGN,
                          S_CHUNKS, S_CP, S_W, S_ROWS, S_ALIGN)
                trace_event(trace_ptr, start, TRACE_KIND_PULL, j, TRACE)
            for p in range(tl.maximum(batches - slots, 0), batches):
                budget = comm_push(
                    batches - 1 - p, pid, comm_sms, minibatch, slots, budget, skip_rank,
                    y_ptr, stride_y, src_rank_ptr, src_index_ptr, combine_peer_ptrs, combine_ptr, stride_combine,
                    y_done_ptr, minibatch_tiles_ptr, tile_row0_ptr, tile_row_end_ptr, error_ptr, trace_ptr,
                    tl.cdiv(D, BN_DN),
                    CHUNKS, CP, W, ROWS, ALIGN, WAIT, TRACE)
            # End of pass: the last comm worker of this rank tells every rank its pushes landed and waits
            # for theirs (system scope), so the epilogue launched after this kernel reads complete slots.
            tl.debug_barrier()
            arrived = tl.atomic_add(comm_done_ptr, 1, sem="acq_rel", scope="sys")
            if arrived == comm_sms - 1:
                epoch = tl.atomic_add(epoch_ptr, 1, sem="relaxed", scope="gpu") + 1  # once, not per thread
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
                dealt = shared_gate_up(c, workers, tokens, shared_x_desc, shared_w_gate_up_desc, shared_h_ptr,
                                       shared_act_ptr, stride_shared_h, stride_shared_act, shared_done_ptr,
                                       trace_ptr, shared_I, D, limit, alpha, ACT, DOT_FP32, TRACE, BLOCK_M,
                                       SHARED_BN_GU, SHARED_BK, GROUP_GU)
                dealt, budget = shared_down(c, workers, dealt, budget, tokens, shared_act_desc, shared_w_down_desc,
                                            shared_y_ptr, stride_shared_y, shared_done_ptr, error_ptr, trace_ptr,
                                            shared_I, D, DOT_FP32, FENCE, WAIT, TRACE, BLOCK_M, SHARED_BN_GU,
                                            SHARED_BN_DN, SHARED_BK, GROUP_DN)
            if TRACE:
                tl.store(trace_ptr + TRACE_SHARED_END, globaltimer())
            for p in range(batches):
                j = batches - 1 - p
                dealt, budget = compute_gate_up(
                    j, c, workers, dealt, minibatch, slots, budget,
                    ring_desc, w_gate_up_desc, h_ptr, act_ptr, stride_h, stride_act,
                    ring_scale_ptr, w_gate_up_scale_ptr, act_scale_ptr, stride_ring_scale, stride_wgu_scale,
                    stride_act_scale, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr,
                    minibatch_tiles_ptr, rows_ready_ptr, tile_done_ptr, error_ptr, trace_ptr, comm_sms, experts, I,
                    D, limit, alpha, ACT, DOT_FP32, FENCE, WAIT, TRACE, FMT, SOFT_E4M3, BLOCK_M, BN_GU, BLOCK_K,
                    GROUP_GU, b_gate_up_ptr)
                dealt, budget = compute_down(
                    j, c, workers, dealt, minibatch, slots, budget,
                    act_desc, w_down_desc, y_ptr, stride_y, act_scale_ptr, w_down_scale_ptr, stride_act_scale,
                    stride_wdn_scale, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr,
                    minibatch_tiles_ptr, tile_done_ptr, y_done_ptr, error_ptr, trace_ptr, experts, I, D,
                    DOT_FP32, FENCE, WAIT, TRACE, FMT, BLOCK_M, BN_GU, BN_DN, BLOCK_K, GROUP_DN, b_down_ptr)
            if TRACE:
                tl.store(trace_ptr + TRACE_END, globaltimer())
    else:
        # One step for all workers of one role: program pid is worker pid of tl.num_programs(0).
        workers = tl.num_programs(0)
        j = phase_minibatch
        if PHASE == PHASE_SHARED_GATE_UP:
            shared_gate_up(pid, workers, tokens, shared_x_desc, shared_w_gate_up_desc, shared_h_ptr, shared_act_ptr,
                           stride_shared_h, stride_shared_act, shared_done_ptr, trace_ptr, shared_I, D, limit, alpha,
                           ACT, DOT_FP32, TRACE, BLOCK_M, SHARED_BN_GU, SHARED_BK, GROUP_GU)
        elif PHASE == PHASE_SHARED_DOWN:
            shared_down(pid, workers, 0, budget, tokens, shared_act_desc, shared_w_down_desc, shared_y_ptr,
                        stride_shared_y, shared_done_ptr, error_ptr, trace_ptr, shared_I, D,
                        DOT_FP32, FENCE, WAIT, TRACE, BLOCK_M, SHARED_BN_GU, SHARED_BN_DN, SHARED_BK, GROUP_DN)
        elif PHASE == PHASE_PULL:
            comm_pull(j, pid, workers, num_rows, minibatch, slots,
                      rows_peer_ptrs, rows_ptr, stride_rows, scales_peer_ptrs, scales_ptr, stride_scales,
                      src_rank_ptr, src_index_ptr, ring_ptr, stride_ring, ring_scale_ptr, stride_ring_scale,
                      rows_ready_ptr, TOP_K, FMT, P_CHUNKS, P_CP, P_W, P_ROWS, P_ALIGN,
                      S_CHUNKS, S_CP, S_W, S_ROWS, S_ALIGN)
        elif PHASE == PHASE_GATE_UP:
            compute_gate_up(j, pid, workers, 0, minibatch, slots, budget,
                            ring_desc, w_gate_up_desc, h_ptr, act_ptr, stride_h, stride_act,
                            ring_scale_ptr, w_gate_up_scale_ptr, act_scale_ptr, stride_ring_scale, stride_wgu_scale,
                            stride_act_scale, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr,
                            minibatch_tiles_ptr, rows_ready_ptr, tile_done_ptr, error_ptr, trace_ptr, comm_sms,
                            experts, I, D, limit, alpha, ACT, DOT_FP32, FENCE, WAIT, TRACE, FMT, SOFT_E4M3,
                            BLOCK_M, BN_GU, BLOCK_K, GROUP_GU, b_gate_up_ptr)
        elif PHASE == PHASE_DOWN:
            compute_down(j, pid, workers, 0, minibatch, slots, budget,
                         act_desc, w_down_desc, y_ptr, stride_y, act_scale_ptr, w_down_scale_ptr, stride_act_scale,
                         stride_wdn_scale, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr,
                         minibatch_tiles_ptr, tile_done_ptr, y_done_ptr, error_ptr, trace_ptr, experts, I, D,
                         DOT_FP32, FENCE, WAIT, TRACE, FMT, BLOCK_M, BN_GU, BN_DN, BLOCK_K, GROUP_DN, b_down_ptr)
        elif PHASE == PHASE_PUSH:
            comm_push(j, pid, workers, minibatch, slots, budget, skip_rank,
                      y_ptr, stride_y, src_rank_ptr, src_index_ptr, combine_peer_ptrs, combine_ptr, stride_combine,
                      y_done_ptr, minibatch_tiles_ptr, tile_row0_ptr, tile_row_end_ptr, error_ptr, trace_ptr,
                      tl.cdiv(D, BN_DN),
                      CHUNKS, CP, W, ROWS, ALIGN, WAIT, TRACE)
