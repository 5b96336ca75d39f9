"""The `deepep-torch` baseline: DeepEP's intranode dispatch and combine around `torch._grouped_mm` experts.

What a user picks today (torchtitan's DeepEP backend, MoK's baselines). Forward, autograd gives the backward:

1. DeepEP's dispatch (normal mode, intranode): one copy of each token per destination rank, with the token's
   top-k ids made local to that rank (-1 where the expert lives elsewhere) and those slots' weights zeroed;
2. permute: the received tokens' routes grouped by local expert, each group padded to ``group_align`` rows (the
   grouped GEMM's backward needs it); only the padding rows are zeroed;
3. `torch._grouped_mm` gate/up -> SwiGLU -> `torch._grouped_mm` down;
4. unpermute: each received token's local routes summed with their router weights (one bmm, FP32 accumulate);
5. DeepEP's combine: the ranks' partial sums added at home (its backward is the dispatch of the gradient with
   the dispatch's handle, and the dispatch's backward a combine: each other's backward, as DeepEP documents);
   the router weights' gradient goes home through the combine's top-k weights;
6. the shared experts, on a second stream beside steps 1-5 (GPU).

DeepEP is built from its public source (benchmarks/deepep/build.sh); without ``deep_ep`` the impl is skipped
(:func:`unavailable`). :class:`TorchTwin` is DeepEP's intranode dispatch layout in torch.distributed (the fields
this layer reads: received rows in source-rank then token order, local ids, zeroed weights, exact per-expert
counts on the host): the CPU tests run the whole layer through it. DeepEP's normal mode reads its counts on the
host, once per dispatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megamoe.baselines.fp8_grouped import FP8_GROUP_ALIGN, RowwiseExperts
from megamoe.baselines.nccl_torch import baseline_inputs, expert_ffn, torchtitan_activation
from megamoe.config import SWIGLU, Activation
from megamoe.inputs import MoEInputs, gather_inputs
from megamoe.parallel.world import EPWorld

#: NVLink buffer of DeepEP's intranode kernels, bytes (its tests use 1 GB; the kernels size their queues to it).
DEEPEP_NVL_BYTES = 1 << 30


def unavailable() -> str | None:
    """None when DeepEP's ``deep_ep`` imports, else why not (one line)."""
    try:
        import deep_ep  # noqa: F401
    except Exception as exc:  # not built, or built against another torch
        return (f"deep_ep is not importable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                f"build it with benchmarks/deepep/build.sh")
    return None


class DeepEPBackend:
    """DeepEP's intranode normal-mode dispatch and combine on one world (one ``deep_ep.Buffer``, kept)."""

    usable = True

    def __init__(self, world: EPWorld):
        import deep_ep

        self.buffer = deep_ep.Buffer(world.group, DEEPEP_NVL_BYTES, 0)

    def dispatch(self, x, topk_idx, topk_weights, num_experts: int):
        """(recv_x, recv_topk_idx local, recv_topk_weights, per-local-expert counts on the host, handle)."""
        per_rank, per_rdma, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, counts, handle, _ = self.buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
        return recv_x, recv_idx, recv_w, list(counts), handle

    def dispatch_again(self, x, handle):
        """x's rows sent as the handle's dispatch sent the tokens (the combine's backward)."""
        return self.buffer.dispatch(x, handle=handle)[0]

    def combine(self, y, handle, weights=None):
        """(the ranks' rows added at home, the same for ``weights``)."""
        out, out_w, _ = self.buffer.combine(y, handle, topk_weights=weights)
        return out, out_w

    def free(self) -> None:
        self.buffer = None


class TorchTwin:
    """DeepEP's intranode dispatch / combine layout in torch.distributed (all-to-all over the world's group):
    rows arrive by source rank, in token order; ids local to the receiving rank (-1 elsewhere), those slots'
    weights zero; the combine adds a token's rows from every rank in FP32, as DeepEP's does. Host syncs: the
    split sizes, and the counts DeepEP also returns on the host."""

    usable = True

    def __init__(self, world: EPWorld):
        self.world = world

    def dispatch(self, x, topk_idx, topk_weights, num_experts: int):
        world = self.world
        ranks, experts_local = world.size, num_experts // world.size
        dest = torch.where(topk_idx >= 0, topk_idx // experts_local, ranks)  # [N, k]
        in_rank = torch.zeros(x.shape[0], ranks + 1, dtype=torch.bool, device=x.device)
        in_rank.scatter_(1, dest, True)
        in_rank = in_rank[:, :ranks]
        sends = [in_rank[:, r].nonzero().squeeze(1) for r in range(ranks)]  # tokens to rank r, in order
        order = torch.cat(sends)
        send_counts = torch.tensor([len(s) for s in sends], device=x.device)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=world.group)
        splits = (recv_counts.tolist(), send_counts.tolist())
        recv_x = self._exchange(x[order], *splits)
        # each destination gets the ids made local to it and the other slots' weights zeroed
        dest_of_row = torch.repeat_interleave(torch.arange(ranks, device=x.device), send_counts)
        idx = topk_idx[order]
        local = (idx >= 0) & (idx // experts_local == dest_of_row[:, None])
        recv_idx = self._exchange(torch.where(local, idx - dest_of_row[:, None] * experts_local, -1), *splits)
        recv_w = self._exchange(torch.where(local, topk_weights[order], 0.0), *splits)
        counts = torch.bincount(recv_idx[recv_idx >= 0], minlength=experts_local).tolist()
        return recv_x, recv_idx, recv_w, counts, (order, splits, x.shape[0])

    def dispatch_again(self, x, handle):
        order, splits, _ = handle
        return self._exchange(x[order], *splits)

    def combine(self, y, handle, weights=None):
        order, (recv_splits, send_splits), n = handle
        back = self._exchange(y, send_splits, recv_splits).float()
        out = torch.zeros(n, y.shape[1], dtype=torch.float32, device=y.device).index_add_(0, order, back)
        out_w = None
        if weights is not None:
            w_back = self._exchange(weights, send_splits, recv_splits)
            out_w = torch.zeros(n, weights.shape[1], dtype=weights.dtype, device=y.device).index_add_(0, order, w_back)
        return out.to(y.dtype), out_w

    def _exchange(self, rows, output_splits, input_splits):
        out = rows.new_empty((sum(output_splits),) + tuple(rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=self.world.group)
        return out

    def free(self) -> None:
        pass


class _Dispatch(torch.autograd.Function):
    """DeepEP dispatch; its backward is the combine (rows and router weights sent home and added)."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, backend, num_experts):
        recv_x, recv_idx, recv_w, counts, handle = backend.dispatch(x, topk_idx, topk_weights, num_experts)
        ctx.backend, ctx.handle = backend, handle
        ctx.save_for_backward(recv_idx)
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_w, recv_idx, counts, handle

    @staticmethod
    def backward(ctx, d_recv_x, d_recv_w, *_):
        (recv_idx,) = ctx.saved_tensors
        # a slot of another rank's expert got a gradient through its 0 weight: that rank sends the real one
        d_recv_w = d_recv_w.masked_fill(recv_idx < 0, 0.0)
        d_x, d_w = ctx.backend.combine(d_recv_x.contiguous(), ctx.handle, d_recv_w.contiguous())
        return d_x, d_w, None, None, None


class _Combine(torch.autograd.Function):
    """DeepEP combine; its backward dispatches the gradient as the forward's dispatch sent the tokens."""

    @staticmethod
    def forward(ctx, y, backend, handle):
        ctx.backend, ctx.handle = backend, handle
        return backend.combine(y, handle)[0]

    @staticmethod
    def backward(ctx, d_out):
        return ctx.backend.dispatch_again(d_out.contiguous(), ctx.handle), None, None


def permute_plan(recv_idx: torch.Tensor, counts: Sequence[int], group_align: int):
    """Where each received route goes in the expert-grouped rows.

    ``recv_idx`` `[T, k]` local ids (-1: elsewhere), ``counts`` each local expert's routes (host). Returns
    (row of each route `[T, k]` (-1: none), source token of each valid route in row order with its row,
    padding rows, group ends `[L]` int32, rows in all); groups start on multiples of ``group_align``.
    """
    device = recv_idx.device
    experts = len(counts)
    padded = [-(-c // group_align) * group_align for c in counts]
    starts = [0] * experts
    for e in range(1, experts):
        starts[e] = starts[e - 1] + padded[e - 1]
    total = sum(padded)
    pad_rows = [r for e in range(experts) for r in range(starts[e] + counts[e], starts[e] + padded[e])]
    flat = recv_idx.reshape(-1)
    key = torch.where(flat >= 0, flat, experts)
    order = torch.argsort(key, stable=True)[: sum(counts)]  # valid routes, by expert, then token, then slot
    sorted_key = key[order]
    first = torch.tensor([s - sum(counts[:e]) for e, s in enumerate(starts)] or [0], device=device, dtype=torch.long)
    rows = torch.arange(order.numel(), device=device) + first[sorted_key]
    row_of = torch.full_like(flat, -1).index_put_((order,), rows).view_as(recv_idx)
    ends = torch.tensor([s + p for s, p in zip(starts, padded)], dtype=torch.int32, device=device)
    token = order // recv_idx.shape[1]
    return row_of, token, rows, torch.tensor(pad_rows, dtype=torch.long, device=device), ends, total


def deepep_torch_moe(
    world: EPWorld,
    x: torch.Tensor | MoEInputs,
    top_experts: torch.Tensor | None = None,
    router_weights: torch.Tensor | None = None,
    w_gate_up: torch.Tensor | None = None,
    w_down: torch.Tensor | None = None,
    shared: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    activation: Activation = SWIGLU,
    *,
    backend=None,
    group_align: int = 8,
    experts_fp8: RowwiseExperts | None = None,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE layer over ``world`` with DeepEP's dispatch and combine; differentiable.

    Arguments as :func:`megamoe.baselines.nccl_torch.nccl_torch_moe`; ``backend`` is the world's
    :class:`DeepEPBackend` (default: kept on the world) or a :class:`TorchTwin`; ``experts_fp8`` as there
    (forward only). RuntimeError when DeepEP is not importable and no backend is given.
    """
    i = gather_inputs(x, top_experts, router_weights, w_gate_up, w_down, shared, activation, b_gate_up, b_down)
    dims = baseline_inputs("deepep_torch_moe", world, i)
    d, k = dims.hidden, dims.top_k
    x, top_experts, router_weights, w_gate_up, w_down = i.x, i.top_experts, i.router_weights, i.w_gate_up, i.w_down
    shared, activation = i.shared, i.activation
    num_experts = dims.experts * world.size
    if backend is None:
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(reason)
        backend = world.resources.get(("deepep", world.size), lambda: DeepEPBackend(world))
    side = None
    if x.is_cuda and shared:  # the shared experts beside the routed work
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            shared_out = _shared(x, shared, activation)
    recv_x, recv_w, recv_idx, counts, handle = _Dispatch.apply(
        x, router_weights.float(), top_experts.long(), backend, num_experts)
    if experts_fp8 is not None:
        group_align = max(group_align, FP8_GROUP_ALIGN)
    row_of, token, rows, pad_rows, ends, total = permute_plan(recv_idx, counts, group_align)
    x_grouped = recv_x.new_empty(total, d)
    x_grouped[pad_rows] = 0  # only the padding rows: their gradients meet the weights' in the wgrads
    x_grouped[rows] = recv_x[token]
    y_grouped = expert_ffn(x_grouped, w_gate_up, w_down, ends, activation, experts_fp8, i.b_gate_up, i.b_down)
    # each received token's local routes with their weights (the other slots' weights are 0: row 0 stands in)
    y_routes = y_grouped[row_of.clamp(min=0)] if total else y_grouped.new_zeros(*row_of.shape, d)
    y_recv = torch.bmm(recv_w.to(x.dtype).unsqueeze(1), y_routes.view(-1, k, d)).squeeze(1)
    out = _Combine.apply(y_recv, backend, handle)
    if shared:
        if side is None:
            shared_out = _shared(x, shared, activation)
        else:
            main = torch.cuda.current_stream(x.device)
            main.wait_stream(side)
            shared_out.record_stream(main)
        out = out + shared_out
    return out


def _shared(x, shared, activation):
    out = None
    for gate_up, down in shared:
        y = torchtitan_activation(x @ gate_up.T, activation) @ down.T
        out = y if out is None else out + y
    return out
