"""The experts' optional biases: the forward epilogues' add and the backward's reductions (Triton; the Gluon tiles
add theirs in their own layouts, the same FP32 add).

Forward: ``b_gate_up [L, 2I]`` is added to the gate/up accumulator before the activation (so the h the backward
keeps includes it) and ``b_down [L, D]`` to the down accumulator, both in FP32 before the bf16 store
(:func:`add_bias`; a ``None`` bias pointer compiles the add out). Backward, over a window's routed rows grouped by
local expert (expert l owns rows ``[offsets[l], offsets[l] + counts[l])``):

    segment_sum_kernel   acc[l, c] += sum over l's rows r of  w[r] * a[r, c]   (w = 1 when None)
                         grid (L, cdiv(C, BLOCK_C)); rows in blocks of BLOCK_R from the expert's first row,
                         blocks in order: d_b_gate_up from d_h, d_b_down from the unscaled d_out rows and w
    row_dot_kernel       out[r] += <a[r, :], b[l, :]> for each row r of expert l
                         grid (L, P); program p takes l's row blocks p, p + P, ...: the router-weight
                         gradient's bias term <d_out_row, b_down[e]>

Every sum has one fixed order and FP32 accumulators (no atomics): bitwise deterministic. A backward window starts
at a multiple of 128 rows of an expert, so with BLOCK_R dividing 128 an expert's row blocks are the same whatever
the window size.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_bias(acc, b_ptr, offset, cols, n_valid):
    """``acc + b[offset + cols]`` broadcast over acc's rows, in FP32 (columns ``cols >= n_valid`` add 0); ``acc``
    unchanged when ``b_ptr`` is None (a constexpr: the add compiles out)."""
    if b_ptr is not None:
        b = tl.load(b_ptr + offset + cols, mask=cols < n_valid, other=0.0).to(tl.float32)
        acc = acc + b[None, :]
    return acc


@triton.jit
def segment_sum_kernel(a_ptr, stride_a, w_ptr, counts_ptr, offsets_ptr, acc_ptr, stride_acc, C,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """acc[l, cols] += sum over expert l's rows of w[r] * a[r, cols] (module docstring); ``w_ptr`` None: w = 1."""
    expert = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    first = tl.load(offsets_ptr + expert).to(tl.int64)
    end = first + tl.load(counts_ptr + expert)
    acc_tile = acc_ptr + expert.to(tl.int64) * stride_acc + cols
    acc = tl.load(acc_tile, mask=col_ok, other=0.0)
    for r0 in range(first, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < end
        a = tl.load(a_ptr + rows[:, None] * stride_a + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        if w_ptr is not None:
            a = a * tl.load(w_ptr + rows, mask=row_ok, other=0.0)[:, None]
        acc += tl.sum(a, axis=0)
    tl.store(acc_tile, acc, mask=col_ok)


@triton.jit
def row_dot_kernel(a_ptr, stride_a, b_ptr, stride_b, counts_ptr, offsets_ptr, out_ptr, C,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[r] += <a[r, :C], b[l, :C]> for every row r of expert l (module docstring)."""
    expert = tl.program_id(0)
    first = tl.load(offsets_ptr + expert).to(tl.int64)
    end = first + tl.load(counts_ptr + expert)
    b_row = b_ptr + expert.to(tl.int64) * stride_b
    for r0 in range(first + tl.program_id(1) * BLOCK_R, end, tl.num_programs(1) * BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < end
        dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            col_ok = cols < C
            a = tl.load(a_ptr + rows[:, None] * stride_a + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                        other=0.0).to(tl.float32)
            b = tl.load(b_row + cols, mask=col_ok, other=0.0).to(tl.float32)
            dot += tl.sum(a * b[None, :], axis=1)
        old = tl.load(out_ptr + rows, mask=row_ok, other=0.0)
        tl.store(out_ptr + rows, old + dot, mask=row_ok)
