"""`megamoe.moe`: the MoE layer over an expert-parallel world as a differentiable function.

The forward is one megakernel pass, the backward another (:mod:`megamoe.megakernel.backward`; the
standalone kernels composed, :mod:`megamoe.megakernel.backward_composed`, are its ablation): gradients of
x, the router weights, this rank's experts and every shared expert. Both are torch.library ops (:mod:`megamoe.autograd.ops`), so
``torch.compile(fullgraph=True)`` traces through them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megamoe import checks
from megamoe.autograd import ops
from megamoe.autograd.worlds import handle_of
from megamoe.config import SWIGLU, Activation
from megamoe.inputs import MoEInputs, gather_inputs
from megamoe.ops.expert_weights import QuantizedExperts
from megamoe.parallel.world import EPWorld
from megamoe.planner import KernelConfig
from megamoe.precision import check_precision


def moe(
    world: EPWorld,
    x: torch.Tensor | MoEInputs,
    top_experts: torch.Tensor | None = None,
    router_weights: torch.Tensor | None = None,
    w_gate_up: torch.Tensor | None = None,
    w_down: torch.Tensor | None = None,
    shared: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    activation: Activation = SWIGLU,
    *,
    precision: str = "bf16",
    config: KernelConfig | None = None,
    max_tokens: int | None = None,
    check: bool = True,
    fused_backward: bool = False,
    check_finite: bool = False,
    experts_q: QuantizedExperts | None = None,
    num_experts: int | None = None,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE layer's output for this rank's tokens, differentiable in x, the router weights, the experts.

    Collective: every rank of ``world`` calls it, with its own tokens and its own experts.

    Args:
        world: the EP group (R ranks).
        x, top_experts, router_weights, w_gate_up, w_down, shared, activation, b_gate_up, b_down: the layer's
            inputs (:class:`megamoe.MoEInputs`, every tensor bfloat16 but the ids and router weights), one by one
            or as one ``MoEInputs`` in place of ``x``.
        precision: the routed experts' precision, ``bf16``, ``fp8-block`` or ``mxfp8``; the FP8 backwards run
            E4M3 dgrads and wgrads (docs/design.md, Precision).
        config: the megakernel's knobs (default: the planner's).
        max_tokens: the group's largest token count; None finds it with an all-reduce MAX (a host sync), which
            ``torch.compile`` cannot trace: give it there.
        check: validate the expert ids and read the kernels' error words (host syncs).
        fused_backward: the backward megakernel, or (default) the standalone kernels composed: the same bits.
            On one H100 the composed kernels ran 2.2x faster than the megakernel, whose weight-gradient tiles run
            at 47 % of the Gluon kernels' per-SM rate (benchmarks/results/2026-12-05-backward-ring): the default
            until the megakernel's tiles reach 95 %. One rank always composes them (nothing to overlap).
        check_finite: raise ValueError naming the first token whose x or router weights are not finite (a host
            sync). Without it such a token's rows stay non-finite, as in the reference (docs/errors.md).
        experts_q: FP8 precisions: ``quantize_experts(w_gate_up, w_down, precision, backward=True)``, made once
            per optimizer step (:mod:`megamoe.ops.expert_weights`): the forward and the backward read it instead
            of quantising the weights in every call (kimi-k2 at EP 2: ~8.5 ms each). ValueError when it was made
            from other tensors, in another precision, or before the weights last changed in place. ``megamoe.MoE``
            keeps one for its weights.
        num_experts: E, the layer's routed experts over all ranks, when the caller knows it: ValueError unless
            the ranks' weights hold E between them (a rank given every expert's weights would otherwise run a
            layer of R·E experts).

    Returns bf16 `[N, D]`. Gradients are computed where ``requires_grad`` asks for them.
    """
    check_precision(precision)
    compiling = torch.compiler.is_compiling()
    if check_finite and compiling:
        raise ValueError("check_finite reads the inputs on the host: torch.compile cannot trace it")
    inputs = gather_inputs(x, top_experts, router_weights, w_gate_up, w_down, shared, activation, b_gate_up, b_down)
    n = inputs.validate(dtypes="bf16", world=world, num_experts=num_experts, check_ids=check and not compiling,
                        finite=check_finite).tokens
    if precision != "bf16" and fused_backward:
        raise ValueError(f"fused_backward=True runs BF16 experts: the {precision} backward runs the standalone "
                         f"kernels composed (fused_backward=False, the default)")
    if experts_q is not None:
        if precision == "bf16":
            raise ValueError("experts_q is for the FP8 precisions; this layer runs bf16 experts")
        if not isinstance(experts_q, QuantizedExperts):
            raise ValueError(f"experts_q must be a QuantizedExperts (quantize_experts), got {type(experts_q).__name__}")
        if not compiling:  # the stamps are host reads of the weights' versions
            experts_q.check_source(inputs.w_gate_up, inputs.w_down, precision)
    if max_tokens is None:
        if compiling:
            raise ValueError("torch.compile needs max_tokens (the group's largest token count) given to moe() or "
                             "megamoe.MoE(max_tokens=...): finding it is an all-reduce with a host sync")
        max_tokens = world.largest(n)  # NOTE: host sync
    checks.check_max_tokens(max_tokens, n)
    i = inputs
    return ops.run_layer(ops.LayerInputs(
        x=i.x, top_experts=i.top_experts, router_weights=i.router_weights, w_gate_up=i.w_gate_up, w_down=i.w_down,
        b_gate_up=i.b_gate_up, b_down=i.b_down, shared_gate_up=[gu for gu, _ in i.shared],
        shared_down=[dn for _, dn in i.shared], activation=i.activation.spec, world=handle_of(world),
        max_tokens=max_tokens, precision=precision, config=ops.config_string(config), check=check,
        fused_backward=bool(fused_backward), experts_q=[] if experts_q is None else experts_q.tensors()))
