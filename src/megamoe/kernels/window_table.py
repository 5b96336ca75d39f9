"""One backward window's table in one launch: its cuts, ring rows and per-expert pieces (``megamoe.routing.windows``
documents what each entry means; its torch builder is the CPU path and this kernel's twin).

The torch builder is ~55 small launches per window: at EP 1 on a fine-grained layer (qwen3-30b-a3b at 8192 tokens,
one H100) the backward's ~80 torch launches cost about as much host time as its expert kernels take on the GPU.
Every program finds the window's two cuts (the schedule's expert regions fit one block: L <= a few hundred), then
writes its block of ring rows; program 0 also writes the per-expert entries, the start and the row count.
Integer arithmetic only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megamoe.kernels.wgrad_carry import CARRY_IN, CARRY_OUT, STORE


@triton.jit
def _cut(e, start, end, valid, nominal, num_rows, ALIGN: tl.constexpr):
    """``nominal`` moved down to a multiple of ALIGN rows from the start of the region holding it (the last region
    starting at or before it), at most ``num_rows``."""
    region = tl.max(tl.where(valid & (start <= nominal), e, 0), axis=0)
    first = tl.sum(tl.where(e == region, start, 0), axis=0)
    last = tl.sum(tl.where(e == region, end, 0), axis=0)
    inside = (nominal >= first) & (nominal < last)
    cut = tl.where(inside, first + (nominal - first) // ALIGN * ALIGN, nominal)
    return tl.minimum(cut, num_rows)


@triton.jit(do_not_specialize=["last_row", "window", "windows", "experts"])
def window_table_kernel(offsets_ptr, counts_ptr, num_rows_ptr, src_rank_ptr, src_index_ptr, last_row,
                        window, windows, ring, experts, window_capacity,
                        start_ptr, rows_in_ptr, w_src_rank_ptr, w_src_index_ptr, w_rows_ptr, w_counts_ptr,
                        w_offsets_ptr, w_modes_ptr,
                        EXPERTS: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    e = tl.arange(0, EXPERTS)
    valid = e < experts
    start = tl.load(offsets_ptr + e, mask=valid, other=0).to(tl.int64)
    end = start + tl.load(counts_ptr + e, mask=valid, other=0).to(tl.int64)
    num_rows = tl.load(num_rows_ptr).to(tl.int64)
    w = window.to(tl.int64)
    c0 = _cut(e, start, end, valid, w * ring, num_rows, ALIGN)
    c1 = _cut(e, start, end, valid, (w + 1) * ring, num_rows, ALIGN)
    c0 = tl.where(w == 0, 0, c0)
    c1 = tl.where(w + 1 == windows, num_rows, c1)
    rows_in = c1 - c0
    # ring rows q of this program: the schedule row c0 + q (clamped into the schedule), its entries below rows_in
    q = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_ring = q < window_capacity
    rows = tl.minimum(c0 + q, last_row)
    inside = q < rows_in
    tl.store(w_rows_ptr + q, rows, mask=in_ring)
    tl.store(w_src_rank_ptr + q, tl.load(src_rank_ptr + rows, mask=inside, other=-1), mask=in_ring)
    tl.store(w_src_index_ptr + q, tl.load(src_index_ptr + rows, mask=inside, other=-1), mask=in_ring)
    if tl.program_id(0) == 0:
        first = tl.minimum(tl.maximum(start - c0, 0), rows_in)
        last = tl.minimum(tl.maximum(end - c0, 0), rows_in)
        modes = tl.where((start < c0) & (end > c0), CARRY_IN, 0)
        continues = (start < c1) & (end > c1)
        ends_here = (end > c0) & (end <= c1) & (end > start)
        ends_here = ends_here | ((w == 0) & (end == start))  # experts with no rows get zeros once
        modes = modes | tl.where(continues, CARRY_OUT, tl.where(ends_here, STORE, 0))
        tl.store(w_counts_ptr + e, (last - first).to(tl.int32), mask=valid)
        tl.store(w_offsets_ptr + e, first.to(tl.int32), mask=valid)
        tl.store(w_modes_ptr + e, modes.to(tl.int32), mask=valid)
        tl.store(start_ptr, c0)
        tl.store(rows_in_ptr, rows_in.to(tl.int32))
