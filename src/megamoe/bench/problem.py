"""Seeded layer inputs for one rank of an expert-parallel run.

Every tensor is a function of (seed, what it is) alone, so any EP size sees
the same experts: expert e's weights come from generator ``seed·1e6 + e``
whatever rank holds it, and token inputs from ``seed, rank``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megamoe.config import MoEConfig

ROUTINGS = ("uniform", "zipf", "one-rank")
ZIPF_EXPONENT = 1.2  # ``zipf``'s: the hottest expert ~15x the median at qwen3-30b-a3b's 128 experts


def zipf_exponent(routing: str) -> float | None:
    """The popularity exponent of a zipf routing (``zipf``: :data:`ZIPF_EXPONENT`; ``zipf-A``: A, a number > 0),
    None for the other routings; ValueError for an unknown routing or a bad exponent."""
    if routing in ROUTINGS:
        return ZIPF_EXPONENT if routing == "zipf" else None
    if routing.startswith("zipf-"):
        try:
            exponent = float(routing[len("zipf-"):])
        except ValueError:
            exponent = float("nan")
        if exponent > 0 and exponent != float("inf"):
            return exponent
    raise ValueError(f"routing must be one of {', '.join(ROUTINGS)} or zipf-A (A > 0: the popularity exponent, "
                     f"zipf's is {ZIPF_EXPONENT}), got {routing!r}")


@dataclass
class RankProblem:
    """One rank's share of a layer problem.

    Attributes:
        x: `[N, D]` tokens. top_experts: int32 `[N, k]` (-1 = no route).
        router_weights: float32 `[N, k]`, normalised over each token's routes.
        w_gate_up: `[L, 2I, D]` and w_down: `[L, D, I]` for experts rank·L .. rank·L+L-1.
        shared: ``(w_gate_up [2Is, D], w_down [D, Is])`` per shared expert (replicated).
        d_out: `[N, D]` upstream gradient for the backward.
        b_gate_up, b_down: the experts' biases `[L, 2I]` and `[L, D]` where the layer has them
            (``MoEConfig.expert_bias``), else None.
    """

    config: MoEConfig
    rank: int
    ranks: int
    x: torch.Tensor
    top_experts: torch.Tensor
    router_weights: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    shared: list[tuple[torch.Tensor, torch.Tensor]]
    d_out: torch.Tensor
    b_gate_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.x.shape[0]

    @property
    def first_expert(self) -> int:
        return self.rank * self.w_gate_up.shape[0]


def _generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _route(cfg: MoEConfig, n: int, rank: int, ranks: int, routing: str, drop: float, g, device) -> torch.Tensor:
    e, k = cfg.num_experts, cfg.top_k
    exponent = zipf_exponent(routing)
    if routing == "uniform":
        scores = torch.rand(n, e, generator=g, device=device)
    elif exponent is not None:  # expert popularity ~ 1 / (rank of expert)^exponent, a random permutation of experts
        popularity = torch.arange(1, e + 1, device=device, dtype=torch.float32).pow(-exponent)
        popularity = popularity[torch.randperm(e, generator=g, device=device)]
        scores = torch.rand(n, e, generator=g, device=device).log() / popularity  # Gumbel-top-k sampling
    elif routing == "one-rank":  # every token to the experts of one rank (the next one)
        if k > e // ranks:
            raise ValueError(f"routing 'one-rank' needs k <= E/R, got k={k}, E/R={e // ranks}")
        scores = torch.rand(n, e, generator=g, device=device)
        target = (rank + 1) % ranks
        mask = torch.zeros(e, dtype=torch.bool, device=device)
        mask[target * (e // ranks) : (target + 1) * (e // ranks)] = True
        scores = torch.where(mask, scores, -1.0)
    else:  # zipf_exponent refused any other
        raise AssertionError(routing)
    top = scores.topk(k, dim=1).indices.to(torch.int32)
    if drop > 0:
        top = torch.where(torch.rand(n, k, generator=g, device=device) < drop, -1, top)
    return top


def make_problem(
    cfg: MoEConfig,
    rank: int,
    ranks: int,
    tokens: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
    routing: str = "uniform",
    drop: float = 0.0,
) -> RankProblem:
    """Inputs of rank ``rank`` of ``ranks`` with ``tokens`` tokens; ``drop`` = share of -1 routes."""
    device = torch.device(device)
    experts = cfg.experts_per_rank(ranks)
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    d, i = cfg.hidden, cfg.intermediate
    g = _generator(device, seed * 1_000_003 + 7919 * rank + 1)
    x = torch.randn(tokens, d, generator=g, device=device).to(dtype)
    top = _route(cfg, tokens, rank, ranks, routing, drop, g, device)
    logits = torch.randn(tokens, cfg.top_k, generator=g, device=device)
    weights = torch.where(top >= 0, logits, -math.inf).softmax(dim=1).nan_to_num(0.0)
    d_out = torch.randn(tokens, d, generator=g, device=device).to(dtype)

    w_gate_up = torch.empty(experts, 2 * i, d, dtype=dtype, device=device)
    w_down = torch.empty(experts, d, i, dtype=dtype, device=device)
    for local in range(experts):
        ge = _generator(device, seed * 1_000_000 + rank * experts + local)
        w_gate_up[local] = torch.randn(2 * i, d, generator=ge, device=device) / math.sqrt(d)
        w_down[local] = torch.randn(d, i, generator=ge, device=device) / math.sqrt(i)
    shared = []
    for s, size in enumerate(cfg.shared):
        gs = _generator(device, seed * 1_000_000 + 999_000 + s)
        shared.append((
            (torch.randn(2 * size, d, generator=gs, device=device) / math.sqrt(d)).to(dtype),
            (torch.randn(d, size, generator=gs, device=device) / math.sqrt(size)).to(dtype),
        ))
    b_gate_up = b_down = None
    if cfg.expert_bias:  # of the order of the products' own spread, so that a wrong bias shows
        gb = _generator(device, seed * 1_000_000 + 998_000 + rank)
        b_gate_up = (0.5 * torch.randn(experts, 2 * i, generator=gb, device=device)).to(dtype)
        b_down = (0.5 * torch.randn(experts, d, generator=gb, device=device)).to(dtype)
    return RankProblem(cfg, rank, ranks, x, top, weights.float(), w_gate_up, w_down, shared, d_out, b_gate_up, b_down)
