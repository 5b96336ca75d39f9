"""The pull schedule and its row tiles, built by three small kernels instead of ~40 torch ops.

An eager pass spent ~3 ms of host time launching the torch version of these builders
(benchmarks/results/2026-11-29-megakernel: schedule 2.0 ms, row tiles 0.9 ms); these kernels are
three launches. They compute exactly what `megamoe.routing.schedule` and `megamoe.routing.row_tiles` document
(same rows, same order) with integer arithmetic only, so the result is deterministic.

Routes of rank r are cut into blocks of BLOCK routes (``i*k + j`` order); block b of rank r is
program ``r * B + b`` of the route kernels. Each route is read twice (the first version had
program (l, r) scan all of rank r's routes for its one expert: L times the reads, 0.18 ms of a
qwen3.5-397b pass):

    route_histogram_kernel program (r, b): H[r, b, l], its block's routes to each local expert l, added
                           into M[l, r] (integer atomics), and its share of the -1 fill of src_rank /
                           src_index; the program that finishes last: T, S
    place_routes_kernel    program (r, b): each route of the block to l goes to row S[l] + p, with
                           o = sum of H[r, b', l] over b' < b + the block's earlier routes to l; this
                           rank's programs also map each of its routes to its row (own_rows, when asked)
    row_tiles_kernel       program j: the tiles of every region inside minibatch j
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _routes(ids_ptr, rank, start, routes_per_rank, first_expert, num_experts, SIZE: tl.constexpr):
    """(route index [SIZE], local expert [SIZE]) of rank ``rank``'s routes ``[start, start + SIZE)``; routes of
    other ranks' experts, -1 and the padding past ``routes_per_rank`` get the dump expert ``num_experts``."""
    route = start + tl.arange(0, SIZE)
    ids = tl.load(ids_ptr + rank.to(tl.int64) * routes_per_rank + route, mask=route < routes_per_rank, other=-1)
    local = ids.to(tl.int64) - first_expert
    mine = (local >= 0) & (local < num_experts)
    return route, tl.where(mine, local, num_experts).to(tl.int32)


@triton.jit
def route_histogram_kernel(ids_ptr, hist_ptr, counts_ptr, tokens_ptr, offsets_ptr, num_rows_ptr, arrived_ptr,
                           src_rank_ptr, src_index_ptr, routes_per_rank, first_expert, num_experts, num_ranks, blocks,
                           capacity, align, BLOCK: tl.constexpr, BINS: tl.constexpr, BLOCK_L: tl.constexpr):
    """ids int `[R, N*k]` (global expert ids, -1 = none) -> hist int32 `[R, blocks, L]` (program r * blocks + b:
    its block's routes to each local expert), added into counts M `[L, R]` (zeroed; integer atomics, so the
    order does not matter); src_rank / src_index int32 `[capacity]` set to -1 (each program a share;
    place_routes_kernel writes the used rows). BINS >= L is a power of two.

    The program that finishes last (``arrived``: a zeroed int32) writes tokens T, offsets S and num_rows from M.
    """
    pid = tl.program_id(0)
    rank = pid // blocks
    _, local = _routes(ids_ptr, rank, pid % blocks * BLOCK, routes_per_rank, first_expert, num_experts, BLOCK)
    hist = tl.histogram(local, BINS, mask=local < num_experts)  # the dump expert is not counted
    bins = tl.arange(0, BINS)
    tl.store(hist_ptr + pid.to(tl.int64) * num_experts + bins, hist, mask=bins < num_experts)
    tl.atomic_add(counts_ptr + bins * num_ranks + rank, hist, mask=(bins < num_experts) & (hist > 0), sem="relaxed")
    share = tl.cdiv(capacity, tl.num_programs(0))
    fill = tl.full((BLOCK,), -1, dtype=tl.int32)
    for start in range(pid * share, tl.minimum((pid + 1) * share, capacity), BLOCK):
        row = start + tl.arange(0, BLOCK)
        keep = (row < capacity) & (row < (pid + 1) * share)
        tl.store(src_rank_ptr + row, fill, mask=keep)
        tl.store(src_index_ptr + row, fill, mask=keep)
    tl.debug_barrier()  # every thread's counts additions are issued before the arrival releases them
    if tl.atomic_add(arrived_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        tl.debug_barrier()
        running = tl.zeros((), dtype=tl.int32)  # rows of the regions of earlier experts (padded)
        for l0 in range(0, num_experts, BLOCK_L):
            experts = l0 + tl.arange(0, BLOCK_L)
            valid = experts < num_experts
            tokens = tl.zeros((BLOCK_L,), dtype=tl.int32)
            for r in range(num_ranks):
                tokens += tl.load(counts_ptr + experts * num_ranks + r, mask=valid, other=0)
            padded = tl.where(valid, (tokens + align - 1) // align * align, 0)
            starts = running + tl.cumsum(padded, axis=0) - padded
            tl.store(tokens_ptr + experts, tokens, mask=valid)
            tl.store(offsets_ptr + experts, starts, mask=valid)
            tl.store(num_rows_ptr + experts * 0, starts + tokens, mask=experts == num_experts - 1)
            running += tl.sum(padded, axis=0)


@triton.jit
def place_routes_kernel(ids_ptr, hist_ptr, counts_ptr, offsets_ptr, src_rank_ptr, src_index_ptr, num_rows_ptr,
                        own_rows_ptr, routes_per_rank, first_expert, num_experts, num_ranks, blocks, my_rank,
                        own_rows_within, BLOCK: tl.constexpr, SUB: tl.constexpr, BINS: tl.constexpr,
                        RANKS: tl.constexpr, BLOCK_B: tl.constexpr, OWN: tl.constexpr):
    """Program (r, b) places its block's routes, SUB at a time. The route with occurrence index o (rank r's
    earlier routes to l: those of blocks b' < b, summed from hist, the earlier sub-blocks' and the sub-block's
    earlier ones, from a SUB x SUB compare) goes to row ``S[l] + sum_r' min(M[l, r'], o) + |{r' < r : M[l, r'] > o}|``.
    OWN: the programs of rank ``my_rank`` also write own_rows int32 `[routes_per_rank]`, each route's row if it
    is placed and ``num_rows <= own_rows_within``, else -1 (every entry: their blocks cover every route).
    BINS >= L and RANKS >= R are powers of two."""
    pid = tl.program_id(0)
    rank = pid // blocks
    fits = tl.load(num_rows_ptr) <= own_rows_within
    bins = tl.arange(0, BINS)
    ranks = tl.arange(0, RANKS)
    seen = tl.zeros((BINS,), dtype=tl.int32)
    for b0 in range(0, pid % blocks, BLOCK_B):  # the routes to each expert in this rank's earlier blocks
        b = b0 + tl.arange(0, BLOCK_B)
        at = (rank * blocks + b.to(tl.int64))[:, None] * num_experts + bins[None, :]
        keep = (b[:, None] < pid % blocks) & (bins[None, :] < num_experts)
        seen += tl.sum(tl.load(hist_ptr + at, mask=keep, other=0), axis=0)
    position = tl.arange(0, SUB)
    for start in range(pid % blocks * BLOCK, pid % blocks * BLOCK + BLOCK, SUB):
        route, local = _routes(ids_ptr, rank, start, routes_per_rank, first_expert, num_experts, SUB)
        earlier = (local[None, :] == local[:, None]) & (position[None, :] < position[:, None])
        mine = local < num_experts
        l = tl.where(mine, local, 0)
        o = tl.gather(seen, l, 0) + tl.sum(earlier.to(tl.int32), 1)
        counts = tl.load(counts_ptr + l[:, None] * num_ranks + ranks[None, :],
                         mask=mine[:, None] & (ranks[None, :] < num_ranks), other=0)  # M[l, :]
        below = tl.sum(tl.minimum(counts, o[:, None]), axis=1)
        ahead = tl.sum(((counts > o[:, None]) & (ranks[None, :] < rank)).to(tl.int32), axis=1)
        row = tl.load(offsets_ptr + l, mask=mine, other=0) + below + ahead
        tl.store(src_rank_ptr + row, tl.full((SUB,), 0, tl.int32) + rank, mask=mine)
        tl.store(src_index_ptr + row, route, mask=mine)
        if OWN:
            if rank == my_rank:
                tl.store(own_rows_ptr + route, tl.where(mine & fits, row, -1), mask=route < routes_per_rank)
        seen += tl.histogram(local, BINS, mask=mine)


@triton.jit
def _tiles_before(first, end, batch, minibatch, block_m):
    """Tiles of the region rows ``[first, end)`` that lie in minibatches before ``batch``."""
    stop = tl.minimum(end, batch * minibatch)
    has = stop > first
    last = tl.maximum(stop - 1, first)
    b0 = first // minibatch
    b1 = last // minibatch
    head = (tl.minimum(stop, (b0 + 1) * minibatch) - first + block_m - 1) // block_m
    full = (b1 - b0 - 1) * ((minibatch + block_m - 1) // block_m)
    tail = (stop - b1 * minibatch + block_m - 1) // block_m
    return tl.where(has, tl.where(b0 == b1, head, head + full + tail), 0)


@triton.jit
def _uncut_tiles(first, end, lo, block_m):
    """Tiles of the region rows ``[first, end)`` that start before row ``lo`` (the region's own tiles)."""
    return (tl.maximum(tl.minimum(end, lo) - first, 0) + block_m - 1) // block_m


@triton.jit
def _cut_layout(first, end, valid, batch, lo, hi, minibatch, block_m):
    """Minibatch j's tiles when tiles are cut at minibatch boundaries: (tiles before j, each region's first
    row and end inside j, its tile count there, its first tile's index)."""
    before = tl.sum(tl.where(valid, _tiles_before(first, end, batch, minibatch, block_m), 0), axis=0)
    seg_start = tl.maximum(first, lo)
    seg_end = tl.minimum(end, hi)
    tiles = tl.where(valid, (tl.maximum(seg_end - seg_start, 0) + block_m - 1) // block_m, 0)
    return before, seg_start, seg_end, tiles, before + tl.cumsum(tiles, axis=0) - tiles


@triton.jit
def _uncut_layout(first, end, valid, lo, hi, block_m):
    """The same for the regions' own tiles: region l's tiles k0 .. k1-1 start in [lo, hi), and its tile k has
    index (tiles of regions < l) + k."""
    own = tl.where(valid, _uncut_tiles(first, end, end, block_m), 0)
    k0 = tl.where(valid, _uncut_tiles(first, end, lo, block_m), 0)
    tiles = tl.where(valid, _uncut_tiles(first, end, hi, block_m), 0) - k0
    return tl.sum(k0, axis=0), first + k0 * block_m, end, tiles, tl.cumsum(own, axis=0) - own + k0


@triton.jit
def row_tiles_kernel(counts_ptr, offsets_ptr, cut_ptr, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                     tile_run_ptr, num_tiles_ptr, minibatch_tiles_ptr, num_experts, num_batches, minibatch, block_m,
                     EXPERTS: tl.constexpr, CUT: tl.constexpr):
    """Program j writes the tiles of minibatch j. CUT 1: every region's tiles inside minibatch j, in
    (minibatch, expert, row) order, so region l's first tile index is every tile of earlier minibatches plus
    minibatch j's in experts < l. CUT 0: the regions' own tiles (expert, row order) that start in minibatch j.
    CUT -1: as ``cut_ptr[0]`` (nonzero: cut) says. Either way a region's tiles in minibatch j are one run
    ``[base, base + tiles)`` (tile_run). EXPERTS >= L is a power of two."""
    batch = tl.program_id(0).to(tl.int64)
    lo = batch * minibatch
    hi = lo + minibatch
    local = tl.arange(0, EXPERTS)
    valid = local < num_experts
    first = tl.load(offsets_ptr + local, mask=valid, other=0).to(tl.int64)
    end = first + tl.load(counts_ptr + local, mask=valid, other=0).to(tl.int64)
    if CUT == 1:
        before, seg_start, seg_end, tiles, base = _cut_layout(first, end, valid, batch, lo, hi, minibatch, block_m)
    elif CUT == 0:
        before, seg_start, seg_end, tiles, base = _uncut_layout(first, end, valid, lo, hi, block_m)
    else:
        cut = tl.load(cut_ptr) != 0
        c = _cut_layout(first, end, valid, batch, lo, hi, minibatch, block_m)
        w = _uncut_layout(first, end, valid, lo, hi, block_m)
        before, seg_start, seg_end = tl.where(cut, c[0], w[0]), tl.where(cut, c[1], w[1]), tl.where(cut, c[2], w[2])
        tiles, base = tl.where(cut, c[3], w[3]), tl.where(cut, c[4], w[4])
    for u in range(tl.max(tiles, axis=0)):  # the regions' tiles side by side, as many steps as the largest has
        keep = u < tiles
        row0 = seg_start + u * block_m
        tl.store(tile_expert_ptr + base + u, local, mask=keep)
        tl.store(tile_row0_ptr + base + u, row0.to(tl.int32), mask=keep)
        tl.store(tile_row_end_ptr + base + u, tl.minimum(row0 + block_m, seg_end).to(tl.int32), mask=keep)
        tl.store(tile_run_ptr + 2 * (base + u), base.to(tl.int32), mask=keep)
        tl.store(tile_run_ptr + 2 * (base + u) + 1, (base + tiles).to(tl.int32), mask=keep)
    tl.store(minibatch_tiles_ptr + batch, before.to(tl.int32))
    if batch == num_batches - 1:
        total = (before + tl.sum(tiles, axis=0)).to(tl.int32)
        tl.store(minibatch_tiles_ptr + num_batches, total)
        tl.store(num_tiles_ptr, total)
