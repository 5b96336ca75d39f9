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

#: Activation kinds, in the order of their kernel ids (``megamoe.kernels.activation``'s ACT values).
ACTIVATIONS = ("swiglu", "swiglu-clamped", "gpt-oss", "geglu")
#: gpt-oss's defaults (its HF implementation: ``alpha = 1.702``, ``swiglu_limit = 7.0``).
GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0


@dataclass(frozen=True)
class Activation:
    """The experts' gated activation of ``h = [gate | up]`` (routed and shared experts alike).

    Attributes:
        kind: ``swiglu`` (``silu(gate) * up``), ``swiglu-clamped`` (gate clamped to ``max=limit`` and up to
            ``[-limit, limit]`` first), ``gpt-oss`` (the same clamps, then ``gate * sigmoid(alpha * gate) *
            (up + 1)``) or ``geglu`` (``gelu(gate) * up``, the exact erf GELU).
        limit: the clamp of ``swiglu-clamped`` (required) and ``gpt-oss`` (default 7.0); None for the others.
        alpha: gpt-oss's sigmoid scale (default 1.702); None for the others.

    ``megamoe.reference.layer.activate`` is its math in torch, ``megamoe.kernels.activation`` in the kernels.
    """

    kind: str = "swiglu"
    limit: float | None = None
    alpha: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"Activation.kind must be one of {', '.join(ACTIVATIONS)}, got {self.kind!r}")
        if self.kind == "gpt-oss":
            object.__setattr__(self, "limit", GPT_OSS_LIMIT if self.limit is None else self.limit)
            object.__setattr__(self, "alpha", GPT_OSS_ALPHA if self.alpha is None else self.alpha)
        clamped = self.kind in ("swiglu-clamped", "gpt-oss")
        for name, value, used in (("limit", self.limit, clamped), ("alpha", self.alpha, self.kind == "gpt-oss")):
            if not used:
                if value is not None:
                    raise ValueError(f"Activation {self.kind!r} takes no {name}, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"Activation {self.kind!r} needs a positive finite {name}, got {value!r}")
            object.__setattr__(self, name, float(value))

    @classmethod
    def parse(cls, text: str) -> Activation:
        """``kind[:limit[:alpha]]``, as :attr:`spec` writes it (``swiglu``, ``swiglu-clamped:7``, ``gpt-oss``,
        ``gpt-oss:7:1.702``, ``geglu``)."""
        kind, *numbers = str(text).split(":")
        if len(numbers) > 2:
            raise ValueError(f"an activation is kind[:limit[:alpha]], got {text!r}")
        try:
            values = [float(v) for v in numbers]
        except ValueError:
            raise ValueError(f"an activation is kind[:limit[:alpha]] with numbers, got {text!r}") from None
        return cls(kind, *values)

    @property
    def spec(self) -> str:
        """The text :meth:`parse` reads back."""
        return ":".join([self.kind] + [f"{v:g}" for v in (self.limit, self.alpha) if v is not None])

    @property
    def kernel_id(self) -> int:
        """The kernels' ACT constexpr."""
        return ACTIVATIONS.index(self.kind)

    @property
    def kernel_limit(self) -> float:
        """The kernels' runtime ``limit`` (0.0 where the kind has none: never read)."""
        return 0.0 if self.limit is None else self.limit

    @property
    def kernel_alpha(self) -> float:
        """The kernels' runtime ``alpha`` (1.0 where the kind has none: never read)."""
        return 1.0 if self.alpha is None else self.alpha


SWIGLU = Activation()


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer: ``out(x) = sum_s Shared_s(x) + sum_j w_j * Expert_{e_j}(x)``.

    Attributes:
        hidden: D, the model dimension; a multiple of 64.
        intermediate: I, each routed expert's intermediate size.
        num_experts: E, routed experts in the whole layer (across all ranks).
        top_k: k, routes per token.
        shared: intermediate size of each shared expert (empty = none).
        activation: the experts' gated activation (:class:`Activation`; default SwiGLU).
        expert_bias: the routed experts carry biases ``b_gate_up [2I]`` and ``b_down [D]`` (gpt-oss).
    """

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    shared: tuple[int, ...] = field(default=())
    activation: Activation = SWIGLU
    expert_bias: bool = False

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
        if not isinstance(self.activation, Activation):
            raise ValueError(f"MoEConfig.activation must be an Activation, got {self.activation!r}")
        if not isinstance(self.expert_bias, bool):
            raise ValueError(f"MoEConfig.expert_bias must be a bool, got {self.expert_bias!r}")

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
    # gpt-oss's activation (limit 7, alpha 1.702) and expert biases
    "gpt-oss-120b": MoEConfig(hidden=2880, intermediate=2880, num_experts=128, top_k=4,
                              activation=Activation("gpt-oss"), expert_bias=True),
    # SonicMoE's published H100 shapes (arXiv 2512.14080): its 7B (T 24576), 30B-style (T 32768) and 120B
    "sonic-7b": MoEConfig(hidden=1536, intermediate=256, num_experts=128, top_k=8),
    "sonic-d4096": MoEConfig(hidden=4096, intermediate=512, num_experts=128, top_k=8),
    "sonic-120b": MoEConfig(hidden=4096, intermediate=2048, num_experts=64, top_k=4),
    "tiny": MoEConfig(hidden=256, intermediate=128, num_experts=8, top_k=2, shared=(128,)),
}


#: The keys of a shape given as text (``parse_shape``), in the order ``shape_spec`` writes them.
SHAPE_KEYS = ("hidden", "intermediate", "experts", "top_k", "shared", "activation", "bias")


def preset(name: str) -> MoEConfig:
    """The layer called ``name``: a preset, or a shape as text (``hidden=2048,intermediate=768,experts=128,
    top_k=8[,shared=1024+512][,activation=gpt-oss][,bias=1]``, :func:`parse_shape`); ValueError lists the known
    presets otherwise."""
    if isinstance(name, str) and "=" in name:
        return parse_shape(name)
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}, or a shape as "
                         "hidden=..,intermediate=..,experts=..,top_k=..[,shared=..][,activation=..][,bias=1]"
                         ) from None


def parse_shape(text: str) -> MoEConfig:
    """A layer from ``key=value`` pairs separated by commas: hidden (D), intermediate (I), experts (E), top_k (k),
    optional shared (the shared experts' intermediate sizes joined by ``+``), activation
    (``kind[:limit[:alpha]]``, :meth:`Activation.parse`) and bias (``1``: the routed experts carry biases, ``0``:
    none, the default)."""
    values = {}
    for item in str(text).split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or key not in SHAPE_KEYS or key in values:
            raise ValueError(f"a shape is key=value pairs of {', '.join(SHAPE_KEYS)} (each once), got {text!r}")
        values[key] = value.strip()
    missing = [key for key in SHAPE_KEYS[:4] if key not in values]
    if missing:
        raise ValueError(f"a shape needs {', '.join(missing)}, got {text!r}")
    if values.get("bias", "0") not in ("0", "1"):
        raise ValueError(f"a shape's bias is 0 or 1, got {values['bias']!r} in {text!r}")
    try:
        return MoEConfig(hidden=int(values["hidden"]), intermediate=int(values["intermediate"]),
                         num_experts=int(values["experts"]), top_k=int(values["top_k"]),
                         shared=tuple(int(v) for v in values["shared"].split("+")) if values.get("shared") else (),
                         activation=Activation.parse(values["activation"]) if "activation" in values else SWIGLU,
                         expert_bias=values.get("bias") == "1")
    except ValueError as exc:
        raise ValueError(f"bad shape {text!r}: {exc}") from None


def shape_spec(cfg: MoEConfig) -> str:
    """``cfg`` as the text :func:`parse_shape` reads."""
    text = f"hidden={cfg.hidden},intermediate={cfg.intermediate},experts={cfg.num_experts},top_k={cfg.top_k}"
    if cfg.shared:
        text += ",shared=" + "+".join(str(s) for s in cfg.shared)
    if cfg.activation != SWIGLU:
        text += f",activation={cfg.activation.spec}"
    if cfg.expert_bias:
        text += ",bias=1"
    return text


def hf_config_shape(config: dict) -> MoEConfig:
    """The MoE layer of a HuggingFace transformers model config (its ``config.json`` as a dict): Qwen2/3-MoE,
    DeepSeek-V3, Mixtral, gpt-oss, OLMoE, GLM-4.5-MoE and Llama-4 (text) name the same things differently. The
    experts' activation: gpt-oss's own (its ``swiglu_limit``), else SwiGLU (clamped where the config names a
    ``swiglu_limit``); gpt-oss's experts carry biases. ValueError names what is missing."""
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
    if cfg.get("model_type") == "gpt_oss":
        activation = Activation("gpt-oss", limit=None if limit is None else float(limit))
    else:
        activation = SWIGLU if limit is None else Activation("swiglu-clamped", limit=float(limit))
    return MoEConfig(hidden=int(hidden), intermediate=int(intermediate), num_experts=int(experts), top_k=int(top_k),
                     shared=shared, activation=activation, expert_bias=cfg.get("model_type") == "gpt_oss")
