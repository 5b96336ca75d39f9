"""The layer's inputs on one rank as one typed bundle: their description and their validation, written once.

Every implementation of the layer (``megamoe.moe``, ``megamoe_forward``, ``MegaKernel``, the reference, the
baselines) takes the same inputs; :class:`MoEInputs` describes them and :meth:`MoEInputs.validate` is the one
check they all run, parametrised only by what truly differs between them: the dtypes an implementation computes
in, and whether it runs over an expert-parallel world.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from megamoe import checks
from megamoe.config import SWIGLU, Activation

Tensor = torch.Tensor

#: The dtype rules of :meth:`MoEInputs.validate`: ``float`` any float dtype per tensor (the reference),
#: ``same`` every tensor in x's dtype (the baselines), ``bf16`` every tensor bfloat16 (the kernels).
Dtypes = Literal["float", "same", "bf16"]


@dataclass(frozen=True)
class LayerDims:
    """The layer's sizes as its inputs give them (legend in :mod:`megamoe.config`)."""

    tokens: int  # N, this rank's
    hidden: int  # D
    top_k: int  # k
    experts: int  # L, the experts whose weights this rank holds
    intermediate: int  # I


@dataclass(frozen=True)
class MoEInputs:
    """The MoE layer's inputs on one rank (shapes in backticks; legend in :mod:`megamoe.config`).

    Args:
        x: `[N, D]` this rank's tokens, D a multiple of 64; N may differ between ranks, 0 included. bfloat16 for
            the kernels (``moe``, ``megamoe_forward``), any float dtype for the reference, x's dtype the
            baselines' for every weight.
        top_experts: int32/int64 `[N, k]` global expert ids, -1 = no route.
        router_weights: float32 `[N, k]`, applied as given (the caller normalises them) after the experts, on the
            token's home rank, in fixed ``j`` order; their gradient flows back to the router.
        w_gate_up: `[L, 2I, D]` this rank's experts ``rank*L .. rank*L+L-1`` (gate rows, then up rows); I a
            multiple of 8 over an expert-parallel world.
        w_down: `[L, D, I]`.
        shared: shared experts, each ``(w_gate_up [2Is, D], w_down [D, Is])``, replicated on every rank (several
            run as one FFN, ``megamoe.megakernel.forward.fuse_shared``); their gradients cover this rank's tokens
            (reduce them across ranks as for any replicated weight).
        activation: the experts' gated activation (:class:`megamoe.Activation`; default SwiGLU).
        b_gate_up: `[L, 2I]` (gate columns, then up), b_down: `[L, D]`: this rank's experts' optional biases
            (gpt-oss; None: none), added in FP32 to gate/up before the activation and to each expert's output on
            the experts' rank, before its router weight; differentiable (FP32 segment sums over each expert's
            rows). The baselines add them in FP32 after their grouped GEMMs.

    ``shared`` is kept as a tuple. Construction checks nothing: :meth:`validate` does, since what is valid
    depends on the implementation (its dtypes, its world) and one check reads the ids on the host.
    """

    x: Tensor
    top_experts: Tensor
    router_weights: Tensor
    w_gate_up: Tensor
    w_down: Tensor
    shared: Sequence[tuple[Tensor, Tensor]] = ()
    activation: Activation = SWIGLU
    b_gate_up: Tensor | None = None
    b_down: Tensor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shared", tuple(self.shared))

    @property
    def has_biases(self) -> bool:
        return self.b_gate_up is not None or self.b_down is not None

    def tensors(self) -> list:
        """Every tensor argument, shared experts' and biases included (None for a missing bias; anything that is
        not a pair of the shared sequence left out): for checks over all of them before :meth:`validate`."""
        shared = [t for pair in self.shared if isinstance(pair, (tuple, list)) for t in pair]
        return [self.x, self.router_weights, self.w_gate_up, self.w_down, self.b_gate_up, self.b_down, *shared]

    def validate(self, *, dtypes: Dtypes = "float", world=None, num_experts: int | None = None,
                 check_ids: bool = True, finite: bool = False) -> LayerDims:
        """ValueError naming the argument, what it must be and what it got, unless the inputs make a layer.

        Every implementation runs this one path, in this order: the shapes and kinds of x, the routing, the
        routed and shared weights and the activation; every tensor on x's device; the dtypes by ``dtypes``
        (:data:`Dtypes`); the biases (``bf16``: also contiguous, as the kernels read them); with ``world`` (the
        EP group: anything with ``size`` and ``device``) x on its device, at least one local expert, I a
        multiple of 8 and ``num_experts`` = L·R when given; the expert ids in ``[0, E)`` or -1 (E =
        ``num_experts``, else L·R; ``check_ids``: a host sync); ``finite``: no NaN or Inf in x or the router
        weights (a host sync).
        """
        x = self.x
        n, d = checks.check_tokens(x)
        k = checks.check_routing(self.top_experts, self.router_weights, n)
        experts, inter = checks.check_expert_weights(self.w_gate_up, self.w_down, d)
        checks.check_shared(self.shared, d)
        checks.check_activation(self.activation)
        named = [("top_experts", self.top_experts), ("router_weights", self.router_weights),
                 ("w_gate_up", self.w_gate_up), ("w_down", self.w_down)]
        for s, (gate_up, down) in enumerate(self.shared):
            named += [(f"shared[{s}] w_gate_up", gate_up), (f"shared[{s}] w_down", down)]
        for name, t in named:
            if t.device != x.device:
                raise ValueError(f"{name} is on {t.device}, x on {x.device}: every tensor of the layer on one device")
            if name.startswith("shared") and t.dtype not in checks.FLOAT_DTYPES:
                raise ValueError(f"{name} must be a float tensor, got {t.dtype}")
        floats = [("x", x), ("w_gate_up", self.w_gate_up), ("w_down", self.w_down), *named[4:]]
        biases = [(name, b) for name, b in (("b_gate_up", self.b_gate_up), ("b_down", self.b_down)) if b is not None]
        if dtypes == "bf16":
            for name, t in floats:
                if t.dtype != torch.bfloat16:
                    raise ValueError(f"{name} must be bfloat16 (the expert kernels are BF16-only), got {t.dtype}")
        elif dtypes == "same":
            for name, t in floats[1:] + biases:
                if t.dtype != x.dtype:  # its matmuls run in x's dtype
                    raise ValueError(f"{name} is {t.dtype}, x {x.dtype}: the baselines compute in one dtype (x's)")
        elif dtypes != "float":
            raise ValueError(f"dtypes must be 'float', 'same' or 'bf16', got {dtypes!r}")
        checks.check_expert_biases(self.b_gate_up, self.b_down, self.w_gate_up, self.w_down,
                                   kernels=dtypes == "bf16")
        if num_experts is not None:
            checks.check_positive_int("num_experts", num_experts)
        if world is not None:
            if x.device != world.device:
                raise ValueError(f"x is on {x.device}, the world on {world.device}")
            if experts < 1:
                raise ValueError("w_gate_up must hold at least one local expert")
            if num_experts is not None and experts * world.size != num_experts:
                raise ValueError(f"w_gate_up holds {experts} experts on each of the {world.size} ranks, "
                                 f"{experts * world.size} in all, not num_experts={num_experts}: give each rank "
                                 f"only its own {num_experts / world.size:g} experts (rank*L .. rank*L+L-1)")
            if inter % 8:
                raise ValueError(f"the intermediate size I must be a multiple of 8, got {inter}")
        if check_ids:
            checks.check_expert_ids(self.top_experts, num_experts if num_experts is not None
                                    else experts * (1 if world is None else world.size))
        if finite:
            checks.check_finite(x, self.router_weights)
        return LayerDims(n, d, k, experts, inter)


def gather_inputs(x, top_experts, router_weights, w_gate_up, w_down, shared=(), activation: Activation = SWIGLU,
                  b_gate_up=None, b_down=None) -> MoEInputs:
    """A layer function's inputs as one bundle: ``x`` itself when the caller passed a :class:`MoEInputs` there
    (then every other input must be left at its default), else the arguments bundled."""
    if not isinstance(x, MoEInputs):
        return MoEInputs(x, top_experts, router_weights, w_gate_up, w_down, shared, activation, b_gate_up, b_down)
    given = [name for name, value in (("top_experts", top_experts), ("router_weights", router_weights),
                                      ("w_gate_up", w_gate_up), ("w_down", w_down), ("b_gate_up", b_gate_up),
                                      ("b_down", b_down)) if value is not None]
    given += ["shared"] * bool(tuple(shared)) + ["activation"] * (activation != SWIGLU)
    if given:
        raise ValueError(f"the layer's inputs come either as one MoEInputs or one by one: x is a MoEInputs and "
                         f"{', '.join(given)} given too")
    return x
