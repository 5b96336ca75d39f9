"""The `nccl-torch` baseline: an expert-parallel MoE layer as torchtitan builds it.

Stages (forward; autograd gives the backward):

1. sort this rank's N·k routes by global expert id (-1 routes go last);
2. exchange per-expert counts with an all-to-all, then read the split sizes
   on the host (NOTE: this host sync is inherent to the design: the token
   all-to-all needs its split sizes on the host);
3. gather the routed rows and all-to-all them to the experts' ranks; rows
   arrive grouped by (source rank, local expert);
4. place them grouped by (local expert, source rank), each expert's group
   starting on a multiple of ``group_align`` (zero rows between);
5. ``torch._grouped_mm`` gate/up -> SwiGLU -> ``torch._grouped_mm`` down;
6. all-to-all the outputs back; weighted sum over k at home (one bf16
   ``bmm`` with FP32 accumulation), plus the dense shared experts.

NCCL on CUDA, gloo on the CPU; both reach ``torch._grouped_mm``.
"""

from __future__ import annotations

import contextlib

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megamoe.baselines.fp8_grouped import FP8_GROUP_ALIGN, RowwiseExperts, scaled_grouped_mm
from megamoe.config import SWIGLU, Activation
from megamoe.inputs import LayerDims, MoEInputs, gather_inputs
from megamoe.parallel.world import EPWorld
from megamoe.reference import activate


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows; the backward sends gradients the reverse way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        out = rows.new_empty((sum(output_splits),) + tuple(rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return back, None, None, None


def _grouped_destinations(recv_RL: torch.Tensor, recv_host: torch.Tensor, group_align: int):
    """Where each received row goes in the expert-grouped buffer.

    ``recv_RL[r, l]`` rows arrived from rank r for local expert l, laid out
    row-major over (r, l). Returns (dest [rows] int64 on device, group ends
    int32 [L] for ``_grouped_mm``, padded row count).
    """
    ranks, experts = recv_host.shape
    per_expert = recv_host.sum(0)
    padded = (per_expert + group_align - 1) // group_align * group_align
    ends = padded.cumsum(0)
    starts = ends - padded
    # start of block (r, l) in the grouped buffer: expert start + rows of lower ranks.
    block_start = starts[None, :] + recv_host.cumsum(0) - recv_host
    device = recv_RL.device
    counts = recv_RL.reshape(-1)
    total = int(recv_host.sum())
    block = torch.repeat_interleave(torch.arange(ranks * experts, device=device), counts, output_size=total)
    recv_start = counts.cumsum(0) - counts
    within = torch.arange(total, device=device) - recv_start[block]
    dest = block_start.reshape(-1).to(device)[block] + within
    return dest, ends.to(device=device, dtype=torch.int32), int(ends[-1]) if experts else 0


def baseline_inputs(name: str, world: EPWorld, inputs: MoEInputs) -> LayerDims:
    """The baselines' validation of their inputs: every tensor in x's dtype (the expert biases too), the ids read."""
    return inputs.validate(dtypes="same", world=world)  # the split sizes sync the host anyway


def nccl_torch_moe(
    world: EPWorld,
    x: torch.Tensor | MoEInputs,
    top_experts: torch.Tensor | None = None,
    router_weights: torch.Tensor | None = None,
    w_gate_up: torch.Tensor | None = None,
    w_down: torch.Tensor | None = None,
    shared: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    activation: Activation = SWIGLU,
    *,
    group_align: int = 8,
    experts_fp8: RowwiseExperts | None = None,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE layer over ``world`` with NCCL/gloo all-to-all; differentiable (BF16 experts).

    Args:
        world: the EP group (R ranks).
        x, top_experts, router_weights, w_gate_up, w_down, shared, activation, b_gate_up, b_down: the layer's
            inputs (:class:`megamoe.MoEInputs`, every tensor in x's dtype but the ids and router weights; the
            expert biases added to each grouped row as torchtitan's biased experts do), one by one or as one
            ``MoEInputs`` in place of ``x``.
        group_align: each expert's row group starts on a multiple of this.
        experts_fp8: the routed weights in E4M3 (:func:`megamoe.baselines.fp8_grouped.quantize_expert_weights`):
            the expert GEMMs run `torch._scaled_grouped_mm` with row-wise scales; forward only.

    Returns `[N, D]` in x's dtype. Syncs the host once (split sizes).
    """
    i = gather_inputs(x, top_experts, router_weights, w_gate_up, w_down, shared, activation, b_gate_up, b_down)
    dims = baseline_inputs("nccl_torch_moe", world, i)
    n, d, k, experts_local = dims.tokens, dims.hidden, dims.top_k, dims.experts
    x, top_experts, router_weights, w_gate_up, w_down = i.x, i.top_experts, i.router_weights, i.w_gate_up, i.w_down
    shared, activation = i.shared, i.activation
    ranks = world.size
    num_experts = experts_local * ranks

    flat = top_experts.reshape(-1).long()
    key = torch.where(flat >= 0, flat, num_experts)
    order = torch.argsort(key, stable=True)
    send_counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=world.group)
    host = torch.stack([send_counts, recv_counts]).cpu()  # the one host sync
    send_host, recv_host = host[0].view(ranks, experts_local), host[1].view(ranks, experts_local)
    input_splits = send_host.sum(1).tolist()
    output_splits = recv_host.sum(1).tolist()
    routed = order[: sum(input_splits)]

    x_send = x[routed // k]
    x_recv = _AllToAll.apply(x_send, output_splits, input_splits, world.group)
    if experts_fp8 is not None:
        group_align = max(group_align, FP8_GROUP_ALIGN)
    dest, ends, padded_rows = _grouped_destinations(recv_counts.view(ranks, experts_local), recv_host, group_align)
    x_grouped = x_recv.new_zeros(padded_rows, d).index_copy(0, dest, x_recv)
    y_grouped = expert_ffn(x_grouped, w_gate_up, w_down, ends, activation, experts_fp8, i.b_gate_up, i.b_down)
    y_back = _AllToAll.apply(y_grouped[dest], input_splits, output_splits, world.group)

    y_routes = y_back.new_zeros(n * k, d).index_copy(0, routed, y_back)
    weights = router_weights.to(x.dtype).unsqueeze(1)  # [N, 1, k]
    out = torch.bmm(weights, y_routes.view(n, k, d)).squeeze(1)
    for gate_up, down in shared:
        out = out + torchtitan_activation(x @ gate_up.T, activation) @ down.T
    return out


def expert_ffn(x_grouped: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, ends: torch.Tensor,
               activation: Activation, experts_fp8: RowwiseExperts | None = None,
               b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None) -> torch.Tensor:
    """gate/up (+ b_gate_up) -> SwiGLU -> down (+ b_down) over expert-grouped rows: `torch._grouped_mm` (BF16,
    differentiable) or, with ``experts_fp8``, `torch._scaled_grouped_mm` on row-wise E4M3 (no gradient). The
    biases `[L, 2I]` / `[L, D]` are optional; each row gets its group's (padding rows too: never read back)."""
    expert = None
    if b_gate_up is not None or b_down is not None:  # each grouped row's expert, from the groups' ends
        rows = torch.arange(x_grouped.shape[0], device=x_grouped.device)
        expert = torch.bucketize(rows, ends.long(), right=True).clamp(max=max(len(ends) - 1, 0))
    # added in FP32 and rounded once, as the kernels do; the bias gradient (a sum over the group's rows) then
    # accumulates in FP32 too (a BF16 index_put sum of a thousand rows strays by percents)
    bias = lambda t, b: t if b is None else (t.float() + b.float()[expert]).to(t.dtype)  # noqa: E731
    with torch.no_grad() if experts_fp8 is not None else contextlib.nullcontext():
        if experts_fp8 is None:
            h = bias(grouped_mm(x_grouped, w_gate_up.transpose(-2, -1), ends), b_gate_up)
            return bias(grouped_mm(torchtitan_activation(h, activation), w_down.transpose(-2, -1), ends), b_down)
        e = experts_fp8
        h = bias(scaled_grouped_mm(x_grouped, e.w_gate_up, e.w_gate_up_scale, ends), b_gate_up)
        return bias(scaled_grouped_mm(torchtitan_activation(h, activation), e.w_down, e.w_down_scale, ends), b_down)


def torchtitan_activation(h: torch.Tensor, activation: Activation) -> torch.Tensor:
    """SwiGLU as torchtitan's experts write it, ``F.silu(gate) * up`` (the baselines' own: in BF16 it rounds
    fewer times than the kernels' ``gate * sigmoid(gate) * up`` twin would); the other kinds as the reference
    writes them."""
    if activation.kind not in ("swiglu", "swiglu-clamped"):
        return activate(h, activation)
    gate, up = h.chunk(2, dim=-1)
    if activation.limit is not None:
        gate, up = gate.clamp(max=activation.limit), up.clamp(-activation.limit, activation.limit)
    return F.silu(gate) * up


def grouped_mm(a_MK: torch.Tensor, b_GKN: torch.Tensor, ends_G: torch.Tensor) -> torch.Tensor:
    if a_MK.shape[0] == 0:  # no rows at all: keep the graph connected to the weights, and to a's (earlier ones)
        return a_MK.new_zeros(0, b_GKN.shape[-1]) + 0 * b_GKN.sum() + 0 * a_MK.sum()
    return torch._grouped_mm(a_MK, b_GKN, offs=ends_G)
