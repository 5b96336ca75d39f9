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


#: The keys of a shape given as text (``parse_shape``), in the order ``shape_spec`` writes them.
SHAPE_KEYS = ("hidden", "intermediate", "experts", "top_k", "shared", "limit")


def preset(name: str) -> MoEConfig:
    """The layer called ``name``: a preset, or a shape as text (``hidden=2048,intermediate=768,experts=128,
    top_k=8[,shared=1024+512][,limit=7]``, :func:`parse_shape`); ValueError lists the known presets otherwise."""
    if isinstance(name, str) and "=" in name:
        return parse_shape(name)
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}, or a shape as "
                         f"hidden=..,intermediate=..,experts=..,top_k=..[,shared=..][,limit=..]") from None


def parse_shape(text: str) -> MoEConfig:
    """A layer from ``key=value`` pairs separated by commas: hidden (D), intermediate (I), experts (E), top_k (k),
    optional shared (the shared experts' intermediate sizes joined by ``+``) and limit (the SwiGLU clamp)."""
    values = {}
    for item in str(text).split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or key not in SHAPE_KEYS or key in values:
            raise ValueError(f"a shape is key=value pairs of {', '.join(SHAPE_KEYS)} (each once), got {text!r}")
        values[key] = value.strip()
    missing = [key for key in SHAPE_KEYS[:4] if key not in values]
    if missing:
        raise ValueError(f"a shape needs {', '.join(missing)}, got {text!r}")
    try:
        return MoEConfig(hidden=int(values["hidden"]), intermediate=int(values["intermediate"]),
                         num_experts=int(values["experts"]), top_k=int(values["top_k"]),
                         shared=tuple(int(v) for v in values["shared"].split("+")) if values.get("shared") else (),
                         swiglu_limit=float(values["limit"]) if "limit" in values else None)
    except ValueError as exc:
        raise ValueError(f"bad shape {text!r}: {exc}") from None


def shape_spec(cfg: MoEConfig) -> str:
    """``cfg`` as the text :func:`parse_shape` reads."""
    text = f"hidden={cfg.hidden},intermediate={cfg.intermediate},experts={cfg.num_experts},top_k={cfg.top_k}"
    if cfg.shared:
        text += ",shared=" + "+".join(str(s) for s in cfg.shared)
    if cfg.swiglu_limit is not None:
        text += f",limit={cfg.swiglu_limit:g}"
    return text


def hf_config_shape(config: dict) -> MoEConfig:
    """The MoE layer of a HuggingFace transformers model config (its ``config.json`` as a dict): Qwen2/3-MoE,
    DeepSeek-V3, Mixtral, gpt-oss, OLMoE, GLM-4.5-MoE and Llama-4 (text) name the same things differently. The
    experts' activation is taken as SwiGLU (gpt-oss: clamped at its ``swiglu_limit``; its alpha and biases are not
    modelled); ValueError names what is missing."""
    cfg = config.get("text_config", config)  # Llama-4 nests the language model's
    def first(*keys):
        for key in keys:
            if cfg.get(key) is not None:
                return cfg[key]
        return None

    hidden = first("hidden_size")
    intermediate = first("moe_intermediate_size", "intermediate_size")
    experts = first("num_experts", "n_routed_experts", "num_local_experts")
    top_k = first("num_experts_per_tok", "moe_topk")
    missing = [name for name, v in (("hidden_size", hidden), ("an expert intermediate size", intermediate),
                                    ("an expert count", experts), ("num_experts_per_tok", top_k)) if v is None]
    if missing:
        raise ValueError(f"the config names no {', '.join(missing)}: not a MoE model config megamoe reads")
    shared = ()
    if first("shared_expert_intermediate_size"):  # Qwen2-MoE
        shared = (int(cfg["shared_expert_intermediate_size"]),)
    elif first("n_shared_experts"):  # DeepSeek-V3, GLM-4.5: each the routed experts' size
        shared = (int(cfg["n_shared_experts"]) * int(intermediate),)
    elif cfg.get("model_type") == "llama4_text" and first("intermediate_size") and first("intermediate_size_mlp"):
        shared = (int(cfg["intermediate_size"]),)
    limit = first("swiglu_limit")
    return MoEConfig(hidden=int(hidden), intermediate=int(intermediate), num_experts=int(experts), top_k=int(top_k),
                     shared=shared, swiglu_limit=float(limit) if limit is not None else None)
