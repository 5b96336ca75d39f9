"""The Gluon wgrad's blocks dealt dynamically (``wgrad_ws_kernel``'s DYNAMIC): the producer warp takes each block
with one atomic add on the launch's counter and names it to the two consumer warpgroups in a tag step of the ring
(a slot with no data, the block's coordinates in shared memory; expert -1 ends). The counter's blocks come heaviest
expert first from one end and lightest first from the other (``megamoe.ops.expert_wgrad.wgrad_deal``), so the
heaviest blocks start first and write-bound light blocks run beside compute-bound heavy ones. A block is one
program's, its rows reduced in one order: the static deal's bits. Its first build (the block's number alone in the
tag, the consumers loading its expert, rows and mode between blocks) cost ~1.5 us a block on one H100
(benchmarks/results/2026-12-06-dynamic-wgrad), and still did with the coordinates in the tag and a descriptor site
per deal end (benchmarks/results/2026-12-06-deal-rebuilt): between blocks the producer took a block (an ``acq_rel``
atomic whose result reached the warp through shared memory at once), then loaded its expert, then its rows. Now the
take is a relaxed add read where it is used, issued before the current block's last STAGES loads, and the take's
coordinates come from the deal in loads that depend on it alone. Held a whole block ahead instead, the takes cost
uniform loads far less but kept hot blocks from programs that came free (that folder's call 9)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from megamoe.kernels.gluon_gather import GATHER_WARPS, full_arrivals
from megamoe.kernels.wgrad_blocks import HALF_M, first_rows, half_block, load_block, out_descriptor, site_descriptors
from megamoe.kernels.wgrad_carry import STORE


DEAL_FIELDS = gl.constexpr(4)  # a dealt expert's int32s in ``deal``: expert, row0, row_end, unused (16 bytes)


@gluon.jit
def deal_entry(deal_ptr, pos, per_expert):
    """Block ``pos`` of the deal's order (experts heaviest first, each one's blocks in task order): ``(expert, task,
    row0, row_end)``, three loads that depend on ``pos`` alone. ``deal`` int32 `[2 + 4 L]`: the counter, the blocks
    to deal and, experts heaviest first, each one's number and rows (``megamoe.ops.expert_wgrad.wgrad_deal``)."""
    at = deal_ptr + 2 + DEAL_FIELDS * (pos // per_expert)
    return gl.load(at), pos % per_expert, gl.load(at + 1), gl.load(at + 2)


@gluon.jit
def dealt_block(deal_ptr, total, t, per_expert):
    """DYNAMIC: the t-th block taken from the launch's counter (:func:`deal_entry`'s fields): even takes walk the
    blocks from the heaviest expert, odd ones from the lightest (write-bound light blocks beside compute-bound heavy
    ones, the heaviest started first). A take past the end (each program's last) reads the last block's
    coordinates, never loaded."""
    t = gl.maximum(gl.minimum(t, total - 1), 0)
    half = t // 2
    return deal_entry(deal_ptr, half + (t % 2) * (total - 1 - 2 * half), per_expert)


@gluon.jit
def take(deal_ptr, WARPS: gl.constexpr):
    """One take from the launch's counter, as a tensor over the partition's lanes (lane 0's add, zeros elsewhere):
    a scalar atomic reaches the warp through shared memory at once, stalling on the round trip; this one is waited
    for only where :func:`taken` reads it. Relaxed: the counter orders nothing (an earlier launch wrote the deal)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    lane = gl.arange(0, 32 * WARPS, layout=layout)
    return gl.atomic_add(deal_ptr + lane * 0, gl.full([32 * WARPS], 1, gl.int32, layout), mask=lane == 0,
                         sem="relaxed")


@gluon.jit
def taken(take_lanes):
    """The take :func:`take` returned, as a scalar."""
    return gl.sum(take_lanes, 0)


TAG = gl.constexpr(4)  # a tag step's int32s: expert (-1 ends), task, row0, row_end


@gluon.jit
def tag_step(tags, full, empty, g, expert, task, row0, row_end, STAGES: gl.constexpr,
             FULL_ARRIVALS: gl.constexpr, WARPS: gl.constexpr):
    """A ring step that carries no data, only the next block's coordinates for the consumers (expert -1: no more
    blocks), so that between blocks they wait on no global load (but a window's mode) while the tensor cores idle."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    i = gl.arange(0, TAG, layout=layout)
    tag = gl.where(i == 0, expert, gl.where(i == 1, task, gl.where(i == 2, row0, row_end)))
    s = g % STAGES
    mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
    tags.index(s).store(tag)
    mbarrier.arrive(full.index(s), count=FULL_ARRIVALS)
    return g + 1


@gluon.jit
def read_tag(tags, full, empty, g, STAGES: gl.constexpr):
    """A consumer's read of tag step g: ``(expert, task, row0, row_end)``, the slot released."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    s = g % STAGES
    mbarrier.wait(full.index(s), (g // STAGES) & 1)
    tag = tags.index(s).load(layout)
    mbarrier.arrive(empty.index(s), count=1)
    i = gl.arange(0, TAG, layout=layout)
    return (gl.sum(gl.where(i == 0, tag, 0), 0), gl.sum(gl.where(i == 1, tag, 0), 0),
            gl.sum(gl.where(i == 2, tag, 0), 0), gl.sum(gl.where(i == 3, tag, 0), 0))


@gluon.jit
def end_descriptors(a_ptr, b_ptr, expert, row_end, site_expert, a_desc, b_desc, site_last, g, full, OUT_M, OUT_N,
                    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """One end of the deal's descriptor site: ``(expert, a_desc, b_desc)``, remade (``site_descriptors``, this
    call's own scratch slots) only when the block's expert is not the one the site holds."""
    if expert != site_expert:
        site_expert = expert
        a_desc, b_desc = site_descriptors(a_ptr, b_ptr, row_end, site_last, g, full, OUT_M, OUT_N, BLOCK_N, BLOCK_K,
                                          STAGES)
    return site_expert, a_desc, b_desc


@gluon.jit
def producer_dynamic(a_ptr, b_ptr, a_index_ptr, deal_ptr, OUT_M, OUT_N,
                      a_smem, b_smem, tags, full, empty, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                      STAGES: gl.constexpr, A_GATHER: gl.constexpr):
    """DYNAMIC: takes blocks from the launch's counter until none is left; each block's K steps follow a tag step
    that names it. Each end of the deal has its descriptors at a call site of its own (even takes: the heavy end,
    odd: the light end), remade only when that end's expert changes, so a program whose takes alternate between
    the ends does not remake them every block (a rewrite waits for the last load through its site to land, as
    ``_load_expert``'s)."""
    WARPS: gl.constexpr = GATHER_WARPS.value if A_GATHER else 1
    FULL: gl.constexpr = full_arrivals(A_GATHER)
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
    # a take and its block's coordinates are chained global round trips (~1.5 us a block where the producer waited
    # for them between blocks, 2026-12-06-dynamic-wgrad): the next take is issued before the block's last STAGES
    # loads, its round trip under them, and its coordinates loaded after them, while the ring still holds those
    # steps for the consumers. Not earlier: a take held over a block keeps it from programs that come free (holding
    # the next two, a program took the hot expert's blocks in pairs: qwen3-30b-a3b's zipf wgrads 2.57 -> 3.01 ms,
    # 2026-12-06-deal-rebuilt).
    t = taken(take(deal_ptr, WARPS))
    expert, task, row0, row_end = dealt_block(deal_ptr, total, t, per_expert)
    while t < total:
        heavy_end = t % 2 == 0
        if heavy_end:
            expert0, a_desc0, b_desc0 = end_descriptors(a_ptr, b_ptr, expert, row_end, expert0, a_desc0, b_desc0,
                                                        site_last0, g, full, OUT_M, OUT_N, BLOCK_N, BLOCK_K, STAGES)
            a_desc = a_desc0
            b_desc = b_desc0
        else:
            expert1, a_desc1, b_desc1 = end_descriptors(a_ptr, b_ptr, expert, row_end, expert1, a_desc1, b_desc1,
                                                        site_last1, g, full, OUT_M, OUT_N, BLOCK_N, BLOCK_K, STAGES)
            a_desc = a_desc1
            b_desc = b_desc1
        g = tag_step(tags, full, empty, g, expert, task, row0, row_end, STAGES, FULL, WARPS)
        m0 = task // num_n * (2 * HALF_M)
        n0 = task % num_n * BLOCK_N
        steps = gl.cdiv(gl.maximum(row_end - row0, 0), BLOCK_K)
        split = row0 + gl.maximum(steps - STAGES, 0) * BLOCK_K
        rows_now, rows_next = first_rows(a_index_ptr, row0, split, BLOCK_K, A_GATHER)
        g = load_block(a_ptr, a_desc, b_desc, a_index_ptr, rows_now, rows_next, row0, split, m0, n0, OUT_M, a_smem,
                       b_smem, full, empty, g, BLOCK_N, BLOCK_K, STAGES, A_GATHER)
        next_take = take(deal_ptr, WARPS)
        rows_now, rows_next = first_rows(a_index_ptr, split, row_end, BLOCK_K, A_GATHER)
        g = load_block(a_ptr, a_desc, b_desc, a_index_ptr, rows_now, rows_next, split, row_end, m0, n0, OUT_M, a_smem,
                       b_smem, full, empty, g, BLOCK_N, BLOCK_K, STAGES, A_GATHER)
        if row_end > row0:
            if heavy_end:
                site_last0 = g - 1
            else:
                site_last1 = g - 1
        t = taken(next_take)
        expert, task, row0, row_end = dealt_block(deal_ptr, total, t, per_expert)
    tag_step(tags, full, empty, g, -1, 0, 0, 0, STAGES, FULL, WARPS)


@gluon.jit
def consumer_dynamic(out_ptr, modes_ptr, carry_in_ptr, carry_out_ptr, num_experts, OUT_M, OUT_N, a_smem, b_smem,
                      c_smem, tags, full, empty, HALF: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                      STAGES: gl.constexpr, MMA_IN_FLIGHT: gl.constexpr, CARRY: gl.constexpr, GATHER: gl.constexpr,
                      OUT_T: gl.constexpr):
    """DYNAMIC: rows HALF * 64 .. HALF * 64 + 63 of each block the producer's tag steps name, in their order."""
    num_n = gl.cdiv(OUT_N, BLOCK_N)
    out_desc = out_descriptor(out_ptr, num_experts, OUT_M, OUT_N, BLOCK_N, OUT_T)
    expert, task, row0, row_end = read_tag(tags, full, empty, 0, STAGES)
    g = 1
    while expert >= 0:
        if CARRY:  # the window's mode: the one global load between blocks, and only with a carry
            mode = gl.load(modes_ptr + expert)
        else:
            mode = STORE
        g = half_block(out_desc, a_smem, b_smem, c_smem, full, empty, g, expert, mode, row0, row_end,
                        task // num_n * (2 * HALF_M), task % num_n * BLOCK_N, carry_in_ptr, carry_out_ptr, OUT_M,
                        OUT_N, HALF, BLOCK_N, BLOCK_K, STAGES, MMA_IN_FLIGHT, CARRY, GATHER, OUT_T)
        expert, task, row0, row_end = read_tag(tags, full, empty, g, STAGES)
        g += 1
    tma.store_wait(pendings=0)
