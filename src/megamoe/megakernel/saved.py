"""What the backward reads of a forward pass and what it returns, shared by the composed and the fused backward:
:class:`SavedForward`, :class:`LayerGrads` and the home rank's sums of the d_x slots (:func:`home_sums`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe.ops.expert_weights import QuantizedExperts
from megamoe.ops.weighted_sum import weighted_sum
from megamoe.routing.schedule import PullSchedule


@dataclass(frozen=True)
class SavedForward:
    """What the backward reads of a forward pass (one rank), as plain tensors.

    Attributes:
        h: bf16 `[ring_rows, 2I]` the pre-activation of the routed rows of the minibatches the ring still holds
            (routed row t at ring row t).
        shared_h: bf16 `[N, 2Is]` the shared experts' pre-activation over this rank's tokens (`[0, 0]` without).
        schedule: the pass's pull schedule (its own_rows is not needed).
        ring_x, ring_scale: FP8 precisions: the ring's E4M3 routed rows `[ring_rows, D]` and their scales along
            D (routed row t at ring row t), the gate/up wgrad's x; None with BF16 (x is pulled again, or one rank
            reads it by token).
        experts_q: FP8 precisions: the step's weight pack the forward ran on, when its caller gave one
            (:func:`~megamoe.ops.expert_weights.quantize_experts`): the replay and the dgrads read it (with
            ``backward=True`` its transposed weights too) instead of quantising the weights again.
    """

    h: torch.Tensor
    shared_h: torch.Tensor
    schedule: PullSchedule
    ring_x: torch.Tensor | None = None
    ring_scale: torch.Tensor | None = None
    experts_q: QuantizedExperts | None = None


@dataclass
class LayerGrads:
    """Gradients of one rank: ``x`` bf16 `[N, D]`, ``router_weights`` fp32 `[N, k]`, this rank's experts
    ``w_gate_up`` `[L, 2I, D]` and ``w_down`` `[L, D, I]` (bf16), the fused shared experts' ``shared_gate_up``
    `[2Is, D]` and ``shared_down`` `[D, Is]` (None without), the experts' biases ``b_gate_up`` `[L, 2I]` and
    ``b_down`` `[L, D]` (None without)."""

    x: torch.Tensor
    router_weights: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    shared_gate_up: torch.Tensor | None
    shared_down: torch.Tensor | None
    b_gate_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None


def home_sums(d_x_slots: torch.Tensor, d_router_slots: torch.Tensor, top_experts: torch.Tensor, n: int, k: int,
              D: int, shared_dx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's gradients from the slots its routes' rows were pushed to: ``d_x[i] = sum_j slot[i*k + j]``
    in fixed order in FP32 (-1 routes masked) plus the shared experts' ``d_x``, rounded once to bf16 (one
    launch of the forward's weighted sum with weights 1: ``1 * slot`` is exact); the router-weight gradients
    of its routes (0 for -1 routes)."""
    valid = top_experts >= 0
    d_x = torch.empty(n, D, dtype=torch.bfloat16, device=top_experts.device)
    if n:
        ones = torch.ones(n, k, dtype=torch.float32, device=top_experts.device)
        # every valid id is < 2**31 - 1 (ids were checked, or recorded as errors, before any slot was pushed)
        weighted_sum(d_x, d_x_slots, top_experts, ones, torch.iinfo(torch.int32).max,
                     shared=None if shared_dx is None else shared_dx.contiguous())
    d_router = torch.where(valid, d_router_slots[: n * k].view(n, k), 0.0)
    return d_x, d_router
