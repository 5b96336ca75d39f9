"""Rows gathered by an index up to a row count held on the device: ``dst[q] = src[index[q]]`` for ``q < num_rows``.

The backward's windows read the forward ring's h (and FP8 x) this way: a window's row count is known only on the
device, and the windows past a rank's last row (every rank visits the same static number) copy nothing. Program
``(p, c)`` copies rows ``[p * BLOCK_R, (p + 1) * BLOCK_R)`` x columns ``[c * BLOCK_C, (c + 1) * BLOCK_C)``; a
program whose first row is at or past ``num_rows`` returns at once.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gather_rows_kernel(src_ptr, stride_src, index_ptr, dst_ptr, stride_dst, num_rows_ptr, width,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    row0 = tl.program_id(0) * BLOCK_R
    rows_in = tl.load(num_rows_ptr)
    if row0 < rows_in:
        rows = row0 + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = rows < rows_in
        src_rows = tl.load(index_ptr + rows, mask=ok, other=0)
        mask = ok[:, None] & (cols < width)[None, :]
        values = tl.load(src_ptr + src_rows[:, None] * stride_src + cols[None, :], mask=mask)
        tl.store(dst_ptr + rows.to(tl.int64)[:, None] * stride_dst + cols[None, :], values, mask=mask)
