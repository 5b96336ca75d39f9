"""The pure-PyTorch MoE layer: the oracle for every kernel and every gradient.

Deliberately plain: a loop over experts, FP32 (or FP64 for FP64 inputs)
arithmetic, differentiable by autograd. Not fast, never clever.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megamoe.config import SWIGLU, Activation
from megamoe.inputs import MoEInputs, gather_inputs


def activate(h_M2I: torch.Tensor, activation: Activation = SWIGLU) -> torch.Tensor:
    """The experts' activation of ``h = [gate | up]`` along the last dim, as the kernels compute it (the same
    operations in the same order: ``megamoe.kernels.activation``); the one activation twin of the project.

    SwiGLU is ``gate * sigmoid(gate) * up`` (``F.silu`` rounds differently in ~20 % of float32 elements, which
    moves the FP8 kernels' act scales by an ulp); ``swiglu-clamped`` and ``gpt-oss`` clamp gate to ``max=limit``
    and up to ``[-limit, limit]`` first; gpt-oss is ``gate * sigmoid(alpha * gate) * (up + 1)``; GeGLU
    ``0.5 * gate * (1 + erf(gate / sqrt(2))) * up``.
    """
    gate, up = h_M2I.chunk(2, dim=-1)
    if activation.limit is not None:
        gate = gate.clamp(max=activation.limit)
        up = up.clamp(-activation.limit, activation.limit)
    if activation.kind == "gpt-oss":
        return gate * torch.sigmoid(activation.alpha * gate) * (up + 1.0)
    if activation.kind == "geglu":
        return 0.5 * gate * (1.0 + torch.erf(gate * 0.7071067811865476)) * up
    return gate * torch.sigmoid(gate) * up


def activation_backward(g: torch.Tensor, h: torch.Tensor, w: torch.Tensor, activation: Activation = SWIGLU):
    """(d_h, act, d_router) of rows from ``g = dy · w_down`` and h `[n, 2I]` in FP32 and their router weights
    ``w`` `[n]`, as the kernels' dact epilogue computes them (``megamoe.kernels.activation.activation_bwd``, the
    same operations in the same order): ``d_router = <g, act>``, ``d_h = act'(h) ⊙ (w g)`` (a clamp passes the
    gradient inside its bounds, inclusive)."""
    gate, up = h.chunk(2, dim=-1)
    gate_c, up_c, limit = gate, up, activation.limit
    if limit is not None:
        gate_c, up_c = gate.clamp(max=limit), up.clamp(-limit, limit)
    if activation.kind == "gpt-oss":
        sig = torch.sigmoid(activation.alpha * gate_c)
        glu, up_1 = gate_c * sig, up_c + 1.0
        d_glu = sig * (1.0 + activation.alpha * gate_c * (1.0 - sig))
    elif activation.kind == "geglu":
        cdf = 0.5 * (1.0 + torch.erf(gate_c * 0.7071067811865476))
        glu, up_1 = gate_c * cdf, up_c
        d_glu = cdf + gate_c * 0.3989422804014327 * torch.exp(-0.5 * gate_c * gate_c)
    else:
        sig = torch.sigmoid(gate_c)
        glu, up_1 = gate_c * sig, up_c
        d_glu = sig * (1.0 + gate_c * (1.0 - sig))
    act = glu * up_1
    d_router = (g * act).sum(dim=1)
    d_act = g * w[:, None]
    d_up = d_act * glu
    d_gate = d_act * up_1 * d_glu
    if limit is not None:
        d_gate = torch.where(gate <= limit, d_gate, 0.0)
        d_up = torch.where((up >= -limit) & (up <= limit), d_up, 0.0)
    return torch.cat([d_gate, d_up], dim=1), act, d_router


def expert_ffn(
    x_MD: torch.Tensor, w_gate_up_2ID: torch.Tensor, w_down_DI: torch.Tensor, activation: Activation = SWIGLU,
    b_gate_up_2I: torch.Tensor | None = None, b_down_D: torch.Tensor | None = None,
) -> torch.Tensor:
    """``W_down · activate(W_gate_up · x + b_gate_up) + b_down`` for rows ``x_MD``, in x's dtype (a None bias adds
    nothing)."""
    h = x_MD @ w_gate_up_2ID.T
    if b_gate_up_2I is not None:
        h = h + b_gate_up_2I
    y = activate(h, activation) @ w_down_DI.T
    return y if b_down_D is None else y + b_down_D


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """FP64 stays FP64; everything else is computed in FP32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def moe_forward(
    x: torch.Tensor | MoEInputs,
    top_experts: torch.Tensor | None = None,
    router_weights: torch.Tensor | None = None,
    w_gate_up: torch.Tensor | None = None,
    w_down: torch.Tensor | None = None,
    shared: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    activation: Activation = SWIGLU,
    *,
    first_expert: int = 0,
    num_experts: int | None = None,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE layer's output for the tokens of one rank.

    Args:
        x, top_experts, router_weights, w_gate_up, w_down, shared, activation, b_gate_up, b_down: the layer's
            inputs (:class:`megamoe.MoEInputs`; every tensor of any float dtype, ids and router weights aside),
            one by one or as one ``MoEInputs`` in place of ``x``. ``w_gate_up`` holds experts
            ``first_expert .. first_expert+L-1``; with the defaults L = E.
        first_expert: global id of ``w_gate_up[0]``. Routes to experts outside
            the held slice contribute nothing: the result is this slice's
            share of the layer (used to build an expert-parallel reference).
        num_experts: E, the range ids are checked against (default L).

    Returns:
        `[N, D]` in x's dtype, accumulated in FP32 (FP64 for FP64 input).
    """
    i = gather_inputs(x, top_experts, router_weights, w_gate_up, w_down, shared, activation, b_gate_up, b_down)
    dims = i.validate(num_experts=num_experts)
    n, d, held = dims.tokens, dims.hidden, dims.experts
    x, top_experts, router_weights, w_gate_up, w_down = i.x, i.top_experts, i.router_weights, i.w_gate_up, i.w_down
    shared, activation, b_gate_up, b_down = i.shared, i.activation, i.b_gate_up, i.b_down

    cdt = compute_dtype(x.dtype)
    x_c = x.to(cdt)
    out = torch.zeros(n, d, dtype=cdt, device=x.device)
    for local in range(held):
        token, slot = (top_experts == first_expert + local).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        y = expert_ffn(x_c[token], w_gate_up[local].to(cdt), w_down[local].to(cdt), activation,
                       *_biases_of(local, b_gate_up, b_down, cdt))
        out = out.index_add(0, token, y * router_weights[token, slot].to(cdt)[:, None])
    for gate_up, down in shared:
        out = out + expert_ffn(x_c, gate_up.to(cdt), down.to(cdt), activation)
    return out.to(x.dtype)


def moe_forward_backward(
    x: torch.Tensor | MoEInputs,
    top_experts: torch.Tensor | None = None,
    router_weights: torch.Tensor | None = None,
    w_gate_up: torch.Tensor | None = None,
    w_down: torch.Tensor | None = None,
    d_out: torch.Tensor | None = None,
    shared: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    activation: Activation = SWIGLU,
    *,
    first_expert: int = 0,
    num_experts: int | None = None,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`moe_forward` and its gradients for upstream gradient ``d_out``.

    With ``d_out=None`` only the output is computed (grads is empty).

    Same arguments as :func:`moe_forward`. Autograd runs one expert at a
    time, so memory stays at one expert's activations (this is how the
    oracle fits beside full-size layers on one GPU).

    Returns ``(out, grads)`` with grads ``x`` `[N, D]`, ``router_weights``
    `[N, k]` (both in the compute dtype), ``w_gate_up``, ``w_down`` (in the
    weights' dtype), ``shared`` (a list of (d_w_gate_up, d_w_down)) and, for each bias given, ``b_gate_up`` /
    ``b_down`` (in the compute dtype).
    """
    i = gather_inputs(x, top_experts, router_weights, w_gate_up, w_down, shared, activation, b_gate_up, b_down)
    dims = i.validate(num_experts=num_experts)
    n, d, held = dims.tokens, dims.hidden, dims.experts
    x, top_experts, router_weights, w_gate_up, w_down = i.x, i.top_experts, i.router_weights, i.w_gate_up, i.w_down
    shared, activation, b_gate_up, b_down = i.shared, i.activation, i.b_gate_up, i.b_down
    if d_out is not None and tuple(d_out.shape) != (n, d):
        raise ValueError(f"d_out must have shape ({n}, {d}), got {tuple(d_out.shape)}")

    cdt = compute_dtype(x.dtype)
    x_c = x.detach().to(cdt)
    g_c = None if d_out is None else d_out.detach().to(cdt)
    out = torch.zeros(n, d, dtype=cdt, device=x.device)
    d_x = torch.zeros_like(out)
    d_rw = torch.zeros(router_weights.shape, dtype=cdt, device=x.device)
    d_gate_up, d_down = torch.zeros_like(w_gate_up), torch.zeros_like(w_down)
    d_biases = {name: torch.zeros(b.shape, dtype=cdt, device=x.device)
                for name, b in (("b_gate_up", b_gate_up), ("b_down", b_down)) if b is not None}

    def one_ffn(rows, gate_up, down, *biases):
        """One expert on ``rows``: (y detached, y in a graph, the graph's leaves: x, the weights, the biases)."""
        with torch.set_grad_enabled(g_c is not None):
            leaves = [t.detach().to(cdt).requires_grad_() for t in (x_c[rows], gate_up, down)]
            bias_leaves = [None if b is None else b.detach().to(cdt).requires_grad_() for b in biases]
            y = expert_ffn(*leaves, activation, *bias_leaves)
        return y.detach(), y, leaves + [b for b in bias_leaves if b is not None]

    for local in range(held):
        token, slot = (top_experts == first_expert + local).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        y, y_graph, leaves = one_ffn(token, w_gate_up[local], w_down[local], *_biases_of(local, b_gate_up, b_down))
        weight = router_weights[token, slot].to(cdt)[:, None]
        out.index_add_(0, token, y * weight)
        if g_c is None:
            continue
        d_rw[token, slot] = (g_c[token] * y).sum(1)
        grads = torch.autograd.grad(y_graph, leaves, g_c[token] * weight)
        d_x.index_add_(0, token, grads[0])
        d_gate_up[local], d_down[local] = grads[1], grads[2]
        for name, grad in zip(d_biases, grads[3:]):
            d_biases[name][local] = grad
    d_shared = []
    all_rows = torch.arange(n, device=x.device)
    for gate_up, down in shared:
        y, y_graph, leaves = one_ffn(all_rows, gate_up, down)
        out += y
        if g_c is None:
            continue
        grads = torch.autograd.grad(y_graph, leaves, g_c)
        d_x += grads[0]
        d_shared.append((grads[1].to(gate_up.dtype), grads[2].to(down.dtype)))
    if g_c is None:
        return out.to(x.dtype), {}
    grads = {"x": d_x, "router_weights": d_rw, "w_gate_up": d_gate_up, "w_down": d_down, "shared": d_shared,
             **d_biases}
    return out.to(x.dtype), grads


def _biases_of(local: int, b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Local expert ``local``'s bias rows (None where there is no bias), in ``dtype`` when given."""
    return tuple(None if b is None else (b[local] if dtype is None else b[local].to(dtype))
                 for b in (b_gate_up, b_down))
