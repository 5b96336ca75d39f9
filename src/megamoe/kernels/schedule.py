"""The pull schedule and its row tiles, built by three small kernels instead of ~40 torch ops.

An eager pass spent ~3 ms of host time launching the torch version of these builders
(benchmarks/results/2026-11-29-megakernel: schedule 2.0 ms, row tiles 0.9 ms); these kernels are
three launches. They compute exactly what `megamoe.schedule` and `megamoe.experts` document
(same rows, same order) with integer arithmetic only, so the result is deterministic.

    route_counts_kernel    program (l, r): M[l, r], routes of rank r to local expert l; and
                           its share of the -1 fill of src_rank / src_index
    schedule_rows_kernel   program (l, r): offsets S[l], then every route of rank r to l
                           goes to row S[l] + p (p from the schedule's formula)
    row_tiles_kernel       program (j, l): the tiles of region l inside minibatch j

Routes of rank r are read in (i, j) order in blocks; a running count plus an exclusive cumsum
gives each route its occurrence index o.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _routes_to(ids_ptr, rank, start, routes_per_rank, first_expert, local, BLOCK: tl.constexpr):
    """(route, mine) of rank r's routes ``[start, start + BLOCK)`` (``i*k + j`` order): mine = 1 where the route
    goes to local expert ``local`` of this rank (global id ``first_expert + local``)."""
    route = start + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + rank.to(tl.int64) * routes_per_rank + route, mask=route < routes_per_rank, other=-1)
    return route, (ids.to(tl.int64) - first_expert == local).to(tl.int32)


@triton.jit
def _program_expert_rank(num_ranks):
    """(pid, local expert l, source rank r) of program (l, r) of an L*R grid."""
    pid = tl.program_id(0)
    return pid, pid // num_ranks, pid % num_ranks


@triton.jit
def route_counts_kernel(ids_ptr, counts_ptr, src_rank_ptr, src_index_ptr, routes_per_rank, first_expert,
                        num_ranks, capacity, BLOCK: tl.constexpr):
    """ids int `[R, N*k]` (global expert ids, -1 = none); counts int32 `[L, R]`; src_rank / src_index
    int32 `[capacity]`, set to -1 here (the next kernel writes the used rows)."""
    pid, local, rank = _program_expert_rank(num_ranks)
    offs = tl.arange(0, BLOCK)
    total = tl.zeros((), dtype=tl.int32)
    for start in range(0, routes_per_rank, BLOCK):
        _, mine = _routes_to(ids_ptr, rank, start, routes_per_rank, first_expert, local, BLOCK)
        total += tl.sum(mine, axis=0)
    tl.store(counts_ptr + pid, total)
    share = tl.cdiv(capacity, tl.num_programs(0))
    fill = tl.full((BLOCK,), -1, dtype=tl.int32)
    for start in range(pid * share, tl.minimum((pid + 1) * share, capacity), BLOCK):
        row = start + offs
        keep = (row < capacity) & (row < (pid + 1) * share)
        tl.store(src_rank_ptr + row, fill, mask=keep)
        tl.store(src_index_ptr + row, fill, mask=keep)


@triton.jit
def schedule_rows_kernel(ids_ptr, counts_ptr, tokens_ptr, offsets_ptr, num_rows_ptr, src_rank_ptr, src_index_ptr,
                         routes_per_rank, first_expert, num_experts, num_ranks, align,
                         BLOCK: tl.constexpr, BLOCK_L: tl.constexpr, RANKS: tl.constexpr):
    """Program (l, r) places rank r's routes to local expert l. Route with occurrence index o goes to row
    ``S[l] + sum_r' min(M[l, r'], o) + |{r' < r : M[l, r'] > o}|``; S[l] = sum over l' < l of T[l'] rounded
    up to ``align``. Program (l, 0) also writes tokens_per_expert[l], offsets[l] and, for the last l, num_rows."""
    pid, local, rank = _program_expert_rank(num_ranks)
    ranks = tl.arange(0, RANKS)
    start_row = tl.zeros((), dtype=tl.int32)
    for l0 in range(0, num_experts, BLOCK_L):
        experts = l0 + tl.arange(0, BLOCK_L)
        m = tl.load(counts_ptr + experts[:, None] * num_ranks + ranks[None, :],
                    mask=(experts[:, None] < local) & (ranks[None, :] < num_ranks), other=0)
        t = tl.sum(m, axis=1)
        start_row += tl.sum((t + align - 1) // align * align, axis=0)
    counts = tl.load(counts_ptr + local * num_ranks + ranks, mask=ranks < num_ranks, other=0)  # M[l, :]
    tokens = tl.sum(counts, axis=0)
    if rank == 0:
        tl.store(tokens_ptr + local, tokens)
        tl.store(offsets_ptr + local, start_row)
        if local == num_experts - 1:
            tl.store(num_rows_ptr, start_row + tokens)
    earlier = ranks[None, :] < rank
    seen = tl.zeros((), dtype=tl.int32)
    for start in range(0, routes_per_rank, BLOCK):
        route, mine = _routes_to(ids_ptr, rank, start, routes_per_rank, first_expert, local, BLOCK)
        o = seen + tl.cumsum(mine, axis=0) - mine
        seen += tl.sum(mine, axis=0)
        below = tl.sum(tl.minimum(counts[None, :], o[:, None]), axis=1)
        ahead = tl.sum(((counts[None, :] > o[:, None]) & earlier).to(tl.int32), axis=1)
        row = start_row + below + ahead
        tl.store(src_rank_ptr + row, tl.full((BLOCK,), 0, tl.int32) + rank, mask=mine != 0)
        tl.store(src_index_ptr + row, route, mask=mine != 0)


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
def row_tiles_kernel(counts_ptr, offsets_ptr, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, num_tiles_ptr,
                     minibatch_tiles_ptr, num_experts, num_batches, minibatch, block_m,
                     BLOCK_L: tl.constexpr, BLOCK_U: tl.constexpr):
    """Program (j, l) writes the tiles of region l inside minibatch j; tiles go in (minibatch, expert, row)
    order, so its first tile index is every tile of earlier minibatches plus minibatch j's in experts < l."""
    pid = tl.program_id(0)
    batch = (pid // num_experts).to(tl.int64)
    local = pid % num_experts
    lo = batch * minibatch
    hi = lo + minibatch
    before = tl.zeros((), dtype=tl.int64)
    here = tl.zeros((), dtype=tl.int64)
    for l0 in range(0, num_experts, BLOCK_L):
        experts = l0 + tl.arange(0, BLOCK_L)
        valid = experts < num_experts
        first = tl.load(offsets_ptr + experts, mask=valid, other=0).to(tl.int64)
        end = first + tl.load(counts_ptr + experts, mask=valid, other=0).to(tl.int64)
        before += tl.sum(tl.where(valid, _tiles_before(first, end, batch, minibatch, block_m), 0), axis=0)
        seg = tl.maximum(tl.minimum(end, hi) - tl.maximum(first, lo), 0)
        here += tl.sum(tl.where(valid & (experts < local), (seg + block_m - 1) // block_m, 0), axis=0)
    first = tl.load(offsets_ptr + local).to(tl.int64)
    end = first + tl.load(counts_ptr + local).to(tl.int64)
    seg_start = tl.maximum(first, lo)
    seg_end = tl.minimum(end, hi)
    tiles = (tl.maximum(seg_end - seg_start, 0) + block_m - 1) // block_m
    base = before + here
    for u0 in range(0, tiles, BLOCK_U):
        u = u0 + tl.arange(0, BLOCK_U)
        keep = u < tiles
        row0 = seg_start + u * block_m
        tl.store(tile_expert_ptr + base + u, tl.full((BLOCK_U,), 0, tl.int32) + local, mask=keep)
        tl.store(tile_row0_ptr + base + u, row0.to(tl.int32), mask=keep)
        tl.store(tile_row_end_ptr + base + u, tl.minimum(row0 + block_m, seg_end).to(tl.int32), mask=keep)
    if local == 0:
        tl.store(minibatch_tiles_ptr + batch, before.to(tl.int32))
    if local == num_experts - 1:
        if batch == num_batches - 1:
            tl.store(minibatch_tiles_ptr + num_batches, (base + tiles).to(tl.int32))
            tl.store(num_tiles_ptr, (base + tiles).to(tl.int32))
