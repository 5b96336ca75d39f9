"""The FP8-block expert tiles warp-specialised in Gluon, against the Triton plan (issue 28's FP8 promotion lever).

    PYTHONPATH=src python3 benchmarks/fp8_ws_probe.py [--kind gate_up|down] [--experts 192] [--rounds 5]
        [--variants plan,s3,...] [--out DIR]

The Triton kernels (``gate_up_fp8_kernel`` / ``down_fp8_kernel``: 8 warps, two warpgroups of 64 rows) wait for
each 128-K step's products and promote them (``acc += p * (a_scale ⊗ w_scale)``) with the tensor cores idle, both
warpgroups at once (their TMA issues are CTA barriers); gate/up's sm_90 build spills (255 registers, 136 bytes of
stack). Here a TMA producer warp fills a ring of [rows 128 x 128 | weights 128 (gate/up: gate and up, 256) x 128]
fp8 slots and two consumer warpgroups (rows 0-63 / 64-127 of each tile), tied by mbarriers only, each run a K
step's product and promote it (gate/up: the gate product, then the up product), so one warpgroup's promotion can
run under the other's wgmmas; the scales are loaded a step ahead. Down's ``*-pairs`` variants also overlap within
a warpgroup: two K steps' products issued, the first promoted while the second's wgmmas run. The epilogues are
the Triton kernels': gate/up h (bf16), SwiGLU, act quantised 1 x 128 (act_q, act_scale); down y (bf16).

Gate/up cannot pair K steps at 128 act columns (two 64 x 128 fp32 accumulators and two products in flight: 256
registers of a consumer's 232), so its ``halves-*`` variants run a task's act columns as two halves of 64, a K loop
each: a slot holds x and 128 weight rows (the half's 64 gate rows, then its 64 up rows), one m64n128k32 wgmma chain
per step gives gate and up at once, and steps are paired as in down (accumulators 2 x 32 + products 2 x 64
registers). Half 0's act waits in shared memory (fp32) until half 1's, then the [64, 128] act is quantised as
above. Same tasks, order and bits; x crosses the ring twice per task.

Outputs are compared bit for bit with ``experts_fp8.gate_up_fp8`` / ``down_fp8`` (the plan; down runs on the
plan's act); timed in interleaved rounds at the power cap with ``torch._scaled_mm`` (row / column scales) on all
rows at once (same N and K). GPU only (Hopper). Writes DIR/fp8_ws_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from megamoe.bench.experts import fp8_block_operands, make_load
from megamoe.config import preset
from megamoe.kernels.expert_gemm import swiglu_tile
from megamoe.kernels.forward_warp_specialized import tile_task
from megamoe.kernels.quant import fp8_block_quantize_tile
from megamoe.ops.experts import ExpertForwardQuantized
from megamoe.ops.experts_fp8 import down_fp8, gate_up_fp8
from megamoe.ops.launch import flat_row_stride, scratch_allocator
from megamoe.routing.row_tiles import build_row_tiles
from megamoe.runtime import num_programs

from sustained import interleaved_rounds  # benchmarks/, beside this script

HALF = gl.constexpr(64)
BLOCK = gl.constexpr(128)  # K step, act columns per tile, scale block


@gluon.jit
def _producer(x_ptr, w_ptr, rows, w_rows, stride_x, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr,
              num_tiles_ptr, N, K, a_smem, w_smem, full, empty, GATE_UP: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr, HALVES: gl.constexpr):
    """The ring's K steps, task by task. HALVES: each task's K steps twice, column half j's weight slice in a slot
    (gate rows n0 + 64j .. + 63, then up rows N + n0 + 64j ..)."""
    W_SLICES: gl.constexpr = 2 if GATE_UP else 1
    W_ROWS: gl.constexpr = HALF if HALVES else BLOCK  # weight rows of one slice
    PASSES: gl.constexpr = 2 if HALVES else 1  # K loops per task
    a_desc = tma.make_tensor_descriptor(x_ptr, [rows, K], [stride_x, 1], [HALF, BLOCK],
                                        gl.NVMMASharedLayout.get_default_for([HALF, BLOCK], gl.float8e4nv))
    w_desc = tma.make_tensor_descriptor(w_ptr, [w_rows, K], [K, 1], [W_ROWS, BLOCK],
                                        gl.NVMMASharedLayout.get_default_for([W_ROWS, BLOCK], gl.float8e4nv))
    step_bytes: gl.constexpr = (BLOCK + W_SLICES * W_ROWS) * BLOCK  # x 128 rows, then weight rows, of 128 bytes
    num_n = gl.cdiv(N, BLOCK)
    num_tasks = gl.load(num_tiles_ptr) * num_n
    g = 0
    for task in range(gl.program_id(0), num_tasks, NUM_PROGRAMS):
        expert, row0, row_end, n = tile_task(task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                                             tile_run_ptr, GROUP_M)
        for j in gl.static_range(PASSES):
            w_row = expert * W_SLICES * N + n * BLOCK + j * W_ROWS
            for k in range(0, K, BLOCK):
                s = g % STAGES
                mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
                mbarrier.expect(full.index(s), step_bytes)
                a = a_smem.index(s)
                tma.async_copy_global_to_shared(a_desc, [row0, k], full.index(s), a.slice(0, HALF))
                tma.async_copy_global_to_shared(a_desc, [row0 + HALF, k], full.index(s), a.slice(HALF, HALF))
                w = w_smem.index(s)
                tma.async_copy_global_to_shared(w_desc, [w_row, k], full.index(s), w.slice(0, W_ROWS))
                if GATE_UP:
                    tma.async_copy_global_to_shared(w_desc, [w_row + N, k], full.index(s), w.slice(W_ROWS, W_ROWS))
                g += 1


@gluon.jit
def _store(ptr, stride, values, rows, row_ok, col0, cols_ok, layout: gl.constexpr):
    """Masked store of a [64, C] tile (already in its stored dtype) at rows ``rows`` (int64, the tile's 64) and
    columns col0.., through ``layout`` (16-byte row runs)."""
    tile = gl.convert_layout(values, layout)
    r = gl.convert_layout(rows, gl.SliceLayout(1, layout))
    ok = gl.convert_layout(row_ok, gl.SliceLayout(1, layout))
    c = gl.arange(0, values.shape[1], layout=gl.SliceLayout(0, layout))
    gl.store(ptr + (r[:, None] * stride + col0 + c[None, :]), tile, mask=ok[:, None] & (c < cols_ok)[None, :])


@gluon.jit
def _gate_and_up(p):
    """A halves product [64, 128] -> its gate columns 0-63 and up columns 64-127, [64, 64] each: each thread's own
    registers (no data moves)."""
    return gl.split(gl.permute(gl.reshape(p, (HALF, 2, HALF)), (0, 2, 1)))


@gluon.jit
def _halves_product(a_smem, w_smem, slot, WARPGROUP: gl.constexpr, mma: gl.constexpr):
    """Issue one step's [64 x 128] product of this warpgroup's rows and the slot's 128 weight rows (gate, up)."""
    return warpgroup_mma(a_smem.index(slot).slice(WARPGROUP * HALF, HALF), w_smem.index(slot).permute((1, 0)),
                         gl.zeros((HALF, BLOCK), gl.float32, mma), use_acc=False, is_async=True)


@gluon.jit
def _halves_promote(acc_gate, acc_up, p, a_s, s_gate, s_up):
    """The plan's promotion of one K step, per column half: ``acc += p * (a_scale * w_scale)`` with one scalar per
    row (the gate block's weight scale for gate columns, the up block's for up columns)."""
    gate, up = _gate_and_up(p)
    return acc_gate + gate * (a_s[:, None] * s_gate), acc_up + up * (a_s[:, None] * s_up)


@gluon.jit
def _halves_k_loop(xs_rows, row_ok, ws_gate, ws_up, K, g, a_smem, w_smem, full, empty, WARPGROUP: gl.constexpr,
                   STAGES: gl.constexpr, mma: gl.constexpr):
    """One column half's K loop from ring step ``g``, in pairs of K steps (step k+1's wgmmas run while step k is
    promoted), then a single step if K / 128 is odd: (acc_gate, acc_up [64, 64] fp32, the next step)."""
    gl.static_assert(STAGES >= 2, "pairs of K steps hold two ring slots")
    acc_gate, acc_up = _gate_and_up(gl.zeros((HALF, BLOCK), gl.float32, mma))
    for k in range(0, K - BLOCK, 2 * BLOCK):  # while two steps remain
        kb = k // BLOCK
        a_s0 = gl.load(xs_rows + kb, mask=row_ok, other=0.0)
        a_s1 = gl.load(xs_rows + kb + 1, mask=row_ok, other=0.0)
        sg0 = gl.load(ws_gate + kb)
        su0 = gl.load(ws_up + kb)
        sg1 = gl.load(ws_gate + kb + 1)
        su1 = gl.load(ws_up + kb + 1)
        s0 = g % STAGES
        s1 = (g + 1) % STAGES
        mbarrier.wait(full.index(s0), (g // STAGES) & 1)
        pa = _halves_product(a_smem, w_smem, s0, WARPGROUP, mma)
        mbarrier.wait(full.index(s1), ((g + 1) // STAGES) & 1)
        pb = _halves_product(a_smem, w_smem, s1, WARPGROUP, mma)
        pa = warpgroup_mma_wait(num_outstanding=1, deps=(pa,))
        mbarrier.arrive(empty.index(s0), count=1)
        acc_gate, acc_up = _halves_promote(acc_gate, acc_up, pa, a_s0, sg0, su0)
        pb = warpgroup_mma_wait(num_outstanding=0, deps=(pb,))
        mbarrier.arrive(empty.index(s1), count=1)
        acc_gate, acc_up = _halves_promote(acc_gate, acc_up, pb, a_s1, sg1, su1)
        g += 2
    if (K // BLOCK) % 2 == 1:  # the last step alone
        kb = K // BLOCK - 1
        a_s = gl.load(xs_rows + kb, mask=row_ok, other=0.0)
        sg = gl.load(ws_gate + kb)
        su = gl.load(ws_up + kb)
        s = g % STAGES
        mbarrier.wait(full.index(s), (g // STAGES) & 1)
        p = warpgroup_mma_wait(num_outstanding=0, deps=(_halves_product(a_smem, w_smem, s, WARPGROUP, mma),))
        mbarrier.arrive(empty.index(s), count=1)
        acc_gate, acc_up = _halves_promote(acc_gate, acc_up, p, a_s, sg, su)
        g += 1
    return acc_gate, acc_up, g


@gluon.jit
def _gate_up_halves(x_scale_ptr, stride_xs, first, row_end, ws_gate, ws_up, n0, N, K, g, limit, h_ptr, act_q_ptr,
                    act_scale_ptr, stride_h, stride_act, stride_as, a_smem, w_smem, full, empty, act_stash,
                    WARPGROUP: gl.constexpr, HAS_LIMIT: gl.constexpr, STORE_H: gl.constexpr, STAGES: gl.constexpr,
                    mma: gl.constexpr):
    """One gate/up task by column halves (64 act columns each, a K loop each) for rows first .. first + 63: h and
    act of each half, act quantised 1 x 128 over both. Half 0's act waits in ``act_stash`` (this warpgroup's
    [64, 64] fp32: in registers it spills under half 1's K loop); each thread reads back what it wrote. Returns the
    next ring step."""
    runs16: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # bf16 [64, 64]: 8 per thread
    runs8: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])  # fp8 [64, 128]: 16 per thread
    half_layout: gl.constexpr = _gate_and_up(gl.zeros((HALF, BLOCK), gl.float32, mma))[0].type.layout
    rows = first + gl.arange(0, HALF, layout=gl.SliceLayout(1, half_layout))
    row_ok = rows < row_end
    rows64 = rows.to(gl.int64)
    xs_rows = x_scale_ptr + rows64 * stride_xs
    act = gl.zeros((HALF, HALF), gl.float32, half_layout)  # after the loop: half 1's
    # A loop, not static_range: unrolled, half 1's stores reuse half 0's masks, kept live (spilled) across its K loop
    for j in range(2):
        acc_gate, acc_up, g = _halves_k_loop(xs_rows, row_ok, ws_gate, ws_up, K, g, a_smem, w_smem, full, empty,
                                             WARPGROUP, STAGES, mma)
        col0 = n0 + j * HALF
        if STORE_H:
            _store(h_ptr, stride_h, acc_gate.to(gl.bfloat16), rows64, row_ok, col0, N - col0, runs16)
            _store(h_ptr, stride_h, acc_up.to(gl.bfloat16), rows64, row_ok, N + col0, N - col0, runs16)
        act = swiglu_tile(acc_gate, acc_up, limit, HAS_LIMIT)
        if j == 0:
            act_stash.store(act)
    # [64, 128], columns 0-63 half 0's: the mma layout again, so the quantisation is the other variants'
    act = gl.join(act_stash.load(half_layout), act)
    act = gl.convert_layout(gl.reshape(gl.permute(act, (0, 2, 1)), (HALF, BLOCK)), mma, assert_trivial=True)
    act_q, act_s = fp8_block_quantize_tile(act, 1, 128, False)  # [64, 128], [64, 1]
    _store(act_q_ptr, stride_act, act_q.to(gl.uint8, bitcast=True), rows64, row_ok, n0, N - n0, runs8)
    rows64 = gl.convert_layout(rows64, gl.SliceLayout(1, mma), assert_trivial=True)
    row_ok = gl.convert_layout(row_ok, gl.SliceLayout(1, mma), assert_trivial=True)
    gl.store(act_scale_ptr + rows64[:, None] * stride_as + n0 // 128, act_s, mask=row_ok[:, None])
    return g


@gluon.jit
def _consumer(x_scale_ptr, w_scale_ptr, h_ptr, act_q_ptr, act_scale_ptr, stride_xs, stride_ws_n, stride_h,
              stride_act, stride_as, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr,
              N, K, limit, a_smem, w_smem, full, empty, act_stash, WARPGROUP: gl.constexpr, GATE_UP: gl.constexpr,
              HAS_LIMIT: gl.constexpr,
              STORE_H: gl.constexpr, NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
              PREFETCH: gl.constexpr, PAIRS: gl.constexpr, HALVES: gl.constexpr):
    gl.static_assert(not (PAIRS and GATE_UP), "pairs of K steps: down only (gate/up: HALVES)")
    gl.static_assert(GATE_UP or not HALVES, "column halves: gate/up only")
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 32])
    runs16: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # bf16: 8 per thread
    runs8: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])  # fp8: 16 per thread
    W_SLICES: gl.constexpr = 2 if GATE_UP else 1
    num_n = gl.cdiv(N, BLOCK)
    num_tasks = gl.load(num_tiles_ptr) * num_n
    g = 0
    for task in range(gl.program_id(0), num_tasks, NUM_PROGRAMS):
        expert, row0, row_end, n = tile_task(task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                                             tile_run_ptr, GROUP_M)
        n0 = n * BLOCK
        rows = row0 + WARPGROUP * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, mma))
        row_ok = rows < row_end
        xs_rows = x_scale_ptr + rows.to(gl.int64) * stride_xs
        ws_base = w_scale_ptr + expert.to(gl.int64) * (W_SLICES * N // 128) * stride_ws_n
        acc_gate = gl.zeros((HALF, BLOCK), gl.float32, mma)
        acc_up = gl.zeros((HALF, BLOCK), gl.float32, mma)
        ws_gate = ws_base + (n0 // 128) * stride_ws_n
        ws_up = ws_base + ((N + n0) // 128) * stride_ws_n  # gate/up only
        if HALVES:  # its own K loops and epilogue
            g = _gate_up_halves(x_scale_ptr, stride_xs, row0 + WARPGROUP * HALF, row_end, ws_gate, ws_up, n0, N, K, g,
                                limit, h_ptr, act_q_ptr, act_scale_ptr, stride_h, stride_act, stride_as, a_smem,
                                w_smem, full, empty, act_stash.index(WARPGROUP), WARPGROUP, HAS_LIMIT, STORE_H,
                                STAGES, mma)
        elif PAIRS:  # down, K a multiple of 256: step 2j's promotion runs under step 2j+1's wgmmas
            for k in range(0, K, 2 * BLOCK):
                kb = k // BLOCK
                a_s0 = gl.load(xs_rows + kb, mask=row_ok, other=0.0)
                a_s1 = gl.load(xs_rows + kb + 1, mask=row_ok, other=0.0)
                s0_w = gl.load(ws_gate + kb)
                s1_w = gl.load(ws_gate + kb + 1)
                s0 = g % STAGES
                s1 = (g + 1) % STAGES
                mbarrier.wait(full.index(s0), (g // STAGES) & 1)
                pa = warpgroup_mma(a_smem.index(s0).slice(WARPGROUP * HALF, HALF), w_smem.index(s0).permute((1, 0)),
                                   gl.zeros((HALF, BLOCK), gl.float32, mma), use_acc=False, is_async=True)
                mbarrier.wait(full.index(s1), ((g + 1) // STAGES) & 1)
                pb = warpgroup_mma(a_smem.index(s1).slice(WARPGROUP * HALF, HALF), w_smem.index(s1).permute((1, 0)),
                                   gl.zeros((HALF, BLOCK), gl.float32, mma), use_acc=False, is_async=True)
                pa = warpgroup_mma_wait(num_outstanding=1, deps=(pa,))
                mbarrier.arrive(empty.index(s0), count=1)
                acc_gate += pa * (a_s0[:, None] * s0_w)
                pb = warpgroup_mma_wait(num_outstanding=0, deps=(pb,))
                mbarrier.arrive(empty.index(s1), count=1)
                acc_gate += pb * (a_s1[:, None] * s1_w)
                g += 2
        else:
            a_s = gl.load(xs_rows, mask=row_ok & (K > 0), other=0.0)  # K block 0's scales
            sg = gl.load(ws_gate, mask=K > 0, other=0.0)
            su = sg  # down: unused
            if GATE_UP:
                su = gl.load(ws_up, mask=K > 0, other=0.0)
            for k in range(0, K, BLOCK):
                kb = k // BLOCK
                if PREFETCH:  # the next K block's scales, a step ahead (their latency under this step's wgmmas)
                    more = k + BLOCK < K
                    a_s_next = gl.load(xs_rows + kb + 1, mask=row_ok & more, other=0.0)
                    sg_next = gl.load(ws_gate + kb + 1, mask=more, other=0.0)
                    su_next = sg_next
                    if GATE_UP:
                        su_next = gl.load(ws_up + kb + 1, mask=more, other=0.0)
                else:
                    a_s = gl.load(xs_rows + kb, mask=row_ok, other=0.0)
                    sg = gl.load(ws_gate + kb)
                    if GATE_UP:
                        su = gl.load(ws_up + kb)
                s = g % STAGES
                mbarrier.wait(full.index(s), (g // STAGES) & 1)
                a = a_smem.index(s).slice(WARPGROUP * HALF, HALF)
                w = w_smem.index(s)
                p = warpgroup_mma(a, w.slice(0, BLOCK).permute((1, 0)), gl.zeros((HALF, BLOCK), gl.float32, mma),
                                  use_acc=False, is_async=True)
                p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
                if GATE_UP:
                    acc_gate += p * (a_s[:, None] * sg)
                    p = warpgroup_mma(a, w.slice(BLOCK, BLOCK).permute((1, 0)),
                                      gl.zeros((HALF, BLOCK), gl.float32, mma), use_acc=False, is_async=True)
                    p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
                    mbarrier.arrive(empty.index(s), count=1)
                    acc_up += p * (a_s[:, None] * su)
                else:
                    mbarrier.arrive(empty.index(s), count=1)
                    acc_gate += p * (a_s[:, None] * sg)
                if PREFETCH:
                    a_s, sg, su = a_s_next, sg_next, su_next
                g += 1
        rows64 = rows.to(gl.int64)
        if not GATE_UP:  # down: h_ptr is y
            _store(h_ptr, stride_h, acc_gate.to(gl.bfloat16), rows64, row_ok, n0, N - n0, runs16)
        elif not HALVES:  # (halves: stored by _gate_up_halves)
            if STORE_H:
                _store(h_ptr, stride_h, acc_gate.to(gl.bfloat16), rows64, row_ok, n0, N - n0, runs16)
                _store(h_ptr, stride_h, acc_up.to(gl.bfloat16), rows64, row_ok, N + n0, N - n0, runs16)
            act = swiglu_tile(acc_gate, acc_up, limit, HAS_LIMIT)
            act_q, act_s = fp8_block_quantize_tile(act, 1, 128, False)  # [64, 128], [64, 1]
            _store(act_q_ptr, stride_act, act_q.to(gl.uint8, bitcast=True), rows64, row_ok, n0, N - n0, runs8)
            s_ptrs = act_scale_ptr + rows64[:, None] * stride_as + n0 // 128
            gl.store(s_ptrs, act_s, mask=row_ok[:, None])


@gluon.jit
def fp8_ws_kernel(x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, h_ptr, act_q_ptr, act_scale_ptr,
                  stride_x, stride_xs, stride_ws_n, stride_h, stride_act, stride_as,
                  tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr,
                  rows, w_rows, N, K, limit, GATE_UP: gl.constexpr, HAS_LIMIT: gl.constexpr, STORE_H: gl.constexpr,
                  NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, PREFETCH: gl.constexpr,
                  PAIRS: gl.constexpr = False, HALVES: gl.constexpr = False):
    """``gate_up_fp8_kernel``'s (GATE_UP: N = I, h_ptr h) or ``down_fp8_kernel``'s (N = D, h_ptr y; the act
    pointers unused) contract and 128 x 128 tiles, warp-specialised. PAIRS (down) or HALVES (gate/up, by 64-column
    halves): two K steps' products in flight per warpgroup."""
    W_SLICES: gl.constexpr = 2 if GATE_UP else 1
    W_ROWS: gl.constexpr = HALF if HALVES else BLOCK  # weight rows of one slice
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 2 * HALF, BLOCK],
                                       gl.NVMMASharedLayout.get_default_for([HALF, BLOCK], gl.float8e4nv))
    w_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, W_SLICES * W_ROWS, BLOCK],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], gl.float8e4nv))
    if HALVES:  # column half 0's act, [64, 64] fp32 per consumer warpgroup; rows padded by 32 bytes: no bank conflicts
        padded: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[HALF, 8]], [HALF, HALF], [1, 0])
        act_stash = gl.allocate_shared_memory(gl.float32, [2, HALF, HALF], padded)
    else:  # unused
        act_stash = gl.allocate_shared_memory(gl.float32, [2, 1, 1], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    gl.warp_specialize(
        [(_consumer, (x_scale_ptr, w_scale_ptr, h_ptr, act_q_ptr, act_scale_ptr, stride_xs, stride_ws_n, stride_h,
                      stride_act, stride_as, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr,
                      num_tiles_ptr, N, K, limit, a_smem, w_smem, full, empty, act_stash, gl.constexpr(0),
                      gl.constexpr(GATE_UP), gl.constexpr(HAS_LIMIT), gl.constexpr(STORE_H),
                      gl.constexpr(NUM_PROGRAMS), gl.constexpr(GROUP_M), gl.constexpr(STAGES),
                      gl.constexpr(PREFETCH), gl.constexpr(PAIRS), gl.constexpr(HALVES))),
         (_consumer, (x_scale_ptr, w_scale_ptr, h_ptr, act_q_ptr, act_scale_ptr, stride_xs, stride_ws_n, stride_h,
                      stride_act, stride_as, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr,
                      num_tiles_ptr, N, K, limit, a_smem, w_smem, full, empty, act_stash, gl.constexpr(1),
                      gl.constexpr(GATE_UP), gl.constexpr(HAS_LIMIT), gl.constexpr(STORE_H),
                      gl.constexpr(NUM_PROGRAMS), gl.constexpr(GROUP_M), gl.constexpr(STAGES),
                      gl.constexpr(PREFETCH), gl.constexpr(PAIRS), gl.constexpr(HALVES))),
         (_producer, (x_ptr, w_ptr, rows, w_rows, stride_x, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                      tile_run_ptr, num_tiles_ptr, N, K, a_smem, w_smem, full, empty, gl.constexpr(GATE_UP),
                      gl.constexpr(NUM_PROGRAMS), gl.constexpr(GROUP_M), gl.constexpr(STAGES),
                      gl.constexpr(HALVES)))],
        [4, 1], [232, 40])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(full.index(s))
        mbarrier.invalidate(empty.index(s))


#: name -> (ring stages, scales loaded a K step ahead, pairs of K steps, column halves)
VARIANTS = {"s3": (3, True), "s4": (4, True), "s2": (2, True), "s3-late": (3, False), "s6": (6, True),  # s6: down
            "s4-pairs": (4, False, True), "s6-pairs": (6, False, True),  # down, K % 256 == 0: pairs of K steps
            "halves-s3": (3, False, False, True), "halves-s4": (4, False, False, True),  # gate/up by column halves
            "halves-s5": (5, False, False, True)}  # s6: over 227 KB of shared memory with the act stash


def constexprs(programs: int, stages: int, prefetch: bool, pairs: bool = False, halves: bool = False, *,
               gate_up: bool = True, has_limit: bool = False, store_h: bool = True) -> dict:
    """The plans' GROUP_M: 4 for gate/up, 8 for down (``experts_fp8.plan_tiles_fp8``)."""
    return dict(GATE_UP=gate_up, HAS_LIMIT=has_limit, STORE_H=store_h, NUM_PROGRAMS=programs,
                GROUP_M=4 if gate_up else 8, STAGES=stages, PREFETCH=prefetch, PAIRS=pairs, HALVES=halves)


def launch(a_q, a_s, counts, offsets, w_q, w_s, out: ExpertForwardQuantized, programs: int, gate_up: bool,
           stages: int, prefetch: bool, pairs: bool = False, halves: bool = False) -> None:
    """gate/up: a = x, w = w_gate_up (out.h, act_q, act_scale); down: a = act_q, w = w_down (out.y)."""
    experts, w_n, k = w_q.shape
    if pairs and (gate_up or k % 256):
        raise ValueError("pairs of K steps: down with K a multiple of 256 only")
    if halves and not gate_up:
        raise ValueError("column halves: gate/up only")
    rows = a_q.shape[0]
    tiles = build_row_tiles(counts.to(torch.int32), offsets.to(torch.int32), rows, 128)
    first = out.h if gate_up else out.y
    with scratch_allocator():
        fp8_ws_kernel[(programs,)](
            a_q, w_q, a_s, w_s, first, out.act_q.view(torch.uint8), out.act_scale,
            a_q.stride(0), a_s.stride(0), flat_row_stride(w_s), first.stride(0), out.act_q.stride(0),
            out.act_scale.stride(0), tiles.tile_expert, tiles.tile_row0, tiles.tile_row_end, tiles.tile_run,
            tiles.num_tiles, rows, experts * w_n, w_n // 2 if gate_up else w_n, k, 0.0, num_warps=4,
            **constexprs(programs, stages, prefetch, pairs, halves, gate_up=gate_up))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=192)
    parser.add_argument("--kind", choices=("gate_up", "down"), default="gate_up")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--variants", default="plan," + ",".join(VARIANTS))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    cfg, dev = preset(a.preset), torch.device("cuda")
    d, i = cfg.hidden, cfg.intermediate
    x, counts, offsets, wgu, wd = make_load(a.experts, a.tokens * cfg.top_k, d, i, dev)
    rows = x.shape[0]
    q = fp8_block_operands(x, counts, offsets, wgu, wd)  # the plan's gate/up outputs: down's inputs
    del x, wgu, wd
    programs = num_programs(dev)
    gate_up = a.kind == "gate_up"
    plan_out = q.fwd
    out = ExpertForwardQuantized(torch.empty_like(plan_out.h), torch.empty_like(plan_out.act_q),
                                 torch.empty_like(plan_out.act_scale), torch.empty_like(plan_out.y))
    if gate_up:
        a_q, a_s, w_q, w_s, n, k = q.x_q, q.x_s, q.wgu_q, q.wgu_s, 2 * i, d
        fields = ("h", "act_q", "act_scale")
        plan = lambda: gate_up_fp8(q.x_q, q.x_s, counts, offsets, q.wgu_q, q.wgu_s, plan_out)  # noqa: E731
    else:
        a_q, a_s, w_q, w_s, n, k = plan_out.act_q, plan_out.act_scale, q.wd_q, q.wd_s, d, i
        fields = ("y",)
        plan = lambda: down_fp8(a_q, a_s, counts, offsets, w_q, w_s, plan_out.y)  # noqa: E731
    calls, status = {"plan": plan}, {"plan": f"{a.kind}_fp8 (Triton)"}
    plan()
    torch.cuda.synchronize()
    for name in a.variants.split(","):
        if name == "plan":
            continue
        call = lambda v=VARIANTS[name]: launch(a_q, a_s, counts, offsets, w_q, w_s, out, programs,  # noqa: E731
                                               gate_up, *v)
        for f in fields:
            getattr(out, f).view(torch.uint8).fill_(0x7F) if f == "act_q" else getattr(out, f).fill_(float("nan"))
        try:
            call()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 -- a compile error or shared memory: reported, not timed
            status[name] = f"failed: {type(e).__name__}: {str(e)[:300]}"
            continue
        bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
        same = {f: torch.equal(bits(getattr(out, f)), bits(getattr(plan_out, f))) for f in fields}
        status[name] = "same bits" if all(same.values()) else "DIFFERENT bits: " + ", ".join(
            f for f, ok in same.items() if not ok)
        calls[name] = call
    b = w_q[0].T  # [K, N] column-major, as cuBLAS takes B
    r, c = torch.rand(rows, 1, device=dev) + 0.5, torch.rand(1, n, device=dev) + 0.5
    calls["dense"] = lambda: torch._scaled_mm(a_q, b, r, c, out_dtype=torch.bfloat16)
    status["dense"] = "torch._scaled_mm, row / column scales"
    times = interleaved_rounds(calls, a.rounds, a.seconds)
    flops = 2 * rows * n * k
    dense_ms = statistics.median(times["dense"])
    records, lines = [], []
    for name, st in status.items():
        ts = times.get(name)
        ms = statistics.median(ts) if ts else None
        records.append({"experts": a.experts, "rows": rows, "kind": a.kind, "variant": name, "ms": ms,
                        "ms_rounds": ts, "status": st, "stages_prefetch": VARIANTS.get(name)})
        lines.append(f"| {a.experts} x {rows // a.experts} | {name} | " + (
            f"{ms:.3f} | {flops / ms / 1e9:.0f} | {100 * dense_ms / ms:.0f} % |" if ms else "— | | |") + f" {st} |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fp8_ws_probe.json"), "w") as f:
        json.dump({"args": vars(a), "records": records}, f, indent=1)
    print(f"{a.preset} fp8-block {a.kind}, {a.rounds} interleaved rounds of {a.seconds} s")
    print("| load | variant | ms | TFLOP/s | % of dense | result |")
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
