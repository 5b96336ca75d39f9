"""`megamoe.Router`: a token's experts and their weights, the way MoE models choose them.

    scores  = softmax(x · Wᵀ) or sigmoid(x · Wᵀ)          [N, E], in float32
    chosen  = top-k of (scores + bias)                     bias: per expert, for selection only (DeepSeek-V3's
                                                           auxiliary-loss-free balancing; a buffer, not trained)
    weights = scores[chosen], renormalised to sum 1 over k when asked, times ``scale``

The gate W gets its gradient through the weights (a gather of the scores); the choice itself has none.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SCORES = ("softmax", "sigmoid")


class Router(nn.Module):
    """A linear gate over E experts choosing k per token.

    Args:
        hidden: D. num_experts: E. top_k: k (<= E).
        score: ``softmax`` or ``sigmoid`` of the gate's logits.
        renormalize: divide the k chosen scores by their sum (Qwen's ``norm_topk_prob``, DeepSeek-V3's top-k
            normalisation).
        scale: multiply the weights by this (DeepSeek-V3's ``routed_scaling_factor``).
        selection_bias: keep a per-expert bias (``expert_bias``, zeros) added to the scores when choosing only.
        device, dtype: of the gate (float32 by default: the logits are computed in float32 anyway).

    ``forward(x [N, D])`` returns ``(top_experts int32 [N, k], router_weights float32 [N, k])``.
    Init: the gate ~ N(0, 1/D), from torch's generator (seed it alike on every rank: the router is replicated).
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, score: str = "softmax",
                 renormalize: bool = True, scale: float = 1.0, selection_bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        for name, value in (("hidden", hidden), ("num_experts", num_experts), ("top_k", top_k)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Router {name} must be a positive int, got {value!r}")
        if top_k > num_experts:
            raise ValueError(f"Router top_k ({top_k}) cannot exceed num_experts ({num_experts})")
        if score not in SCORES:
            raise ValueError(f"Router score must be one of {SCORES}, got {score!r}")
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"Router scale must be a positive finite number, got {scale!r}")
        self.top_k, self.score, self.renormalize, self.scale = top_k, score, bool(renormalize), float(scale)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, device=device, dtype=dtype))
        if selection_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.weight.shape[1] ** -0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() != 2 or x.shape[1] != self.weight.shape[1]:
            raise ValueError(f"Router input must be [N, D={self.weight.shape[1]}], got {tuple(x.shape)}")
        logits = x.float() @ self.weight.float().T
        scores = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        choice = scores.detach() if self.expert_bias is None else scores.detach() + self.expert_bias
        top = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, top)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        return top.to(torch.int32), weights * self.scale

    def extra_repr(self) -> str:
        return (f"hidden={self.weight.shape[1]}, num_experts={self.weight.shape[0]}, top_k={self.top_k}, "
                f"score={self.score}, renormalize={self.renormalize}, scale={self.scale}, "
                f"selection_bias={self.expert_bias is not None}")
