"""The FP8-block forward expert tiles on Hopper, warp-specialised in Gluon: a TMA producer warp and two MMA warpgroups.

``gate_up_fp8_kernel`` and ``down_fp8_kernel``'s contracts, 128 x 128 tiles, tasks (``row_tile_task`` order) and
bits: every K step's product is promoted as ``acc += p * (a_scale * w_scale)`` in the same order. The Triton kernels
wait for each step's product with both warpgroups at once (their TMA issues are CTA barriers), so the tensor cores
idle while the FFMAs of the promotion run. Here the producer is the BF16 forward's
(``forward_warp_specialized.forward_producer``: slots of [128 rows x 128] and [gate (and up) 128 x 128] e4m3), and
two consumer warpgroups, rows 0-63 and 64-127 of each tile, are tied by the ring's mbarriers only:

- gate/up: a warpgroup runs a step's gate product, waits for it and promotes it, then the up product, so one
  warpgroup's promotion runs under the other's wgmmas; the scales of the next K block are loaded a step ahead.
  Two products in flight would need 256 registers (two accumulators and two products of 64 x 128 fp32).
- down: pairs of K steps, both products in flight; the first is promoted while the second's wgmmas run (one
  warpgroup overlaps with itself too), then a single step if K / 128 is odd.

Measured against the Triton kernels, % of ``torch._scaled_mm`` (benchmarks/results/2026-12-04-fp8-warp-specialized):
gate/up 65 vs 64 on 341-row experts, 76 vs 71 on 383-row ones; down 77 vs 63 and 87 vs 69.
`megamoe.ops.experts_fp8` runs it on Hopper for 128-row tiles; a GPU test holds it to the Triton kernels' bits.
GPU only (Gluon has no interpreter). Launch with a scratch allocator (the descriptors), 4 warps.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from megamoe.kernels.activation import activation
from megamoe.kernels.forward_warp_specialized import (HALF_M, add_bias_columns, forward_producer, store_half_tile,
                                                      store_half_tile_at)
from megamoe.kernels.gluon_ring import invalidate_ring, pass_steps, ring_barriers
from megamoe.kernels.quant import fp8_block_quantize_tile
from megamoe.kernels.tasks import tile_task

BLOCK = gl.constexpr(128)  # the K step, the tile's columns and the scale block
# Registers: each consumer warpgroup takes 232 (the first one, warp_specialize's default partition, gets what the
# workers leave: 192 with a producer of 80, and then spills)
REGS_CONSUMER, REGS_PRODUCER = gl.constexpr(232), gl.constexpr(40)


@gluon.jit
def _product(a_smem, w_smem, slot, HALF: gl.constexpr, W_SLICE: gl.constexpr, layout: gl.constexpr):
    """Issue one K step's [64 x 128] product of this warpgroup's rows and weight slice W_SLICE (gate 0, up 1)."""
    w = w_smem.index(slot).slice(W_SLICE * BLOCK, BLOCK).permute((1, 0))
    return warpgroup_mma(a_smem.index(2 * slot + HALF), w, gl.zeros((HALF_M, BLOCK), gl.float32, layout),
                         use_acc=False, is_async=True)


@gluon.jit
def _gate_up_steps(xs_rows, row_ok, ws_gate, ws_up, K, g, a_smem, w_smem, full, empty, HALF: gl.constexpr,
                   STAGES: gl.constexpr, layout: gl.constexpr):
    """The task's K loop for gate/up from ring step ``g``: (acc_gate, acc_up, the next step)."""
    acc_gate = gl.zeros((HALF_M, BLOCK), gl.float32, layout)
    acc_up = gl.zeros((HALF_M, BLOCK), gl.float32, layout)
    a_s = gl.load(xs_rows, mask=row_ok & (K > 0), other=0.0)
    s_gate = gl.load(ws_gate, mask=K > 0, other=0.0)
    s_up = gl.load(ws_up, mask=K > 0, other=0.0)
    for k in range(0, K, BLOCK):
        more = k + BLOCK < K  # the next K block's scales, their latency under this step's wgmmas
        kb = k // BLOCK + 1
        a_s_next = gl.load(xs_rows + kb, mask=row_ok & more, other=0.0)
        s_gate_next = gl.load(ws_gate + kb, mask=more, other=0.0)
        s_up_next = gl.load(ws_up + kb, mask=more, other=0.0)
        slot = g % STAGES
        mbarrier.wait(full.index(slot), (g // STAGES) & 1)
        p = _product(a_smem, w_smem, slot, HALF, 0, layout)
        p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
        acc_gate += p * (a_s[:, None] * s_gate)
        p = _product(a_smem, w_smem, slot, HALF, 1, layout)
        p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
        mbarrier.arrive(empty.index(slot), count=1)
        acc_up += p * (a_s[:, None] * s_up)
        a_s, s_gate, s_up = a_s_next, s_gate_next, s_up_next
        g += 1
    return acc_gate, acc_up, g


@gluon.jit
def paired_k_steps(xs_rows, row_ok, ws_n, K, g, a_smem, w_smem, full, empty, HALF: gl.constexpr,
                   STAGES: gl.constexpr, layout: gl.constexpr):
    """A task's K loop with one weight slice (down; the FP8 dact's too) from ring step ``g``, in pairs of steps:
    (acc, the next step). ``xs_rows``: this warpgroup's rows' scale pointers, ``ws_n`` the weight block's."""
    gl.static_assert(STAGES >= 2, "pairs of K steps hold two ring slots")
    acc = gl.zeros((HALF_M, BLOCK), gl.float32, layout)
    steps = K // BLOCK
    for kb in range(0, steps - 1, 2):
        a_s0 = gl.load(xs_rows + kb, mask=row_ok, other=0.0)
        a_s1 = gl.load(xs_rows + kb + 1, mask=row_ok, other=0.0)
        s0 = gl.load(ws_n + kb)
        s1 = gl.load(ws_n + kb + 1)
        slot0 = g % STAGES
        slot1 = (g + 1) % STAGES
        mbarrier.wait(full.index(slot0), (g // STAGES) & 1)
        p0 = _product(a_smem, w_smem, slot0, HALF, 0, layout)
        mbarrier.wait(full.index(slot1), ((g + 1) // STAGES) & 1)
        p1 = _product(a_smem, w_smem, slot1, HALF, 0, layout)
        p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0,))
        mbarrier.arrive(empty.index(slot0), count=1)
        acc += p0 * (a_s0[:, None] * s0)
        p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p1,))
        mbarrier.arrive(empty.index(slot1), count=1)
        acc += p1 * (a_s1[:, None] * s1)
        g += 2
    if steps % 2:
        kb = steps - 1
        a_s = gl.load(xs_rows + kb, mask=row_ok, other=0.0)
        s = gl.load(ws_n + kb)
        slot = g % STAGES
        mbarrier.wait(full.index(slot), (g // STAGES) & 1)
        p = _product(a_smem, w_smem, slot, HALF, 0, layout)
        p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
        mbarrier.arrive(empty.index(slot), count=1)
        acc += p * (a_s[:, None] * s)
        g += 1
    return acc, g


@gluon.jit
def _consumer(x_scale_ptr, w_scale_ptr, out_ptr, act_q_ptr, act_scale_ptr, b_ptr, out_index_ptr, stride_xs,
              stride_ws_n, stride_out, stride_act, stride_as, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
              tile_run_ptr, num_tiles_ptr, N, K, limit, alpha, a_smem, w_smem, full, empty, HALF: gl.constexpr,
              GATE_UP: gl.constexpr, ACT: gl.constexpr, STORE_H: gl.constexpr, SOFT_E4M3: gl.constexpr,
              NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr,
              SCATTER: gl.constexpr, SKIP_EMPTY_HALF: gl.constexpr):
    """Rows HALF * 64 .. HALF * 64 + 63 of every tile of this program (one warpgroup). gate/up: out is h (gate
    columns 0..N-1, up columns N..2N-1; written with STORE_H), act_q / act_scale the act quantised 1 x 128; down:
    out is y (with SCATTER row r at y row ``out_index[r]``). HAS_BIAS: b_ptr's expert row is added to the
    accumulators first. SKIP_EMPTY_HALF: the bottom warpgroup passes the steps of a tile of at most 64 rows
    (``gluon_ring.pass_steps``)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 32])
    runs16: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # 16-byte runs of bf16
    runs8: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])  # and of e4m3
    W_SLICES: gl.constexpr = 2 if GATE_UP else 1
    num_n = gl.cdiv(N, BLOCK)
    num_tasks = gl.load(num_tiles_ptr) * num_n
    g = 0  # the program's K steps, in the producer's order
    for task in range(gl.program_id(0), num_tasks, NUM_PROGRAMS):
        expert, row0, row_end, n = tile_task(task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                                             tile_run_ptr, GROUP_M)
        if SKIP_EMPTY_HALF and HALF == 1 and row_end - row0 <= HALF_M:
            g = pass_steps(full, empty, g, K // BLOCK, STAGES)
        else:
            first = row0 + HALF * HALF_M
            rows = first + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, mma))
            row_ok = rows < row_end
            xs_rows = x_scale_ptr + rows.to(gl.int64) * stride_xs
            ws_n = w_scale_ptr + (expert.to(gl.int64) * (W_SLICES * N // BLOCK) + n) * stride_ws_n  # gate's (down: y's)
            col0 = n * BLOCK
            if GATE_UP:
                acc_gate, acc_up, g = _gate_up_steps(xs_rows, row_ok, ws_n, ws_n + (N // BLOCK) * stride_ws_n, K, g,
                                                     a_smem, w_smem, full, empty, HALF, STAGES, mma)
                if HAS_BIAS:
                    acc_gate = add_bias_columns(acc_gate, b_ptr, expert * 2 * N, col0, N, False, BLOCK, mma)
                    acc_up = add_bias_columns(acc_up, b_ptr, expert * 2 * N + N, col0, N, False, BLOCK, mma)
                if STORE_H:
                    store_half_tile(out_ptr, stride_out, acc_gate, first, row_end - first, col0, N - col0, runs16)
                    store_half_tile(out_ptr, stride_out, acc_up, first, row_end - first, N + col0, N - col0, runs16)
                act = activation(acc_gate, acc_up, limit, alpha, ACT)
                act_q, act_s = fp8_block_quantize_tile(act, 1, BLOCK, SOFT_E4M3)  # [64, 128], [64, 1]
                store_half_tile(act_q_ptr, stride_act, act_q.to(gl.uint8, bitcast=True), first, row_end - first, col0,
                                N - col0, runs8)
                gl.store(act_scale_ptr + rows.to(gl.int64)[:, None] * stride_as + n, act_s, mask=row_ok[:, None])
            else:
                acc, g = paired_k_steps(xs_rows, row_ok, ws_n, K, g, a_smem, w_smem, full, empty, HALF, STAGES, mma)
                if HAS_BIAS:
                    acc = add_bias_columns(acc, b_ptr, expert * N, col0, N, False, BLOCK, mma)
                if SCATTER:
                    store_half_tile_at(out_ptr, stride_out, acc, out_index_ptr, first, row_end - first, col0, N - col0,
                                       runs16)
                else:
                    store_half_tile(out_ptr, stride_out, acc, first, row_end - first, col0, N - col0, runs16)


@gluon.jit
def forward_fp8_ws_kernel(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, out_ptr, act_q_ptr, act_scale_ptr, b_ptr,
                          out_index_ptr, stride_a, stride_as_in, stride_ws_n, stride_out, stride_act, stride_as,
                          tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr,
                          rows, w_rows, N, K, limit, alpha, GATE_UP: gl.constexpr, ACT: gl.constexpr,
                          STORE_H: gl.constexpr, SOFT_E4M3: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                          GROUP_M: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr = False,
                          SCATTER: gl.constexpr = False, SKIP_EMPTY_HALF: gl.constexpr = False):
    """One persistent launch of 128 x 128 tiles over every (row tile, n-tile) task.

    gate/up (GATE_UP): a = x_q `[rows, K=D]` e4m3 with a_scale `[rows, D/128]`, w = w_gate_up_q `[w_rows = L*2N, K]`
    with w_scale `[L*2N/128, D/128]` rows of stride_ws_n, out = h `[rows, 2N]` bf16 (N = I), act_q `[rows, N]` (u8
    view of e4m3), act_scale `[rows, N/128]` fp32. down: a = act_q `[rows, K=I]` with its scales, w = w_down_q
    `[w_rows = L*N, K]`, out = y `[rows, N=D]` bf16; the act pointers unused. N and K multiples of 128. HAS_BIAS:
    ``b_ptr`` the experts' bf16 bias (gate/up's `[L, 2N]`, down's `[L, N]`) is added before the epilogue (else never
    read). SCATTER (down): row r of y is stored at y row ``out_index_ptr[r]`` (int32; < 0: not stored; else never
    read): the FP8 backward's dx into its rows' slots. SKIP_EMPTY_HALF: a tile of at most 64 rows runs one
    warpgroup's wgmmas (its bottom A half neither loaded nor multiplied; the same bits)."""
    W_SLICES: gl.constexpr = 2 if GATE_UP else 1
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK], gl.float8e4nv)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], gl.float8e4nv)
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * STAGES, HALF_M, BLOCK], a_layout)
    w_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, W_SLICES * BLOCK, BLOCK], w_layout)
    full, empty = ring_barriers(STAGES)
    gl.warp_specialize(
        [(_consumer, (a_scale_ptr, w_scale_ptr, out_ptr, act_q_ptr, act_scale_ptr, b_ptr, out_index_ptr, stride_as_in,
                      stride_ws_n, stride_out, stride_act, stride_as, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                      tile_run_ptr, num_tiles_ptr, N, K, limit, alpha, a_smem, w_smem, full, empty, gl.constexpr(0),
                      gl.constexpr(GATE_UP), gl.constexpr(ACT), gl.constexpr(STORE_H),
                      gl.constexpr(SOFT_E4M3), gl.constexpr(NUM_PROGRAMS), gl.constexpr(GROUP_M),
                      gl.constexpr(STAGES), gl.constexpr(HAS_BIAS), gl.constexpr(SCATTER),
                      gl.constexpr(SKIP_EMPTY_HALF))),
         (_consumer, (a_scale_ptr, w_scale_ptr, out_ptr, act_q_ptr, act_scale_ptr, b_ptr, out_index_ptr, stride_as_in,
                      stride_ws_n, stride_out, stride_act, stride_as, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                      tile_run_ptr, num_tiles_ptr, N, K, limit, alpha, a_smem, w_smem, full, empty, gl.constexpr(1),
                      gl.constexpr(GATE_UP), gl.constexpr(ACT), gl.constexpr(STORE_H),
                      gl.constexpr(SOFT_E4M3), gl.constexpr(NUM_PROGRAMS), gl.constexpr(GROUP_M),
                      gl.constexpr(STAGES), gl.constexpr(HAS_BIAS), gl.constexpr(SCATTER),
                      gl.constexpr(SKIP_EMPTY_HALF))),
         (forward_producer, (a_ptr, w_ptr, rows, w_rows, stride_a, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                             tile_run_ptr, num_tiles_ptr, N, K, a_smem, w_smem, full, empty, gl.constexpr(GATE_UP),
                             gl.constexpr(NUM_PROGRAMS), BLOCK, BLOCK, gl.constexpr(GROUP_M),
                             gl.constexpr(STAGES), a_ptr, gl.constexpr(False), gl.constexpr(SKIP_EMPTY_HALF)))],
        [4, 1], [REGS_CONSUMER, REGS_PRODUCER])
    invalidate_ring(full, empty, STAGES)
