"""Llama-4's ``Llama4TextMoe`` on megamoe (used by :func:`megamoe.adapters.hf.patch`).

transformers runs every expert on every token, each on its own scaled input: with ``s [N, E]`` the sigmoid of
the router's top-k logits (0 elsewhere), ``out = shared_expert(x) + sum_e experts[e](s[:, e] * x)``. The router
score scales the expert's INPUT, and SwiGLU is not linear (``silu(s*g) * (s*u) != s * silu(g) * u``), so this is
not megamoe's ``sum_j w_j * expert_j(x)``. It maps exactly all the same: an unrouted expert sees ``0 * x`` and
gives ``SwiGLU(0) = 0`` (no output, no gradient), so ``out = shared_expert(x) + sum_j expert_{e_j}(s_j * x)``
over the token's k routed experts — megamoe's layer on the rows ``s_j * x`` (one per route, each routed to its
one expert, weight 1), summed per token. The scaling stays in autograd outside the layer, so the router's
gradient is the model's. Llama-4 routes top-1 (one row per token: the layer sees N rows); top-k > 1 sends k rows
per token (k x the dispatch; :func:`~megamoe.adapters.hf.patch`'s ``max_tokens`` still counts tokens).

transformers stores these experts transposed (``gate_up_proj [E, D, 2I]``, gate columns then up;
``down_proj [E, I, D]``). :class:`Llama4ExpertParallelExperts` is an
:class:`~megamoe.adapters.hf_experts.ExpertParallelExperts` (so :mod:`megamoe.adapters.fsdp` and the training loop find
it): it holds its slice as every patched experts module does, ``gate_up_proj [L, 2I, D]`` and
``down_proj [L, D, I]``, transposed once at patch time, and its ``state_dict`` / ``load_state_dict`` speak
transformers' layout (all E experts; load also takes this rank's slice, in transformers' layout).
"""

from __future__ import annotations

import torch
from torch import nn

from megamoe.adapters.hf_experts import ExpertParallelExperts, activation_problem
from megamoe.parallel.world import EPWorld

#: The transformers class this module patches.
BLOCK = "Llama4TextMoe"


def check_experts(name: str, experts: nn.Module) -> None:
    """ValueError unless ``experts`` is a Llama4TextExperts layout megamoe runs (SwiGLU, ``[E, D, 2I]`` and
    ``[E, I, D]``)."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        raise ValueError(f"{name}: its experts have no gate_up_proj / down_proj tensors")
    problem = activation_problem(experts)
    if problem:
        raise ValueError(f"{name}: megamoe runs SwiGLU experts; these have {problem}")
    E, D, two_i = gate_up.shape
    if tuple(down.shape) != (E, two_i // 2, D) or two_i % 2:
        raise ValueError(f"{name}: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
                         f"Llama-4's [E, D, 2I] and [E, I, D]")


class Llama4ExpertParallelExperts(ExpertParallelExperts):
    """This rank's slice of a ``Llama4TextExperts`` (``gate_up_proj [L, 2I, D]``, ``down_proj [L, D, I]`` in the
    model's dtype); ``forward(x [N, D], ids [N, k], scores [N, k])`` returns ``sum_j expert_{ids_j}(scores_j * x)``
    ``[N, D]`` in x's dtype (the experts run in BF16)."""

    def __init__(self, experts: nn.Module, world: EPWorld, *, top_k: int, max_tokens: int | None = None,
                 **options):
        # the layer sees k rows per token
        super().__init__(experts, world, transposed=True, **options,
                         max_tokens=None if max_tokens is None else max_tokens * top_k)
        self.top_k = top_k

    def forward(self, x: torch.Tensor, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        N, D = x.shape
        k = ids.shape[1]
        rows = (x.unsqueeze(1) * scores.to(x.dtype).unsqueeze(-1)).reshape(N * k, D)  # s_j * x: Llama-4's input
        ones = torch.ones(N * k, 1, dtype=torch.float32, device=x.device)
        out = self.run(rows, ids.reshape(N * k, 1), ones, self.gate_up_proj, self.down_proj)
        return out.view(N, k, D).sum(dim=1) if k > 1 else out


class Llama4ExpertParallelMoe(nn.Module):
    """``Llama4TextMoe`` with its routed experts on megamoe: the model's own router (``Llama4Router``: top-k
    logits, then sigmoid) and shared expert, under the block's names (so ``state_dict`` keys are the model's)."""

    def __init__(self, block: nn.Module, world: EPWorld, **options):
        super().__init__()
        self.top_k, self.hidden_dim, self.num_experts = block.top_k, block.hidden_dim, block.num_experts
        self.router = block.router
        self.shared_expert = block.shared_expert
        self.experts = Llama4ExpertParallelExperts(block.experts, world, top_k=block.top_k, **options)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_scores, router_logits = self.router(hidden_states)  # [N, E]: sigmoid(top-k logits), 0 elsewhere
        # the k experts the router scored (topk of the scores, not of the logits: whatever the router did, the
        # model's experts beyond these see 0 * x and add nothing)
        scores, ids = torch.topk(router_scores, self.top_k, dim=1)
        out = self.shared_expert(hidden_states) + self.experts(hidden_states, ids, scores)
        return out, router_logits
