"""The reference layer run over an expert-parallel group (the oracle at EP > 1).

The layer is a sum over experts, so each rank evaluates
:func:`megamoe.reference.moe_forward_backward` for its own experts on every
rank's tokens (gathered with plain collectives) and the per-rank shares are
summed at each token's home rank in rank order. Nothing here is under test:
it is the pure-PyTorch math plus an exchange of whole tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from megamoe.config import SWIGLU, Activation
from megamoe.inputs import MoEInputs, gather_inputs
from megamoe.parallel.world import EPWorld
from megamoe.reference.layer import compute_dtype, moe_forward_backward


def _gather_rows(world: EPWorld, t: torch.Tensor, rows: int, fill: float = 0) -> torch.Tensor:
    """Every rank's ``t`` padded to ``rows`` rows, stacked: `[R * rows, ...]`."""
    padded = t.new_full((rows,) + tuple(t.shape[1:]), fill)
    padded[: t.shape[0]] = t
    out = padded.new_empty((world.size * rows,) + tuple(t.shape[1:]))
    dist.all_to_all_single(out, padded.repeat((world.size,) + (1,) * (t.dim() - 1)), group=world.group)
    return out


def _sum_home(world: EPWorld, partial: torch.Tensor, rows: int, mine: int) -> torch.Tensor:
    """Send block r of ``partial`` (`[R * rows, ...]`) to rank r; sum what arrives in rank order."""
    arrived = torch.empty_like(partial)
    dist.all_to_all_single(arrived, partial.contiguous(), group=world.group)
    return arrived.view((world.size, rows) + tuple(partial.shape[1:])).sum(0)[:mine]


def ep_reference_forward_backward(world: EPWorld, p, *, with_grads: bool = True) -> tuple[torch.Tensor, dict]:
    """Output and gradients of the layer for rank ``world.rank``'s tokens and experts.

    ``p`` is this rank's problem: anything with the fields of ``megamoe.bench.problem.RankProblem`` (config,
    x, top_experts, router_weights, w_gate_up, w_down, shared, d_out, tokens, first_expert; optional b_gate_up and
    b_down, this rank's expert biases).

    Returns ``(out [N, D] in the compute dtype, grads)`` (grads empty without ``with_grads``); grads as in
    :func:`moe_forward_backward`: ``x`` and ``router_weights`` for this
    rank's tokens, ``w_gate_up`` / ``w_down`` (and ``b_gate_up`` / ``b_down`` when given) for its experts,
    ``shared``.
    """
    biases = dict(b_gate_up=getattr(p, "b_gate_up", None), b_down=getattr(p, "b_down", None))
    cfg = p.config
    n = p.tokens
    rows = max(world.all_gather_object(n))
    cdt = compute_dtype(p.x.dtype)
    x_all = _gather_rows(world, p.x.to(cdt), rows)
    top_all = _gather_rows(world, p.top_experts, rows, fill=-1)
    rw_all = _gather_rows(world, p.router_weights, rows)
    d_out_all = _gather_rows(world, p.d_out.to(cdt), rows) if with_grads else None
    partial, grads = moe_forward_backward(
        x_all, top_all, rw_all, p.w_gate_up, p.w_down, d_out_all,
        activation=cfg.activation, first_expert=p.first_expert, num_experts=cfg.num_experts, **biases,
    )
    out = _sum_home(world, partial, rows, n)
    d_out_mine = p.d_out.to(cdt) if with_grads else None
    x_mine = p.x.to(cdt)
    empty_top = torch.full_like(p.top_experts, -1)
    no_experts = (p.w_gate_up[:0], p.w_down[:0])
    # The shared experts are replicated: each rank computes them for its own tokens.
    shared_out, shared_grads = moe_forward_backward(
        x_mine, empty_top, p.router_weights, *no_experts, d_out_mine, p.shared, cfg.activation,
        num_experts=cfg.num_experts,
    )
    out = out + shared_out
    if not with_grads:
        return out, {}
    d_x = _sum_home(world, grads["x"], rows, n)
    d_rw = _sum_home(world, grads["router_weights"], rows, n)
    grads = {
        "x": d_x + shared_grads["x"],
        "router_weights": d_rw,
        "w_gate_up": grads["w_gate_up"],
        "w_down": grads["w_down"],
        "shared": shared_grads["shared"],
        **{name: grads[name] for name in biases if name in grads},
    }
    return out, grads


def ep_moe(world: EPWorld, x: torch.Tensor | MoEInputs, top_experts: torch.Tensor | None = None,
           router_weights: torch.Tensor | None = None, w_gate_up: torch.Tensor | None = None,
           w_down: torch.Tensor | None = None, shared: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
           activation: Activation = SWIGLU, *, b_gate_up: torch.Tensor | None = None,
           b_down: torch.Tensor | None = None) -> torch.Tensor:
    """The layer over the EP group in plain PyTorch, differentiable by autograd (the reference a model trains on).

    Arguments as :func:`megamoe.moe` (one by one or as one :class:`megamoe.MoEInputs` in place of ``x``): this
    rank's tokens, its experts ``rank*L ..`` (and their optional biases), replicated shared experts.
    Every rank's tokens are gathered (autograd's all-gather), each rank computes its experts' share of every
    token (:func:`~megamoe.reference.layer.moe_forward`, FP32 math), the shares go home (all-to-all) and are summed
    in rank order, plus the shared experts on this rank's tokens. Returns `[N, D]` in x's dtype.
    """
    from megamoe.reference.layer import moe_forward

    i = gather_inputs(x, top_experts, router_weights, w_gate_up, w_down, shared, activation, b_gate_up, b_down)
    n, L = i.x.shape[0], i.w_gate_up.shape[0]
    rows = max(world.all_gather_object(n))
    cdt = compute_dtype(i.x.dtype)

    def padded(t: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        return torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), fill)])

    x_all = _Exchange.apply(world, padded(i.x.to(cdt)).repeat(world.size, 1))
    weights_all = _Exchange.apply(world, padded(i.router_weights).repeat(world.size, 1))
    top_all = _gather_rows(world, i.top_experts, rows, fill=-1)
    routed = replace(i, x=x_all, top_experts=top_all, router_weights=weights_all, shared=())
    share = moe_forward(routed, first_expert=world.rank * L, num_experts=L * world.size).to(cdt)
    out = _Exchange.apply(world, share).view(world.size, rows, -1).sum(0)[:n]  # rank order
    if i.shared:  # this rank's tokens through the shared experts alone: no routed expert, no bias
        alone = replace(i, x=i.x.to(cdt), top_experts=torch.full_like(i.top_experts, -1), w_gate_up=i.w_gate_up[:0],
                        w_down=i.w_down[:0], b_gate_up=None, b_down=None)
        out = out + moe_forward(alone, num_experts=L * world.size).to(cdt)
    return out.to(i.x.dtype)


class _Exchange(torch.autograd.Function):
    """Block r of the rows to rank r (all-to-all of equal blocks); its backward sends the gradients back."""

    @staticmethod
    def forward(ctx, world, rows):
        ctx.world = world
        out = torch.empty_like(rows)
        dist.all_to_all_single(out, rows.contiguous(), group=world.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = torch.empty_like(grad)
        dist.all_to_all_single(back, grad.contiguous(), group=ctx.world.group)
        return None, back
