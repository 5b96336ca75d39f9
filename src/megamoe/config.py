"""Shapes of a Mixture-of-Experts layer and the named model presets.

Legend used across megamoe (shape suffixes such as ``x_ND`` follow it):

    N  tokens on a rank          D  model (hidden) dim
    k  routes per token (top-k)  I  routed expert intermediate dim
    E  routed experts            R  ranks in the expert-parallel group
    L  local experts = E / R     Is a shared expert's intermediate dim
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: D must be a multiple of this (16-byte rows for bf16 and fp8, whole 32/64 blocks).
HIDDEN_MULTIPLE = 64


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer: ``out(x) = sum_s Shared_s(x) + sum_j w_j * Expert_{e_j}(x)``.

    Attributes:
        hidden: D, the model dimension; a multiple of 64.
        intermediate: I, each routed expert's intermediate size.
        num_experts: E, routed experts in the whole layer (across all ranks).
        top_k: k, routes per token.
        shared: intermediate size of each shared expert (empty = none).
        swiglu_limit: if set, SwiGLU clamps gate to ``max=limit`` and up to
            ``[-limit, limit]`` before ``silu(gate) * up``.
    """

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    shared: tuple[int, ...] = field(default=())
    swiglu_limit: float | None = None

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "num_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        if self.hidden % HIDDEN_MULTIPLE:
            raise ValueError(
                f"MoEConfig.hidden (D) must be a multiple of {HIDDEN_MULTIPLE}, got {self.hidden}"
            )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k ({self.top_k}) cannot exceed num_experts ({self.num_experts})"
            )
        shared = tuple(self.shared)
        for size in shared:
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"MoEConfig.shared holds a bad intermediate size {size!r}")
        object.__setattr__(self, "shared", shared)
        limit = self.swiglu_limit
        if limit is not None and (isinstance(limit, bool) or not (isinstance(limit, (int, float))
                                                                  and math.isfinite(limit) and limit > 0)):
            raise ValueError(f"MoEConfig.swiglu_limit must be a positive finite number, got {limit!r}")

    def experts_per_rank(self, ep: int) -> int:
        """L for an EP group of ``ep`` ranks; E must divide evenly."""
        if not isinstance(ep, int) or ep < 1:
            raise ValueError(f"ep must be a positive int, got {ep!r}")
        if self.num_experts % ep:
            raise ValueError(f"num_experts ({self.num_experts}) is not divisible by ep ({ep})")
        return self.num_experts // ep

    def routed_flops(self, routes: int) -> int:
        """Forward FLOPs of the routed experts for ``routes`` (token, expert) pairs."""
        return 2 * routes * self.hidden * self.intermediate * 3

    def shared_flops(self, tokens: int) -> int:
        """Forward FLOPs of the shared experts for ``tokens`` tokens."""
        return sum(2 * tokens * self.hidden * size * 3 for size in self.shared)


#: The shapes of the models the layer is measured on (docs/performance.md).
PRESETS: dict[str, MoEConfig] = {
    "kimi-k2": MoEConfig(hidden=7168, intermediate=2048, num_experts=384, top_k=8, shared=(2048,)),
    "glm-5": MoEConfig(hidden=6144, intermediate=2048, num_experts=256, top_k=8, shared=(2048,)),
    "qwen3.5-397b": MoEConfig(hidden=4096, intermediate=1024, num_experts=512, top_k=10, shared=(1024,)),
    "deepseek-v4-pro": MoEConfig(hidden=7168, intermediate=3072, num_experts=384, top_k=6, shared=(3072,)),
    "mixtral-8x7b": MoEConfig(hidden=4096, intermediate=14336, num_experts=8, top_k=2),
    "deepseek-v3": MoEConfig(hidden=7168, intermediate=2048, num_experts=256, top_k=8, shared=(2048,)),
    "qwen3-30b-a3b": MoEConfig(hidden=2048, intermediate=768, num_experts=128, top_k=8),
    "qwen3-235b-a22b": MoEConfig(hidden=4096, intermediate=1536, num_experts=128, top_k=8),
    # gpt-oss's clamped SwiGLU (limit 7); its alpha-scaled sigmoid and the expert biases are not modelled
    "gpt-oss-120b": MoEConfig(hidden=2880, intermediate=2880, num_experts=128, top_k=4, swiglu_limit=7.0),
    # SonicMoE's published H100 shapes (arXiv 2512.14080): its 7B (T 24576), 30B-style (T 32768) and 120B
    "sonic-7b": MoEConfig(hidden=1536, intermediate=256, num_experts=128, top_k=8),
    "sonic-d4096": MoEConfig(hidden=4096, intermediate=512, num_experts=128, top_k=8),
    "sonic-120b": MoEConfig(hidden=4096, intermediate=2048, num_experts=64, top_k=4),
    "tiny": MoEConfig(hidden=256, intermediate=128, num_experts=8, top_k=2, shared=(128,)),
}


def preset(name: str) -> MoEConfig:
    """The preset called ``name``; ValueError lists the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
