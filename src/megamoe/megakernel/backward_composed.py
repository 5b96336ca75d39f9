"""The layer's backward from the standalone kernels, device-ordered: the training path until the backward
megakernel fuses it, then its ablation.

Driven by the forward's pull schedule, per rank, all on the current stream:

1. stage: this rank's x, upstream gradient ``d_out [N, D]`` and router weights into the communication
   workspace's symmetric buffers (FP8: x and ``d_out`` quantised there once, 1x128 / 1x32 along D); a device
   barrier;
2. pull reverse-combine: each routed row's ``d_out`` row from its home rank, unscaled
   (:func:`~megamoe.ops.comm.reverse_combine_pull`; FP8: its E4M3 row and scales, half the bytes), and its x
   row again (BF16 keeps only h: pulling x moves bytes the links have time for under the backward's compute,
   and saves a layer's ring rows; FP8 keeps the ring's E4M3 x and pulls only the rows past a wrapped ring);
   each row's router weight read from its home rank;
3. the routed rows' pre-activation h: the ring's, and the rows past the ring (those a wrapped ring lost)
   recomputed from the pulled x (the same bits; nothing to do when the ring held every row);
4. the expert backward (:func:`~megamoe.ops.experts_bwd.expert_backward`): ``d_act = d_out_row · W_down``, the
   SwiGLU backward with the router-weight gradient ``<d_act, act>`` fused (from the unscaled rows: no
   division by w), ``d_h = w · SwiGLU'(h) ⊙ d_act``, ``d_x_row = d_h · W_gate_up``, and the weight gradients
   over each expert's rows in one fixed order (FP32 accumulation);
5. push reverse-dispatch: each row's ``d_x`` into its home rank's ``[N*k, D]`` slots, its router-weight
   gradient into the home rank's ``[N*k]`` slots; a device barrier;
6. at home: ``d_x[i] = sum_j slot[i*k + j]`` in fixed order in FP32, plus the shared experts' ``d_x`` (their
   backward over this rank's tokens, from the h the forward kept), rounded once.

Every reduction has a fixed order, so the gradients are bitwise equal across runs, comm_sms, minibatch and
ring size. No host sync with ``check=False`` (whether the ring wrapped is decided on the device). The backward
megakernel (:mod:`megamoe.megakernel.backward`) runs the same tiles: its gradients are these bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe import runtime
from megamoe.megakernel.buffers import scale_dtype
from megamoe.ops.comm import (CommShape, QuantRows, comm_workspace, device_barrier, dispatch_pull,
                              reverse_combine_pull, reverse_dispatch_push)
from megamoe.ops.expert_weights import QuantizedExperts, quantize_experts
from megamoe.ops.experts import ExpertForwardQuantized, gate_up
from megamoe.ops.experts_bwd import expert_backward
from megamoe.ops.experts_fp8 import gate_up_fp8
from megamoe.ops.experts_fp8_bwd import expert_backward_fp8_block, expert_backward_mxfp8
from megamoe.ops.experts_mxfp8 import gate_up_mxfp8
from megamoe.ops.weighted_sum import weighted_sum
from megamoe.precision import SCALE_BLOCK
from megamoe.routing.schedule import PullSchedule


@dataclass(frozen=True)
class SavedForward:
    """What the backward reads of a forward pass (one rank), as plain tensors.

    Attributes:
        h: bf16 `[ring_rows, 2I]` the pre-activation of the routed rows of the minibatches the ring still holds
            (routed row t at ring row t).
        shared_h: bf16 `[N, 2Is]` the shared experts' pre-activation over this rank's tokens (`[0, 0]` without).
        schedule: the pass's pull schedule (its own_rows is not needed).
        ring_x, ring_scale: FP8 precisions: the ring's E4M3 routed rows `[ring_rows, D]` and their scales along
            D (routed row t at ring row t), the gate/up wgrad's x; None with BF16 (x is pulled again).
        experts_q: FP8 precisions: the step's weight pack the forward ran on, when its caller gave one
            (:func:`~megamoe.ops.expert_weights.quantize_experts`): the replay and the dgrads read it (with
            ``backward=True`` its transposed weights too) instead of quantising the weights again.
    """

    h: torch.Tensor
    shared_h: torch.Tensor
    schedule: PullSchedule
    ring_x: torch.Tensor | None = None
    ring_scale: torch.Tensor | None = None
    experts_q: QuantizedExperts | None = None


@dataclass
class LayerGrads:
    """Gradients of one rank: ``x`` bf16 `[N, D]`, ``router_weights`` fp32 `[N, k]`, this rank's experts
    ``w_gate_up`` `[L, 2I, D]` and ``w_down`` `[L, D, I]` (bf16), the fused shared experts' ``shared_gate_up``
    `[2Is, D]` and ``shared_down`` `[D, Is]` (None without)."""

    x: torch.Tensor
    router_weights: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    shared_gate_up: torch.Tensor | None
    shared_down: torch.Tensor | None


def composed_backward(kernel, saved: SavedForward, d_out: torch.Tensor, x: torch.Tensor,
                      top_experts: torch.Tensor, router_weights: torch.Tensor, w_gate_up: torch.Tensor,
                      w_down: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None,
                      swiglu_limit: float | None, *, check: bool = True) -> LayerGrads:
    """The backward of ``kernel``'s forward pass that left ``saved`` (collective; see the module docstring).
    ``kernel`` is the MegaKernel that ran it (not imported here: the kernel imports this module).

    ``d_out`` bf16 `[N, D]` the upstream gradient; the other arguments are the forward's. ``check`` reads the
    workspace's error word after the pass (a timed-out barrier raises RuntimeError)."""
    world, s, c = kernel.world, kernel.shape, kernel.config
    n, D, k = x.shape[0], s.hidden, s.top_k
    schedule, fmt = saved.schedule, kernel.precision
    cap, ring = schedule.capacity, c.ring_rows
    # FP8: the rows travel as E4M3 with their scales, quantised once at home (half the bytes), and x only for
    # the rows past the ring (the ring's E4M3 x serves the rest)
    ws = comm_workspace(world, CommShape(s.num_ranks, max(s.max_tokens, 1), D, k, s.experts_per_rank,
                                         row_format=fmt))
    pull_x = fmt == "bf16" or cap > ring
    sms = runtime.num_programs(world.device)
    # 1. stage; every rank's rows in place before anyone pulls
    ws.stage(d_out=d_out.contiguous(), router_weights=router_weights.contiguous(), x=x if pull_x else None)
    device_barrier(ws, check=False)
    # 2. each routed row's upstream gradient (unscaled), x and router weight, from its home rank
    dy_rows = reverse_combine_pull(ws, schedule, num_sms=sms, sync=False)
    x_rows = dispatch_pull(ws, schedule, num_sms=sms, sync=False) if pull_x else None
    w_rows = row_weights(ws, schedule, world.size)
    # 3. the rows' h: the ring's, and the rows past it (a wrapped ring lost them) recomputed
    h_rows = _padded(saved.h, cap)
    q = saved.experts_q
    if cap > ring:
        _replay_past_ring(x_rows, h_rows, schedule, ring, w_gate_up, w_down, swiglu_limit, c.minibatch, fmt, q)
    # 4. the routed experts' backward (FP8: E4M3 dgrads and wgrads, megamoe.ops.experts_fp8_bwd)
    if fmt != "bf16":
        fp8_backward = expert_backward_fp8_block if fmt == "fp8-block" else expert_backward_mxfp8
        x_rows = _ring_rows(saved, x_rows, cap, ring, fmt)
        g = fp8_backward(dy_rows, w_rows, x_rows, h_rows, schedule.tokens_per_expert, schedule.offsets, w_gate_up,
                         w_down, swiglu_limit=swiglu_limit,
                         weights_t=None if q is None else q.backward_weights(w_gate_up, w_down))
    else:
        g = expert_backward(dy_rows, w_rows, x_rows, h_rows, schedule.tokens_per_expert, schedule.offsets,
                            w_gate_up, w_down, swiglu_limit=swiglu_limit,
                            rows_per_expert=s.max_tokens * k / max(s.experts_per_rank, 1))  # balanced mean
    del dy_rows, x_rows, h_rows
    # 5. d_x rows and router-weight gradients home; every push landed before anyone reads its slots
    reverse_dispatch_push(ws, schedule, g.d_x, num_sms=sms, sync=False)
    push_router_grads(ws, schedule, g.d_router, world.size)
    device_barrier(ws, check=False)
    # 6. at home: the k slots in fixed order, plus the shared experts
    shared_gate_up = shared_down = shared_dx = None
    if shared is not None:
        sg = _shared_backward(d_out, x, saved.shared_h, shared, swiglu_limit)
        shared_dx, shared_gate_up, shared_down = sg.d_x, sg.d_w_gate_up[0], sg.d_w_down[0]
    d_x, d_router = home_sums(ws.local("d_x"), ws.local("d_router"), top_experts, n, k, D, shared_dx)
    if check:
        ws.device_sync()
        ws.check_errors()
    return LayerGrads(d_x, d_router, g.d_w_gate_up, g.d_w_down, shared_gate_up, shared_down)


def _ring_rows(saved: SavedForward, pulled: QuantRows | None, cap: int, ring: int, fmt: str) -> QuantRows:
    """The E4M3 x of every routed row `[cap, D]`: the ring's, then the pulled rows past it (the same bits: both
    are the home rank's quantisation of the token)."""
    if saved.ring_x is None:
        raise ValueError(f"the {fmt} backward reads the forward ring's x: SavedForward.ring_x is None")
    if cap <= ring:
        return QuantRows(saved.ring_x[:cap], saved.ring_scale[:cap], fmt)
    return QuantRows(torch.cat([saved.ring_x[:ring], pulled.data[ring:]]),
                     torch.cat([saved.ring_scale[:ring], pulled.scale[ring:]]), fmt)


def _replay_past_ring(x_rows: torch.Tensor | QuantRows, h_rows: torch.Tensor, schedule: PullSchedule, ring: int,
                      w_gate_up: torch.Tensor, w_down: torch.Tensor, swiglu_limit: float | None, minibatch: int,
                      fmt: str, experts_q: QuantizedExperts | None = None) -> None:
    """h of the routed rows at and past row ``ring`` (the minibatches a wrapped ring lost), into ``h_rows``.

    Each expert's region is cut at ``ring`` on the device, so a ring that held every row leaves every region
    empty and the launch does nothing: whether the ring wrapped is never read on the host. A row's h depends
    only on its own x row and the expert's weights (the K steps and n-tiles are the forward's), so these are
    the bits the forward computed."""
    start = schedule.offsets - ring
    first = start.clamp(min=0)
    counts = (start + schedule.tokens_per_expert).clamp(min=0) - first
    past = h_rows.shape[0] - ring
    if fmt != "bf16":  # the forward's FP8 gate/up on the rows as the forward pulled them (E4M3 from home)
        q = experts_q or quantize_experts(w_gate_up, w_down, fmt)
        x_q, x_s = x_rows.data[ring:], x_rows.scale[ring:]
        i = h_rows.shape[1] // 2
        out = ExpertForwardQuantized(h_rows[ring:], torch.empty(past, i, dtype=torch.float8_e4m3fn,
                                                               device=h_rows.device),
                                     torch.empty(past, i // SCALE_BLOCK[fmt], dtype=scale_dtype(fmt),
                                                 device=h_rows.device), None)
        forward_gate_up = gate_up_fp8 if fmt == "fp8-block" else gate_up_mxfp8
        forward_gate_up(x_q, x_s, counts, first, q.w_gate_up, q.w_gate_up_scale, out, swiglu_limit=swiglu_limit)
        return
    act = torch.empty(past, h_rows.shape[1] // 2, dtype=torch.bfloat16, device=x_rows.device)
    gate_up(x_rows[ring:], counts, first, w_gate_up, h_rows[ring:], act, swiglu_limit=swiglu_limit,
            minibatch=minibatch)


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t``'s first ``rows`` rows, zero rows appended where it has fewer."""
    if t.shape[0] >= rows:
        return t[:rows]
    out = torch.zeros(rows, *t.shape[1:], dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


def row_weights(workspace, schedule: PullSchedule, ranks: int) -> torch.Tensor:
    """fp32 `[capacity]`: the router weight of each row's route, read from its home rank's symmetric
    ``router_weights`` (0 on padding rows)."""
    index = schedule.src_index.clamp(min=0).long()
    w = torch.zeros(schedule.capacity, dtype=torch.float32, device=index.device)
    for r in range(ranks):
        home = workspace.peer("router_weights", r).view(-1).gather(0, index)
        w = torch.where(schedule.src_rank == r, home, w)
    return w


def push_router_grads(workspace, schedule: PullSchedule, d_router: torch.Tensor, ranks: int) -> None:
    """Each row's router-weight gradient into slot ``src_index`` of its home rank's symmetric ``d_router``
    (rows homed elsewhere, and padding, write the buffer's last slot, which nobody reads)."""
    dump = workspace.local("d_router").shape[0] - 1
    for r in range(ranks):
        index = torch.where(schedule.src_rank == r, schedule.src_index, dump).long()
        workspace.peer("d_router", r).scatter_(0, index, d_router)


def home_sums(d_x_slots: torch.Tensor, d_router_slots: torch.Tensor, top_experts: torch.Tensor, n: int, k: int,
              D: int, shared_dx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's gradients from the slots its routes' rows were pushed to: ``d_x[i] = sum_j slot[i*k + j]``
    in fixed order in FP32 (-1 routes masked) plus the shared experts' ``d_x``, rounded once to bf16 (one
    launch of the forward's weighted sum with weights 1: ``1 * slot`` is exact); the router-weight gradients
    of its routes (0 for -1 routes)."""
    valid = top_experts >= 0
    d_x = torch.empty(n, D, dtype=torch.bfloat16, device=top_experts.device)
    if n:
        ones = torch.ones(n, k, dtype=torch.float32, device=top_experts.device)
        # every valid id is < 2**31 - 1 (ids were checked, or recorded as errors, before any slot was pushed)
        weighted_sum(d_x, d_x_slots, top_experts, ones, torch.iinfo(torch.int32).max,
                     shared=None if shared_dx is None else shared_dx.contiguous())
    d_router = torch.where(valid, d_router_slots[: n * k].view(n, k), 0.0)
    return d_x, d_router


def _shared_backward(d_out, x, shared_h, shared, swiglu_limit):
    """The shared experts (fused into one FFN) over this rank's tokens: one expert of N rows, weight 1."""
    n = x.shape[0]
    ints = dict(dtype=torch.int32, device=x.device)
    return expert_backward(d_out.contiguous(), torch.ones(n, dtype=torch.float32, device=x.device),
                           x.contiguous(), shared_h[:n], torch.full((1,), n, **ints), torch.zeros(1, **ints),
                           shared[0][None], shared[1][None], swiglu_limit=swiglu_limit)
