"""The layer's backward from the standalone kernels, device-ordered through the backward's ring: the training path
until the backward megakernel fuses it, then its ablation.

Driven by the forward's pull schedule, per rank, all on the current stream:

1. stage: this rank's x, upstream gradient ``d_out [N, D]`` and router weights into the layer shape's symmetric
   workspace (FP8: x and ``d_out`` quantised there once, 1x128 / 1x32 along D); a device barrier;
2. per window of the schedule's rows (``megamoe.megakernel.backward_ring``: ``config.bwd_ring_rows`` rows, cut at
   multiples of 128 rows of an expert, so the memory does not grow with the EP size):
   - pull reverse-combine: each routed row's ``d_out`` row from its home rank, unscaled (FP8: its E4M3 row and
     scales, half the bytes), its x row again (BF16 keeps only h: pulling x moves bytes the links have time for
     under the backward's compute; FP8 reads the forward ring's E4M3 x and pulls only rows past a wrapped ring;
     one rank in BF16 with ``megamoe.ops.experts.GATHER_BACKWARD`` pulls neither: its dact and down wgrad read
     each row's token from the staged d_out themselves, its gate/up wgrad the staged x, but where h is recomputed
     from pulled x) and its router weight;
   - the rows' pre-activation h: the forward ring's, and the rows past it recomputed from the pulled x (the
     same bits);
   - the expert backward (:func:`~megamoe.ops.experts_bwd.expert_backward`; FP8: ``megamoe.ops.experts_fp8_bwd``'s,
     or with ``megamoe.ops.experts_mxfp8.AS_BF16`` the BF16 kernels on MX-rounded operands,
     ``megamoe.ops.experts_mxfp8_bf16``; where ``megamoe.planner.wgrads.bf16_wgrads_pay`` the weight gradients
     BF16 wgrads, one rank reading the staged BF16 d_out and x by token): ``d_act = d_out_row · W_down``, the
     SwiGLU backward with the router-weight gradient ``<d_act, act>`` fused (from the unscaled rows: no division
     by w), ``d_h = w · SwiGLU'(h) ⊙ d_act``, ``d_x_row = d_h · W_gate_up``, and the weight gradients over each
     expert's rows in one fixed order (FP32 accumulation, carried across windows in FP32);
   - push reverse-dispatch: each row's ``d_x`` into its home rank's ``[N*k, D]`` slots, its router-weight
     gradient into the home rank's ``[N*k]`` slots (one rank, but for mxfp8's own tiles: the d_x tiles store each
     row into its slot themselves, no copy);
3. a device barrier; at home: ``d_x[i] = sum_j slot[i*k + j]`` in fixed order in FP32, plus the shared experts'
   ``d_x`` (their backward over this rank's tokens, from the h the forward kept), rounded once.

Every reduction has a fixed order, so the gradients are bitwise equal across runs, comm_sms, minibatch, ring
and window size. No host sync with ``check=False``: every rank visits the same static number of windows (those
past its last row are empty, decided on the device). The backward megakernel
(:mod:`megamoe.megakernel.backward`) runs the same tiles through the same ring: its gradients are these bits.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from megamoe import runtime
from megamoe.config import Activation
from megamoe.megakernel.replay import layout_key
from megamoe.megakernel.saved import LayerGrads, SavedForward, home_sums
from megamoe.ops.comm import (dispatch_pull, pull_route_scalars, push_route_scalars,
                              reverse_combine_pull, reverse_dispatch_push)
from megamoe.ops.expert_bias import BiasGrads
from megamoe.ops import experts as expert_ops
from megamoe.ops.expert_weights import quantize_experts
from megamoe.ops.experts_bwd import expert_backward
from megamoe.ops.bf16_wgrads import TokenRows
from megamoe.ops.experts_fp8_bwd import expert_backward_fp8_block, expert_backward_mxfp8
from megamoe.ops.experts_mxfp8 import runs_as_bf16
from megamoe.ops.experts_mxfp8_bf16 import expert_backward_mxfp8_bf16
from megamoe.planner.wgrads import bf16_wgrads_pay, reads_x_by_token
from megamoe.routing.schedule import row_tokens


def composed_backward(kernel, saved: SavedForward, d_out: torch.Tensor, x: torch.Tensor,
                      top_experts: torch.Tensor, router_weights: torch.Tensor, w_gate_up: torch.Tensor,
                      w_down: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None,
                      activation: Activation, *, check: bool = True, b_gate_up: torch.Tensor | None = None,
                      b_down: torch.Tensor | None = None) -> LayerGrads:
    """The backward of ``kernel``'s forward pass that left ``saved`` (collective; see the module docstring).
    ``kernel`` is the MegaKernel that ran it (not imported here: the kernel imports this module).

    ``d_out`` bf16 `[N, D]` the upstream gradient; the other arguments are the forward's (``b_gate_up``, ``b_down``
    its optional expert biases: their gradients are FP32 segment sums over the windows, ``megamoe.ops.expert_bias``).
    ``check`` reads the kernel's error word after the pass (a timed-out barrier raises RuntimeError)."""
    world, s = kernel.world, kernel.shape
    n, D, k = x.shape[0], s.hidden, s.top_k
    schedule, fmt = saved.schedule, kernel.precision
    forward_ring = saved.h.shape[0]
    ws, ring = kernel.sym, kernel.backward_ring()
    sms = runtime.num_programs(world.device)
    # one rank, BF16, fp8-block and mxfp8 as the BF16 kernels: the d_x tiles store each row into its route's slot
    # (the push's copy skipped; mxfp8's own tiles write rows in order); BF16 with GATHER_BACKWARD: the dact and the
    # down wgrad also read each row's d_out from the staged d_out by token, and the gate/up wgrad each row's x from
    # the staged x (the pulls' copies skipped; the step 4 % faster at sonic-7b and qwen3-30b-a3b, one H200:
    # benchmarks/results/2026-12-06-h200-keyed-pool-step)
    own_slots = world.size == 1 and (fmt != "mxfp8" or runs_as_bf16(fmt))
    by_token = own_slots and fmt == "bf16" and expert_ops.GATHER_BACKWARD
    # one rank, mxfp8 as the BF16 kernels: its dact reads the staged d_out by token too, rounded to the grid once (N
    # rows, not N*k; the pull skipped) from the BF16 rows: the E4M3 rows' values, without quantising them first
    mx_by_token = own_slots and fmt == "mxfp8" and expert_ops.GATHER_BACKWARD
    rows_per_expert = s.rows_per_expert  # the balanced mean, for the tile plans
    # FP8 with BF16 wgrads (planner.wgrads.bf16_wgrads_pay: mxfp8, and fp8-block at few rows per expert); one rank's
    # read the staged BF16 d_out and x by token, not the E4M3 rows (which they would dequantise)
    bf16_wgrads = fmt != "bf16" and bf16_wgrads_pay(fmt, rows_per_expert)
    token_wgrads = reads_x_by_token(fmt, s)
    d_out = d_out.contiguous()
    # 1. stage; every rank's rows in place before anyone pulls (BF16 reads x again, FP8 only where a wrapped forward
    # ring lost rows); read by token, the staged rows too (N x D, a k-th of a pull's bytes): the kernel's own
    # addresses, so the backward's graph replays whatever tensors the caller passes
    # (its E4M3 rows only for the replay's pulls: one rank's BF16 wgrads read the BF16 rows)
    replays_any = schedule.capacity > forward_ring
    stage_x = fmt == "bf16" or token_wgrads or replays_any
    ws.stage(d_out=d_out, router_weights=router_weights.contiguous(), x=x if stage_x else None,
             unquantized=(() if replays_any else ("x",)) + (("d_out",) if mx_by_token else ()))
    kernel._barrier(0, "the start of a backward pass (every rank staged)")
    q = saved.experts_q
    fp8_weights = ()  # what the FP8 backward reads of the weights besides the masters
    if fmt != "bf16":
        q = q or quantize_experts(w_gate_up, w_down, fmt)
        if runs_as_bf16(fmt):  # the BF16 kernels on MX-rounded operands (E4M3 rows dequantised), the pack's weights
            rounded = q.rounded_weights(w_gate_up, w_down, backward=True)
            fp8_backward = partial(expert_backward_mxfp8_bf16, rows_per_expert=rows_per_expert, weights=rounded)
            fp8_weights = (*q.tensors(), *rounded.tensors())
        else:
            transposed = q.backward_weights(w_gate_up, w_down)
            fp8_backward = partial(expert_backward_fp8_block if fmt == "fp8-block" else expert_backward_mxfp8,
                                   weights_t=transposed)
            fp8_weights = (*q.tensors(), *transposed.tensors())
    with kernel.keyed_pool.allocating():  # the graph's key names them: their own pool, so their addresses repeat
        d_w_gate_up = torch.empty(w_gate_up.shape, dtype=torch.bfloat16, device=x.device)
        d_w_down = torch.empty(w_down.shape, dtype=torch.bfloat16, device=x.device)
        bias = BiasGrads.zeros(b_gate_up, b_down)  # FP32 across the windows, rounded once

    def windows() -> None:
        """2. the windows: device work only, reading and writing the kernel's buffers and the tensors keyed below."""
        if mx_by_token:
            dy_tokens = ws.local("d_out")[:max(n, 1)]  # a row to read when none is routed (never kept)
        for window in ring.windows(schedule):
            tokens = row_tokens(window.src_index, k) if by_token or token_wgrads or mx_by_token else None
            if by_token:
                dy = ws.local("d_out")
            elif mx_by_token:
                dy = dy_tokens
            else:
                dy = reverse_combine_pull(ws, window, num_sms=sms, out=ring.dy, sync=False)
            pull_route_scalars(ws, window, "router_weights", ring.row_w)
            h, x_rows = ring.saved_rows(saved, window)
            in_place = ring.in_forward_ring(saved, window)
            replays = not in_place and schedule.capacity > forward_ring  # h recomputed from pulled x rows
            x_index = tokens if by_token and not replays else None
            if x_index is not None:  # the gate/up wgrad reads the staged x by token
                x_rows = ws.local("x")
            elif fmt == "bf16":
                x_rows = dispatch_pull(ws, window, num_sms=sms, out=ring.x, sync=False)
            elif replays:
                dispatch_pull(ws, ring.past_forward_ring(window, forward_ring), num_sms=sms, out=ring.x, sync=False)
            if replays:
                ring.replay(window, forward_ring, x_rows, w_gate_up, activation, q, rows_per_expert, b_gate_up)
            out = ring.grads(d_w_gate_up, d_w_down)
            if own_slots:
                out = replace(out, d_x=ws.local("combine"), d_x_index=window.src_index)
            counts, offsets = window.tokens_per_expert, window.offsets
            if fmt != "bf16":
                token_rows = TokenRows(ws.local("d_out"), ws.local("x"), tokens) if token_wgrads else None
                fp8_backward(dy, ring.row_w, x_rows, h, counts, offsets, w_gate_up, w_down,
                             activation=activation, carry=ring.carry(window), out=out, bias=bias,
                             bf16_wgrads=bf16_wgrads, token_rows=token_rows,
                             **({"dy_index": tokens} if mx_by_token else {}))
            else:
                expert_backward(dy, ring.row_w, x_rows, h, counts, offsets, w_gate_up, w_down,
                                activation=activation, rows_per_expert=rows_per_expert, carry=ring.carry(window),
                                out=out, bias=bias, dy_index=tokens, x_index=x_index)
            if not own_slots:
                reverse_dispatch_push(ws, window, ring.d_x, num_sms=sms, sync=False)
            push_route_scalars(ws, window, ring.d_router, "d_router")

    if kernel.backward_replay is None:
        windows()
    else:  # from a CUDA graph once the token count and every tensor it touches that is not the kernel's repeat
        touched = (w_gate_up, w_down, b_gate_up, b_down, d_w_gate_up, d_w_down, saved.h, saved.ring_x,
                   saved.ring_scale, *schedule.tensors(), *fp8_weights,
                   *(() if bias is None else (bias.d_b_gate_up, bias.d_b_down)))
        kernel.backward_replay((n, activation, by_token, mx_by_token, bf16_wgrads, layout_key(touched)), windows)
    # 3. every push landed before anyone reads its slots; at home the k slots in fixed order, plus the shared experts
    kernel._barrier(0, "the end of a backward pass (every d_x push landed)")
    shared_gate_up = shared_down = shared_dx = None
    if shared is not None:
        sg = _shared_backward(d_out, x, saved.shared_h, shared, activation)
        shared_dx, shared_gate_up, shared_down = sg.d_x, sg.d_w_gate_up[0], sg.d_w_down[0]
    d_x, d_router = home_sums(ws.local("combine"), ws.local("d_router"), top_experts, n, k, D, shared_dx)
    if check:
        kernel.check_errors()
    d_b_gate_up, d_b_down = bias.rounded(b_gate_up, b_down) if bias is not None else (None, None)
    return LayerGrads(d_x, d_router, d_w_gate_up, d_w_down, shared_gate_up, shared_down, d_b_gate_up, d_b_down)


def _shared_backward(d_out, x, shared_h, shared, activation):
    """The shared experts (fused into one FFN) over this rank's tokens: one expert of N rows, weight 1."""
    n = x.shape[0]
    ints = dict(dtype=torch.int32, device=x.device)
    return expert_backward(d_out.contiguous(), torch.ones(n, dtype=torch.float32, device=x.device),
                           x.contiguous(), shared_h[:n], torch.full((1,), n, **ints), torch.zeros(1, **ints),
                           shared[0][None], shared[1][None], activation=activation)
