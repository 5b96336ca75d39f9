"""The weighted sum after a pass: each token's k expert outputs with its router weights, plus the shared output.

Fixed order (j = 0..k-1), FP32 accumulation, one rounding to bf16: the sum is
the same bits whatever ran before it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megamoe.kernels.convert import bf16_to_f32, f32_to_bf16


@triton.jit
def _add_slot(acc, j, rows, cols, row_ok, mask, y_ptr, stride_y, combine_ptr, stride_combine, own_rows_ptr,
              top_experts_ptr, router_weights_ptr, num_experts, TOP_K: tl.constexpr):
    route = rows.to(tl.int64) * TOP_K + j
    expert = tl.load(top_experts_ptr + route, mask=row_ok, other=-1)
    # an id out of range (check=False records it) is no route, not a read of a slot nobody pushed this pass
    valid = row_ok & (expert >= 0) & (expert < num_experts)
    w = tl.load(router_weights_ptr + route, mask=valid, other=0.0)
    row = tl.load(own_rows_ptr + route, mask=valid, other=-1).to(tl.int64)
    # one load per slot from a row pointer into y or the combine buffer (two masked loads cost 2x the time)
    src = tl.where(row >= 0, y_ptr + row * stride_y, combine_ptr + route * stride_combine)
    return acc + w[:, None] * bf16_to_f32(tl.load(src[:, None] + cols[None, :], mask=valid[:, None] & mask,
                                                  other=0.0))


@triton.jit
def weighted_sum_kernel(
    y_ptr, stride_y, combine_ptr, stride_combine, own_rows_ptr, top_experts_ptr, router_weights_ptr, shared_y_ptr,
    stride_shared_y, out_ptr, stride_out, tokens, D, num_experts,
    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[i] = sum_j w[i, j] * y_route(i*k + j) (j = 0..k-1 in order, FP32; routes to no expert in
    ``[0, num_experts)`` skipped) + shared_y[i].

    Route r's output row is ``y[own_rows[r]]`` where that is >= 0 (this rank's own routes, left in place:
    every route on one rank; at EP >= 2 when the ring held every row), else its combine slot ``combine[r]``
    (pushed home by the rank that ran the expert)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < tokens
    mask = row_ok[:, None] & (cols < D)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # unrolled: the k loads of a tile can all be in flight at once
        acc = _add_slot(acc, j, rows, cols, row_ok, mask, y_ptr, stride_y, combine_ptr, stride_combine,
                        own_rows_ptr, top_experts_ptr, router_weights_ptr, num_experts, TOP_K)
    if HAS_SHARED:
        acc += bf16_to_f32(tl.load(shared_y_ptr + rows.to(tl.int64)[:, None] * stride_shared_y + cols[None, :],
                                        mask=mask, other=0.0))
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], f32_to_bf16(acc), mask=mask)
