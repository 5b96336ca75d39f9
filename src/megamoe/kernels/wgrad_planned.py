"""The Gluon wgrad's blocks dealt by a plan (``wgrad_ws_kernel``'s PLANNED): the counter deal's order without its
counter. The deal (``megamoe.ops.expert_wgrad.wgrad_deal``) lists the blocks heaviest expert first, each expert's in
task order; round k's P blocks (k P .. k P + P - 1) go one a program, program p taking the p-th of an even round
and the (P - 1 - p)-th of an odd one (a snake: the programs that took the heaviest blocks of one round take the
lightest of the next). Under skewed routing that spreads the hot experts' long blocks over the programs
(qwen3-30b-a3b's zipf loads at 16384 tokens, blocks costing their rows: the busiest program's share 1.02-1.05x the
mean, against the round-robin deal's 1.09-1.13x; ``tests/test_experts.py``), and each program knows its blocks
from the start: no block waits on an atomic's round trip and the consumers find their blocks themselves (no tag
steps). A round's blocks lie side by side in the order, as the static deal's do, so the programs share their
experts' rows in L2: the first plan, heavy and light blocks in turn a program from the order's two ends, kept two
regions of it hot and read qwen3-30b-a3b's uniform gate/up operands from DRAM 2.6x over (L2 hits 61 % against
83 %, 1.83 against 1.58 ms; benchmarks/results/2026-12-07-wgrad-planned). Its limit: a block near a program's mean
share (a few experts, far hotter than the rest) still lands on a program that takes its share of the others; the
counter spares that program. A block is one program's, its rows reduced in one order: the static deal's bits.
Its machinery and its order cost uniform loads ~8 %, so it deals only where the routing is skewed
(``megamoe.ops.expert_wgrad.WGRAD_PLAN_SKEW``; the static deal's launch beside it takes the rest)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

from megamoe.kernels.wgrad_blocks import (HALF_M, SPLIT_N, first_rows, half_block, load_block, out_descriptor,
                                          site_descriptors)
from megamoe.kernels.wgrad_carry import STORE
from megamoe.kernels.wgrad_dynamic import deal_entry, end_descriptors


@gluon.jit
def planned_rounds(total, NUM_PROGRAMS: gl.constexpr):
    """Rounds of the plan, a block a program each."""
    return gl.cdiv(total, NUM_PROGRAMS)


@gluon.jit
def planned_block(k, total, NUM_PROGRAMS: gl.constexpr):
    """PLANNED: this program's k-th block, ``(pos, ok)``: its place in the deal's order (:func:`deal_entry`) and
    whether the program has one there (the last round may leave some programs without a block): ``k P + p`` in even
    rounds, ``k P + P - 1 - p`` in odd ones."""
    p = gl.program_id(0)
    pos = k * NUM_PROGRAMS + p + (k % 2) * (NUM_PROGRAMS - 1 - 2 * p)
    return pos, pos < total


@gluon.jit
def planned_entry(deal_ptr, modes_ptr, k, total, per_expert, NUM_PROGRAMS: gl.constexpr, CARRY: gl.constexpr):
    """``(ok, expert, task, row0, row_end, mode)`` of this program's k-th block (:func:`planned_block`,
    :func:`deal_entry`; the window's mode with CARRY, else STORE), its loads issued at once so that a loop can hold
    them a block ahead; where the program has no k-th block the loads read a block that exists (ok is False)."""
    pos, ok = planned_block(k, total, NUM_PROGRAMS)
    pos = gl.minimum(gl.maximum(pos, 0), gl.maximum(total - 1, 0))
    expert, task, row0, row_end = deal_entry(deal_ptr, pos, per_expert)
    if CARRY:
        mode = gl.load(modes_ptr + expert)
    else:
        mode = STORE
    return ok, expert, task, row0, row_end, mode


@gluon.jit
def producer_planned(a_ptr, b_ptr, a_index_ptr, deal_ptr, OUT_M, OUT_N, a_smem, b_smem, full, empty,
                     NUM_PROGRAMS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                     A_GATHER: gl.constexpr):
    """PLANNED: the K steps of this program's blocks in the plan's order. Two call sites hold descriptors, the
    experts taking them in turn (a rewrite waits for the last load through its site to land, as
    ``_load_expert``'s: the expert before last's, landed unless that expert's last block was the one before)."""
    num_n = gl.cdiv(OUT_N, BLOCK_N)
    per_expert = gl.cdiv(OUT_M, 2 * HALF_M) * num_n
    total = gl.load(deal_ptr + 1)
    g = 0
    site = 1  # the call site of the last block's descriptors (the first block takes site 0)
    expert0 = -1
    expert1 = -1
    site_last0 = -1
    site_last1 = -1
    # both sites' descriptors exist from the start (over one row) so that the loop carries them
    a_desc0, b_desc0 = site_descriptors(a_ptr, b_ptr, 1, -1, g, full, OUT_M, OUT_N, BLOCK_N, BLOCK_K, STAGES)
    a_desc1, b_desc1 = site_descriptors(a_ptr, b_ptr, 1, -1, g, full, OUT_M, OUT_N, BLOCK_N, BLOCK_K, STAGES)
    # the chain before a block's first gather is its deal entry, then its first rows' indices: the entries are loaded
    # two blocks ahead and the indices a block ahead, so neither round trip stands between two blocks (loaded as
    # the producer came to the block, the chain outran the ring's lead: the plan's wgrads 1.10x the static deal's at
    # qwen3-30b-a3b uniform, 1.24x at deepseek-v3; 2026-12-07-wgrad-planned, call 22)
    ok, expert, task, row0, row_end, _ = planned_entry(deal_ptr, deal_ptr, 0, total, per_expert, NUM_PROGRAMS, False)
    later_ok, later_expert, later_task, later_row0, later_row_end, _ = planned_entry(deal_ptr, deal_ptr, 1, total,
                                                                                     per_expert, NUM_PROGRAMS, False)
    rows_now, rows_next = first_rows(a_index_ptr, row0, row_end, BLOCK_K, A_GATHER)
    for k in range(0, planned_rounds(total, NUM_PROGRAMS)):
        this_ok = ok
        this_expert = expert
        this_task = task
        this_row0 = row0
        this_row_end = row_end
        this_rows_now = rows_now
        this_rows_next = rows_next
        ok = later_ok
        expert = later_expert
        task = later_task
        row0 = later_row0
        row_end = later_row_end
        later_ok, later_expert, later_task, later_row0, later_row_end, _ = planned_entry(
            deal_ptr, deal_ptr, k + 2, total, per_expert, NUM_PROGRAMS, False)
        rows_now, rows_next = first_rows(a_index_ptr, row0, row_end, BLOCK_K, A_GATHER)
        if this_ok:
            # a new expert goes to the other site, so each expert's descriptors are made once, where the expert
            # before last was (on the block's parity the plan remade them twice an expert: two blocks in a row of
            # one expert took both sites)
            if site == 0:
                stay = this_expert == expert0
            else:
                stay = this_expert == expert1
            if not stay:
                site = 1 - site
            if site == 0:
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
            g = load_block(a_ptr, a_desc, b_desc, a_index_ptr, this_rows_now, this_rows_next, this_row0,
                           this_row_end, this_task // num_n * (2 * HALF_M), this_task % num_n * BLOCK_N, OUT_M, a_smem,
                           b_smem, full, empty, g, BLOCK_N, BLOCK_K, STAGES, A_GATHER)
            if this_row_end > this_row0:
                if site == 0:
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
    ok, expert, task, row0, row_end, mode = planned_entry(deal_ptr, modes_ptr, 0, total, per_expert, NUM_PROGRAMS,
                                                          CARRY)
    for k in range(0, planned_rounds(total, NUM_PROGRAMS)):
        this_ok = ok
        this_expert = expert
        this_task = task
        this_row0 = row0
        this_row_end = row_end
        this_mode = mode
        # the next block's entry and mode, loaded under this block's wgmmas (the tensor cores wait on no load
        # between blocks)
        ok, expert, task, row0, row_end, mode = planned_entry(deal_ptr, modes_ptr, k + 1, total, per_expert,
                                                              NUM_PROGRAMS, CARRY)
        if this_ok:
            g = half_block(out_desc, a_smem, b_smem, c_smem, full, empty, g, this_expert, this_mode, this_row0,
                           this_row_end, this_task // num_n * (2 * HALF_M), this_task % num_n * BLOCK_N, carry_in_ptr,
                           carry_out_ptr, OUT_M, OUT_N, HALF, BLOCK_N, BLOCK_K, STAGES, MMA_IN_FLIGHT, CARRY, GATHER,
                           OUT_T, SPLIT_STORE)
    tma.store_wait(pendings=0)
