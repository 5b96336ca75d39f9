"""NVLink row movement in Triton: pull and push tile functions, persistent kernels, bounded waits.

docs/design.md. Every rank holds the same named buffers (``megamoe.parallel.symmetric``
symmetric workspace); a kernel reaches rank r's copy of a buffer through an
int64 ``[R]`` table of base addresses (``peer_ptrs``). The launch layer is
``megamoe.ops.comm``; this module holds only jit code.

Row tiles
---------
A tile is ``ROWS`` consecutive rows of a table, held as ``[ROWS, CP, W]``:
row r's columns ``c*W + [0, W)`` for chunks ``c < CHUNKS = D / W`` (CP, the
next power of two, pads; the padding is masked). W is one warp's 16-byte
vectors across its 32 lanes (256 bf16, 512 E4M3 bytes, 128 fp32) or, for a
narrower row, the largest power of two dividing it. With the chunk axis
before the columns and ROWS = num_warps, Triton gives each warp one row and
each thread all CP vectors of that row in registers, so a thread loads the
row's schedule entries and works out its source and destination once, then
issues CHUNKS 16-byte loads and stores (28 for a 14 KB kimi-k2 row: ~2.5
instructions per vector in the sm_90 SASS). The chunked tiles before
(``[VROWS, 1024]`` chunks, rows split across warps) redid ~40 instructions
of row arithmetic for every vector, which bound a comm SM to ~11 GB/s
(benchmarks/results/2026-11-29-comm-tile, 2026-11-30-row-tiles). A tile of
8 rows on 8 warps keeps 112 KB of loads in flight per program.

Peer addresses keep 16-byte vectors: a peer row is addressed as
``anchor + off`` where ``anchor`` is this rank's copy of the same buffer (a
kernel argument, so the compiler knows it is 16-byte aligned) and
``off = (peer_base - anchor) / esize + row * stride + cols``; the
``tl.multiple_of`` / ``tl.max_contiguous`` hints go on the 3-D offsets
(``vector_offsets``). (Casting an int64 address to a pointer, or hinting the
1-D row offsets alone, loses the alignment and gives 2-byte accesses.)

Tile functions (inlined by the standalone kernels below and, later, by the
megakernel's communication workers):

    pull_tile  rows t of a pull schedule: dst[t] = src_{src_rank[t]}[src_index[t] // TOP_K]
               optional: times the route's router weight (read from the source
               rank's weights at src_index[t]), on-the-fly MXFP8 / FP8-block
               quantisation of the pulled rows (the tile viewed as [ROWS*CP, W])
    push_tile  entries t of a push table: dst_{dst_rank[t]}[dst_row[t]] = src[t]
               (or src[src_row[t] // SRC_ROW_DIV]); entries for one rank may be skipped
    wait_flags bounded spin until flags[r] >= target for every r < count

Index arrays (int32): ``src_rank``/``src_index`` ``[capacity]`` of a
``PullSchedule`` (-1 = padding, skipped); the push tables ``dst_rank``,
``dst_row`` ``[rows]`` (-1 = skipped) and ``src_row``. ``num_rows_ptr`` points
at the device count of rows in use, so no launch reads device data on the
host; ``row_limit`` caps it (the first minibatch).

Persistent kernels, grid = (num_sms,): programs claim row tiles from a counter
(``claim_tiles``: guided, ``max(1, left / 2P)`` tiles a claim; a fixed
round-robin share let programs on SMs that get less NVLink bandwidth finish
up to 1.7x late, pushes lost 15-25 % from 18 programs on); the last program
out zeroes the counter (``release_claims``). ``push_kernel`` with SIGNAL
(push dispatch with a completion flag per peer): after its stores each program does
``debug_barrier`` + an acq_rel arrival on a local counter; the program that
arrives last (the counter reaches ``arrive_target``, a running total kept by
the launcher, so nothing is reset between calls) writes ``epoch`` into
``flags[my_rank]`` of every rank (release, system scope) and then waits,
bounded, for ``flags[r] >= epoch`` from every rank r. Only that one program
waits, so the grid need not be co-resident and the interpreter, which runs
programs one after another, cannot deadlock. ``barrier_kernel`` is the same
exchange with one program: a device-side barrier across ranks.

Bounded waits: a wait polls with ``atomic_add(ptr, 0, sem="acquire",
scope="sys")`` at most ``budget`` times in all. On timeout it writes
``[wait_id, rank, target, seen]`` to the int32 error word and returns; the
launcher reads the word and raises RuntimeError naming the flag and the peer.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megamoe.kernels.quant import fp8_block_quantize_tile, mxfp8_quantize_tile

@triton.jit
def peer_offset(rank, row, valid, peer_ptrs, anchor_ptr, stride_row):
    """int64 element offsets from ``anchor_ptr`` to row ``row`` of rank ``rank``'s buffer.

    ``anchor_ptr`` is this rank's copy of the buffer (any buffer of the same
    element type works); rows where ``valid`` is False get a meaningless
    offset and must stay masked.
    """
    ESIZE: tl.constexpr = anchor_ptr.dtype.element_ty.primitive_bitwidth // 8
    base = tl.load(peer_ptrs + rank, mask=valid, other=0)
    return (base - anchor_ptr.to(tl.int64)) // ESIZE + row.to(tl.int64) * stride_row


@triton.jit
def tile_entries(t0, num_rows, rank_ptr, index_ptr, ROWS: tl.constexpr, CHUNKS: tl.constexpr, CP: tl.constexpr,
                 W: tl.constexpr):
    """Rows ``[t0, t0 + ROWS)`` of a table of (rank, index) entries: ``(t, cols, rank, index, valid, mask)``.

    Entries at ``t >= num_rows`` read as rank -1; ``valid`` is ``rank >= 0``. ``cols [1, CP, W]``: chunk c of
    a row is its columns ``c*W + [0, W)``; ``mask [ROWS, CP, 1]`` keeps the valid rows' chunks ``< CHUNKS``
    (chunks CHUNKS .. CP-1 pad CP to a power of two: a compile-time mask on the GPU, as each thread holds
    all CP chunks of its row).
    """
    t = t0 + tl.arange(0, ROWS)
    in_range = t < num_rows
    rank = tl.load(rank_ptr + t, mask=in_range, other=-1)
    index = tl.load(index_ptr + t, mask=in_range, other=-1)
    valid = rank >= 0
    chunk = tl.arange(0, CP)
    cols = (chunk * W)[None, :, None] + tl.arange(0, W)[None, None, :]
    return t, cols, rank, index, valid, valid[:, None, None] & (chunk < CHUNKS)[None, :, None]


@triton.jit
def vector_offsets(row_off, cols, ALIGN: tl.constexpr, W: tl.constexpr):
    """``row_off [ROWS]`` (element offsets of row starts, multiples of ALIGN) plus ``cols``, as 16-byte vectors.

    The hints sit on the 3-D sum: put on ``row_off`` alone they are lost (2-byte loads of peer rows)."""
    return tl.max_contiguous(tl.multiple_of(row_off[:, None, None] + cols, [1, 1, ALIGN]), [1, 1, W])


@triton.jit
def pull_tile(
    t0,
    num_rows,
    src_peer_ptrs,
    src_anchor_ptr,
    stride_src,
    src_rank_ptr,
    src_index_ptr,
    dst_ptr,
    stride_dst,
    qscale_ptr,
    stride_qscale,
    TOP_K: tl.constexpr,
    CHUNKS: tl.constexpr,
    CP: tl.constexpr,
    W: tl.constexpr,
    ROWS: tl.constexpr,
    ALIGN: tl.constexpr,
    QUANT: tl.constexpr,
    SOFT_E4M3: tl.constexpr,
):
    """Pull rows ``[t0, t0 + ROWS)`` of the schedule's rows ``t < num_rows`` into ``dst[t]``.

    ``src`` is ``[N, D]`` on every rank (row ``src_index // TOP_K``); ``dst``
    is local ``[capacity, D]``, rows copied as they are. QUANT (0 none, 1 MXFP8, 2 FP8-block 1x128): store E4M3 bits (uint8 ``dst``) and per-block scales
    (``qscale [capacity, D/32]`` uint8 or ``[capacity, D/128]`` fp32; W a multiple of the block).
    Rows with ``src_rank == -1`` are not written.
    """
    t, cols, rank, index, valid, mask = tile_entries(t0, num_rows, src_rank_ptr, src_index_ptr, ROWS, CHUNKS, CP, W)
    src_off = peer_offset(rank, index // TOP_K, valid, src_peer_ptrs, src_anchor_ptr, stride_src)
    x = tl.load(src_anchor_ptr + vector_offsets(src_off, cols, ALIGN, W), mask=mask)
    dst_off = vector_offsets(t.to(tl.int64) * stride_dst, cols, ALIGN, W)
    if QUANT == 0:
        tl.store(dst_ptr + dst_off, x, mask=mask)
    else:
        SBLOCK: tl.constexpr = 32 if QUANT == 1 else 128
        flat = tl.reshape(x, (ROWS * CP, W))
        if QUANT == 1:
            data, scale = mxfp8_quantize_tile(flat, 1, False, SOFT_E4M3)
        else:
            data, scale = fp8_block_quantize_tile(flat, 1, 128, SOFT_E4M3)
        data = tl.reshape(data.to(tl.uint8, bitcast=True), (ROWS, CP, W))
        tl.store(dst_ptr + dst_off, data, mask=mask)
        scale = tl.reshape(scale, (ROWS, CP, W // SBLOCK))
        s_cols = (tl.arange(0, CP) * (W // SBLOCK))[None, :, None] + tl.arange(0, W // SBLOCK)[None, None, :]
        s_off = (t.to(tl.int64) * stride_qscale)[:, None, None] + s_cols
        tl.store(qscale_ptr + s_off, scale, mask=mask)


@triton.jit
def push_tile(
    t0,
    num_rows,
    src_ptr,
    stride_src,
    src_row_ptr,
    dst_rank_ptr,
    dst_row_ptr,
    dst_peer_ptrs,
    dst_anchor_ptr,
    stride_dst,
    skip_rank,
    SRC_ROW_DIV: tl.constexpr,
    IDENTITY_SRC: tl.constexpr,
    CHUNKS: tl.constexpr,
    CP: tl.constexpr,
    W: tl.constexpr,
    ROWS: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """Push entries ``[t0, t0 + ROWS)`` of those ``t < num_rows``: ``dst_{dst_rank[t]}[dst_row[t]] = src[s]``.

    ``s = t`` (IDENTITY_SRC) or ``src_row[t] // SRC_ROW_DIV``; ``src`` is a
    local ``[*, D]`` buffer, ``dst`` exists on every rank. Entries with
    ``dst_rank == -1`` or ``dst_rank == skip_rank`` are skipped (-1: none).
    """
    t, cols, rank, row, valid, mask = tile_entries(t0, num_rows, dst_rank_ptr, dst_row_ptr, ROWS, CHUNKS, CP, W)
    keep = rank != skip_rank
    valid = valid & keep
    mask = mask & keep[:, None, None]
    if IDENTITY_SRC:
        s = t.to(tl.int64)
    else:
        s = (tl.load(src_row_ptr + t, mask=valid, other=0) // SRC_ROW_DIV).to(tl.int64)
    x = tl.load(src_ptr + vector_offsets(s * stride_src, cols, ALIGN, W), mask=mask)
    dst_off = peer_offset(rank, row, valid, dst_peer_ptrs, dst_anchor_ptr, stride_dst)
    tl.store(dst_anchor_ptr + vector_offsets(dst_off, cols, ALIGN, W), x, mask=mask)


@triton.jit
def wait_flags(flags_ptr, count, target, budget, error_ptr, WAIT_ID: tl.constexpr):
    """Spin until ``flags[r] >= target`` for every ``r < count``; at most ``budget`` polls in all.

    Polls are acquire loads at system scope (``atomic_add(ptr, 0)``), so
    whatever a peer wrote before its release of the flag is visible after.
    On timeout writes ``[WAIT_ID, r, target, seen]`` (first late rank) to
    ``error_ptr[0:4]`` unless an earlier timeout holds the word. Returns 1 when every flag arrived, else 0.
    """
    polls = 0
    ok = 1
    for r in range(count):
        seen = tl.atomic_add(flags_ptr + r, 0, sem="acquire", scope="sys")
        while (seen < target) & (polls < budget):
            seen = tl.atomic_add(flags_ptr + r, 0, sem="acquire", scope="sys")
            polls += 1
        if (seen < target) & (ok == 1):
            if tl.atomic_cas(error_ptr, 0, WAIT_ID) == 0:  # the first timeout of a pass is the one reported
                tl.store(error_ptr + 1, r)
                tl.store(error_ptr + 2, target)
                tl.store(error_ptr + 3, seen)
            ok = 0
    return ok


@triton.jit
def signal_and_wait(flag_peer_ptrs, flags_ptr, my_rank, num_ranks, epoch, budget, error_ptr, WAIT_ID: tl.constexpr):
    """Write ``epoch`` to ``flags[my_rank]`` on every rank (release, system scope), then ``wait_flags``."""
    for r in range(num_ranks):
        off = (tl.load(flag_peer_ptrs + r) - flags_ptr.to(tl.int64)) // 4 + my_rank
        tl.atomic_xchg(flags_ptr + off, epoch, sem="release", scope="sys")
    return wait_flags(flags_ptr, num_ranks, epoch, budget, error_ptr, WAIT_ID)


@triton.jit
def claim_tiles(claims_ptr, tiles, workers):
    """The next tiles ``[lo, hi)`` for this program: guided hand-out from the counter ``claims[0]``.

    A claim takes ``max(1, left / (2 workers))`` tiles, so a program that gets less NVLink bandwidth than
    the others claims fewer (with a fixed round-robin share, programs on some SMs finished up to 1.7x
    later from 18 programs on: benchmarks/results/2026-11-30-tile-order); about ``2P ln(tiles / 2P) + 2P``
    claims in all. ``lo >= tiles``: nothing left. The counter is read with an atomic, not a load: a
    scalar atomic's result is the same in every thread, a load's may not be while the counter moves.
    """
    seen = tl.atomic_add(claims_ptr, 0, sem="relaxed", scope="gpu")
    size = tl.maximum((tiles - seen) // (2 * workers), 1)
    lo = tl.atomic_add(claims_ptr, size, sem="relaxed", scope="gpu")
    return lo, tl.minimum(lo + size, tiles)


@triton.jit
def release_claims(claims_ptr):
    """Count this program out (``claims[1]``); the last one zeroes both counters for the next launch."""
    out = tl.atomic_add(claims_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if out == tl.num_programs(0) - 1:  # every program took its last claim before counting out
        tl.atomic_xchg(claims_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(claims_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def route_scalars_kernel(num_rows_ptr, src_rank_ptr, src_index_ptr, peer_ptrs, anchor_ptr, rows_ptr,
                         PUSH: tl.constexpr, BLOCK: tl.constexpr):
    """One fp32 per route between a schedule's rows and the routes' home ranks: rows ``t < num_rows``, program p
    takes ``[p * BLOCK, (p + 1) * BLOCK)``. Pull (``PUSH`` off): ``rows[t] = home_{src_rank[t]}[src_index[t]]``
    (0 where ``src_rank`` is -1); push: ``home_{src_rank[t]}[src_index[t]] = rows[t]`` (-1 rows skipped). The
    home buffers are ``[N*k]`` slots on every rank (``anchor_ptr`` this rank's)."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = t < tl.load(num_rows_ptr)
    rank = tl.load(src_rank_ptr + t, mask=in_range, other=-1)
    index = tl.load(src_index_ptr + t, mask=in_range, other=0)
    valid = rank >= 0
    home = anchor_ptr + peer_offset(rank, index, valid, peer_ptrs, anchor_ptr, 1)
    if PUSH:
        tl.store(home, tl.load(rows_ptr + t, mask=valid), mask=valid)
    else:
        tl.store(rows_ptr + t, tl.load(home, mask=valid, other=0.0), mask=in_range)


# Per-call scalars are not specialised on (value 1, multiples of 16): a new
# epoch or row limit must not trigger a recompile inside a timed loop.
@triton.jit(do_not_specialize=["row_limit"])
def pull_kernel(
    num_rows_ptr,
    row_limit,
    claims_ptr,
    src_peer_ptrs,
    src_anchor_ptr,
    stride_src,
    src_rank_ptr,
    src_index_ptr,
    dst_ptr,
    stride_dst,
    qscale_ptr,
    stride_qscale,
    TOP_K: tl.constexpr,
    CHUNKS: tl.constexpr,
    CP: tl.constexpr,
    W: tl.constexpr,
    ROWS: tl.constexpr,
    ALIGN: tl.constexpr,
    QUANT: tl.constexpr,
    SOFT_E4M3: tl.constexpr,
):
    n = tl.minimum(tl.load(num_rows_ptr), row_limit)
    tiles = tl.cdiv(n, ROWS)
    lo, hi = claim_tiles(claims_ptr, tiles, tl.num_programs(0))
    while lo < tiles:
        for tile in range(lo, hi):
            pull_tile(tile * ROWS, n, src_peer_ptrs, src_anchor_ptr, stride_src, src_rank_ptr, src_index_ptr, dst_ptr,
                      stride_dst, qscale_ptr, stride_qscale, TOP_K, CHUNKS, CP, W, ROWS, ALIGN, QUANT, SOFT_E4M3)
        lo, hi = claim_tiles(claims_ptr, tiles, tl.num_programs(0))
    release_claims(claims_ptr)


@triton.jit(do_not_specialize=["row_limit", "arrive_target", "epoch", "my_rank", "budget"])
def push_kernel(
    num_rows_ptr,
    row_limit,
    claims_ptr,
    src_ptr,
    stride_src,
    src_row_ptr,
    dst_rank_ptr,
    dst_row_ptr,
    dst_peer_ptrs,
    dst_anchor_ptr,
    stride_dst,
    flag_peer_ptrs,
    flags_ptr,
    counter_ptr,
    arrive_target,
    epoch,
    my_rank,
    num_ranks,
    budget,
    error_ptr,
    SRC_ROW_DIV: tl.constexpr,
    IDENTITY_SRC: tl.constexpr,
    CHUNKS: tl.constexpr,
    CP: tl.constexpr,
    W: tl.constexpr,
    ROWS: tl.constexpr,
    ALIGN: tl.constexpr,
    SIGNAL: tl.constexpr,
    WAIT_ID: tl.constexpr,
):
    n = tl.minimum(tl.load(num_rows_ptr), row_limit)
    tiles = tl.cdiv(n, ROWS)
    lo, hi = claim_tiles(claims_ptr, tiles, tl.num_programs(0))
    while lo < tiles:
        for tile in range(lo, hi):
            push_tile(tile * ROWS, n, src_ptr, stride_src, src_row_ptr, dst_rank_ptr, dst_row_ptr, dst_peer_ptrs,
                      dst_anchor_ptr, stride_dst, -1, SRC_ROW_DIV, IDENTITY_SRC, CHUNKS, CP, W, ROWS, ALIGN)
        lo, hi = claim_tiles(claims_ptr, tiles, tl.num_programs(0))
    release_claims(claims_ptr)
    if SIGNAL:
        tl.debug_barrier()  # every thread's stores are issued before the arrival below releases them
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
        if arrived == arrive_target - 1:  # the last program of this rank: all its stores happened before
            signal_and_wait(flag_peer_ptrs, flags_ptr, my_rank, num_ranks, epoch, budget, error_ptr, WAIT_ID)
        tl.debug_barrier()


@triton.jit(do_not_specialize=["my_rank", "epoch", "budget"])
def barrier_kernel(flag_peer_ptrs, flags_ptr, my_rank, num_ranks, epoch, budget, error_ptr, WAIT_ID: tl.constexpr):
    tl.debug_barrier()
    signal_and_wait(flag_peer_ptrs, flags_ptr, my_rank, num_ranks, epoch, budget, error_ptr, WAIT_ID)
    tl.debug_barrier()
