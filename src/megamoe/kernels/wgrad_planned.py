"""The Gluon wgrad's blocks dealt by a plan (``wgrad_ws_kernel``'s PLANNED): the counter deal's order without its
counter. The deal (``megamoe.ops.experts_bwd.wgrad_deal``) lists the blocks heaviest expert first; its first half
are the heavy blocks, the rest the light ones. Program p runs heavy and light blocks in turn: heavy block
``t P + p`` in even rounds t and ``t P + P - 1 - p`` in odd ones (a snake, so the programs that took the heaviest
blocks of one round take the lightest heavy ones of the next), and the light blocks in the mirrored snake from the
lightest. Under skewed routing that spreads the hot experts' long blocks over the programs (qwen3-30b-a3b's zipf
loads at 16384 tokens, blocks costing their rows: the busiest program's share 1.02-1.05x the mean, against the
round-robin deal's 1.09-1.13x; ``tests/test_experts.py``) and runs write-bound light blocks beside compute-bound
heavy ones, as the counter deal does; but each program knows its blocks from the start, so no block waits on an
atomic's round trip and the consumers find their blocks themselves (no tag steps). Its limit: a block near a
program's mean share (a few experts, far hotter than the rest) still lands on a program that takes its share of
the others; the counter spares that program. A block is one program's, its rows reduced in one order: the static
deal's bits."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

from megamoe.kernels.wgrad_blocks import HALF_M, SPLIT_N, half_block, load_block, out_descriptor, site_descriptors
from megamoe.kernels.wgrad_carry import STORE
from megamoe.kernels.wgrad_dynamic import deal_entry, end_descriptors


@gluon.jit
def planned_rounds(total, NUM_PROGRAMS: gl.constexpr):
    """Rounds of the plan: each a heavy and a light block a program, as many as the heavy half needs."""
    return gl.cdiv((total + 1) // 2, NUM_PROGRAMS)


@gluon.jit
def planned_block(k, total, NUM_PROGRAMS: gl.constexpr):
    """PLANNED: this program's k-th block, ``(pos, ok)``: its place in the deal's order (:func:`deal_entry`), and
    whether the program has one there (the last round's snake leaves some programs without a heavy or a light
    block). Even k: heavy block ``t P + j`` (``j`` = p in even rounds t, ``P - 1 - p`` in odd ones) of the heavy
    half (the first ``(total + 1) // 2``); odd k: light block ``t P + P - 1 - j`` counted from the deal's end."""
    t = k // 2
    p = gl.program_id(0)
    j = p + (t % 2) * (NUM_PROGRAMS - 1 - 2 * p)
    heavy_blocks = (total + 1) // 2
    heavy = 1 - k % 2
    h = t * NUM_PROGRAMS + j
    light = t * NUM_PROGRAMS + (NUM_PROGRAMS - 1 - j)
    pos = heavy * h + (1 - heavy) * (total - 1 - light)
    ok = heavy * (heavy_blocks - h) + (1 - heavy) * (total - heavy_blocks - light) > 0
    return pos, ok


@gluon.jit
def planned_entry(deal_ptr, k, total, per_expert, NUM_PROGRAMS: gl.constexpr):
    """``(ok, expert, task, row0, row_end)`` of this program's k-th block (:func:`planned_block`,
    :func:`deal_entry`), its loads issued at once so that a loop can hold them a block ahead; where the program has
    no k-th block the loads read a block that exists (ok is False)."""
    pos, ok = planned_block(k, total, NUM_PROGRAMS)
    pos = gl.minimum(gl.maximum(pos, 0), gl.maximum(total - 1, 0))
    expert, task, row0, row_end = deal_entry(deal_ptr, pos, per_expert)
    return ok, expert, task, row0, row_end


@gluon.jit
def producer_planned(a_ptr, b_ptr, a_index_ptr, deal_ptr, OUT_M, OUT_N, a_smem, b_smem, full, empty,
                     NUM_PROGRAMS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                     A_GATHER: gl.constexpr):
    """PLANNED: the K steps of this program's blocks in the plan's order. The heavy and the light blocks have their
    descriptors at call sites of their own, remade only when that side's expert changes (a rewrite waits for the
    last load through its site to land, as ``_load_expert``'s)."""
    num_n = gl.cdiv(OUT_N, BLOCK_N)
    per_expert = gl.cdiv(OUT_M, 2 * HALF_M) * num_n
    total = gl.load(deal_ptr + 1)
    g = 0
    expert0 = -1
    expert1 = -1
    site_last0 = -1
    site_last1 = -1
    # both sites' descriptors exist from the start (over one row) so that the loop carries them
    a_desc0, b_desc0 = site_descriptors(a_ptr, b_ptr, 1, -1, g, full, OUT_M, OUT_N, BLOCK_N, BLOCK_K, STAGES)
    a_desc1, b_desc1 = site_descriptors(a_ptr, b_ptr, 1, -1, g, full, OUT_M, OUT_N, BLOCK_N, BLOCK_K, STAGES)
    # the producer loads each block's entry as it comes to it: the ring's lead over the consumers covers the round
    # trip (held a block ahead as the consumers do, the 40-register producer reserved a stack frame)
    for k in range(0, 2 * planned_rounds(total, NUM_PROGRAMS)):
        this_ok, this_expert, this_task, this_row0, this_row_end = planned_entry(deal_ptr, k, total, per_expert,
                                                                                 NUM_PROGRAMS)
        if this_ok:
            heavy = k % 2 == 0
            if heavy:
                expert0, a_desc0, b_desc0 = end_descriptors(a_ptr, b_ptr, this_expert, this_row_end, expert0,
                                                            a_desc0, b_desc0, site_last0, g, full, OUT_M, OUT_N,
                                                            BLOCK_N, BLOCK_K, STAGES)
                a_desc = a_desc0
                b_desc = b_desc0
            else:
                expert1, a_desc1, b_desc1 = end_descriptors(a_ptr, b_ptr, this_expert, this_row_end, expert1,
                                                            a_desc1, b_desc1, site_last1, g, full, OUT_M, OUT_N,
                                                            BLOCK_N, BLOCK_K, STAGES)
                a_desc = a_desc1
                b_desc = b_desc1
            g = load_block(a_ptr, a_desc, b_desc, a_index_ptr, this_row0, this_row_end,
                           this_task // num_n * (2 * HALF_M), this_task % num_n * BLOCK_N, OUT_M, a_smem, b_smem,
                           full, empty, g, BLOCK_N, BLOCK_K, STAGES, A_GATHER)
            if this_row_end > this_row0:
                if heavy:
                    site_last0 = g - 1
                else:
                    site_last1 = g - 1


@gluon.jit
def consumer_planned(out_ptr, deal_ptr, modes_ptr, carry_in_ptr, carry_out_ptr, num_experts, OUT_M, OUT_N, a_smem,
                     b_smem, c_smem, full, empty, HALF: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                     BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, MMA_IN_FLIGHT: gl.constexpr,
                     CARRY: gl.constexpr, GATHER: gl.constexpr, OUT_T: gl.constexpr, SPLIT_STORE: gl.constexpr):
    """PLANNED: rows HALF * 64 .. HALF * 64 + 63 of this program's blocks, in the plan's order (the producer's)."""
    num_n = gl.cdiv(OUT_N, BLOCK_N)
    per_expert = gl.cdiv(OUT_M, 2 * HALF_M) * num_n
    BOX_N: gl.constexpr = SPLIT_N if SPLIT_STORE else BLOCK_N
    out_desc = out_descriptor(out_ptr, num_experts, OUT_M, OUT_N, BOX_N, OUT_T)
    total = gl.load(deal_ptr + 1)
    g = 0
    ok, expert, task, row0, row_end = planned_entry(deal_ptr, 0, total, per_expert, NUM_PROGRAMS)
    for k in range(0, 2 * planned_rounds(total, NUM_PROGRAMS)):
        this_ok = ok
        this_expert = expert
        this_task = task
        this_row0 = row0
        this_row_end = row_end
        # the next block's entry, loaded under this block's wgmmas (the tensor cores wait on no load between blocks)
        ok, expert, task, row0, row_end = planned_entry(deal_ptr, k + 1, total, per_expert, NUM_PROGRAMS)
        if this_ok:
            if CARRY:
                mode = gl.load(modes_ptr + this_expert)
            else:
                mode = STORE
            g = half_block(out_desc, a_smem, b_smem, c_smem, full, empty, g, this_expert, mode, this_row0,
                           this_row_end, this_task // num_n * (2 * HALF_M), this_task % num_n * BLOCK_N, carry_in_ptr,
                           carry_out_ptr, OUT_M, OUT_N, HALF, BLOCK_N, BLOCK_K, STAGES, MMA_IN_FLIGHT, CARRY, GATHER,
                           OUT_T, SPLIT_STORE)
    tma.store_wait(pendings=0)
