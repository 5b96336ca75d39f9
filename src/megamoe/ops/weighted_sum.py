"""Each token's k route slots summed in fixed order (FP32, one rounding), plus a shared row: the forward's weighted
sum, and the backward's home sum of the d_x slots (weights 1: the same bits as ``sum_j slot`` in FP32)."""

from __future__ import annotations

import torch

from megamoe.kernels.weighted_sum import weighted_sum_kernel
from megamoe.runtime import compiled_gpu

#: The tile on a GPU (BLOCK_T tokens x BLOCK_D columns, warps), k slot loads unrolled, one load per slot. 2 x 1024
#: with 2 warps (many small CTAs per SM: the former 16 x 512 x 8 compiled to 170 registers, one CTA per SM) ran
#: 30-35 % faster on one H100 at D 1536-7168 and within 2 % of each shape's best tile, the same bits
#: (benchmarks/results/2026-12-06-h100-step-gathers-wsum, weighted_sum_bench.py). The sm_90 build test counts
#: its 16-byte loads.
WEIGHTED_SUM_TILE = (2, 1024, 2)


def weighted_sum(out: torch.Tensor, slots: torch.Tensor, top_experts: torch.Tensor, router_weights: torch.Tensor,
                 num_experts: int, *, y: torch.Tensor | None = None, own_rows: torch.Tensor | None = None,
                 shared: torch.Tensor | None = None) -> torch.Tensor:
    """``out[i] = sum_j w[i, j] * row(i*k + j) (+ shared[i])`` into bf16 ``out`` `[N, D]`, j in order, FP32.

    Route r's row is ``y[own_rows[r]]`` where ``own_rows[r] >= 0`` (outputs left in place), else ``slots[r]``
    (bf16 `[>= N*k, D]`); routes whose id is outside ``[0, num_experts)`` add nothing (their slots are not read).
    """
    n, D = out.shape
    k = top_experts.shape[1] if top_experts.dim() == 2 else 1
    if own_rows is None:
        own_rows = torch.full((max(n * k, 1),), -1, dtype=torch.int32, device=out.device)
    y = slots if y is None else y
    block_t, block_d, warps = WEIGHTED_SUM_TILE if compiled_gpu(out.device) else (16, 64, 4)
    weighted_sum_kernel[(-(-n // block_t), -(-D // block_d))](
        y, y.stride(0), slots, slots.stride(0), own_rows, top_experts.contiguous(), router_weights.contiguous(),
        out if shared is None else shared, (out if shared is None else shared).stride(0), out, out.stride(0), n, D,
        num_experts, TOP_K=k, HAS_SHARED=shared is not None, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps)
    return out
