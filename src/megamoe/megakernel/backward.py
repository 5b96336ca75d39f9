"""The layer's backward as one megakernel launch per window of the backward's ring
(``megamoe.kernels.megakernel_bwd``), per rank.

A pass, all queued on the current stream (no host sync on a GPU with ``check=False``):

1. stage: this layer's x again, the upstream gradient ``d_out`` and the router weights into the layer shape's
   symmetric workspace; a device barrier;
2. per window of the schedule's rows (``megamoe.megakernel.backward_ring``: the composed backward's windows,
   buffers and carries):
   - each row's router weight, read from its home rank; the window's h (the forward ring's, in place or
     gathered; rows a wrapped forward ring lost recomputed from x pulled for them, before the launch: the kernel
     only reads h);
   - the backward megakernel over the window's rows: comm workers pull every row's d_out (unscaled) and x, and
     push each minibatch's d_x rows into the home ranks' ``[N*k, D]`` slots; compute workers run (in the first
     window) the shared expert's backward, per minibatch the dact and dx tiles, and last the window's weight
     gradient blocks (FP32 carries across windows); it ends with a barrier across ranks (every push landed);
   - with expert biases, their FP32 sums over the window's pulled d_out and d_h rows and the down bias's term of
     each row's router-weight gradient (``megamoe.ops.expert_bias``, as the composed backward adds them);
   - each row's router-weight gradient into its home rank's slots;
3. a device barrier; at home: the k d_x slots of each token in fixed order in FP32, plus the shared experts'
   d_x, rounded once; the router-weight gradients from their slots.

The tiles are the composed backward's (``megamoe.megakernel.backward_composed``), so the gradients are its bits.
A launch's arguments come in named groups (:mod:`megamoe.megakernel.backward_args`). On the CPU each window's
launch runs in phases (the interpreter runs programs one after another): the same code, one step of one role per
launch, sequenced by the host. One rank (the forward ran the expert kernels directly) takes the composed
backward: there is nothing to overlap.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe import runtime
from megamoe.config import Activation
from megamoe.kernels import megakernel_bwd as mkb
from megamoe.megakernel.backward_args import (BackwardConsts, BackwardSizeArgs, BackwardSyncArgs, CarryArgs,
                                              RoutedGradArgs, RowsArgs, SharedGradArgs, WindowArgs, check_order,
                                              ordered)
from megamoe.megakernel.launch import check_resident
from megamoe.megakernel.launch_args import PassEndArgs, RowTileArgs
from megamoe.megakernel.saved import LayerGrads, SavedForward, home_sums
from megamoe.ops.comm import dispatch_pull, pull_route_scalars, push_route_scalars
from megamoe.ops.expert_bias import BiasGrads, bias_backward
from megamoe.ops.experts_bwd import WgradCarry
from megamoe.ops.launch import scratch_allocator
from megamoe.planner.tiles import TileConfig
from megamoe.routing.row_tiles import build_row_tiles
from megamoe.routing.windows import ScheduleWindow
from megamoe.runtime import interpreting

check_order()  # the groups must be the kernel's signature: fail at import, not at a launch


@dataclass(frozen=True)
class BackwardBuffers:
    """The backward megakernel's own buffers beside the ring (the kernel's, shared by the layers of its shape;
    a launch writes them before it reads them): per window row the dact's outputs, per token the shared
    expert's."""

    d_h: torch.Tensor         # bf16 [rows, 2I]
    act_w: torch.Tensor       # bf16 [rows, I]   w * act (dW_down's B operand)
    partial: torch.Tensor     # fp32 [rows, cdiv(I, BN_DA)]   router-gradient partials per n-tile
    ones: torch.Tensor        # fp32 [N]        the shared expert's row weights
    shared_d_h: torch.Tensor  # bf16 [N, 2Is] (or [1, 1] without)
    shared_act_w: torch.Tensor
    shared_partial: torch.Tensor
    shared_dx: torch.Tensor   # bf16 [N, D]

    @classmethod
    def allocate(cls, kernel, rows: int, dact: TileConfig) -> BackwardBuffers:
        s, dev = kernel.shape, kernel.world.device
        I, D, Is, n = s.intermediate, s.hidden, s.shared_intermediate, max(s.max_tokens, 1)
        bf16, f32 = dict(dtype=torch.bfloat16, device=dev), dict(dtype=torch.float32, device=dev)
        num_n = -(-I // dact.block_n)
        shared_n = -(-max(Is, 1) // dact.block_n)
        return cls(
            d_h=torch.zeros(rows, 2 * I, **bf16), act_w=torch.zeros(rows, I, **bf16),
            partial=torch.zeros(rows, num_n, **f32), ones=torch.ones(n, **f32),
            shared_d_h=torch.zeros(n if Is else 1, 2 * Is if Is else 1, **bf16),
            shared_act_w=torch.zeros(n if Is else 1, Is if Is else 1, **bf16),
            shared_partial=torch.zeros(n, shared_n, **f32), shared_dx=torch.zeros(n, D, **bf16),
        )


class BackwardLauncher:
    """One MegaKernel's backward launches: tiles, buffers, counters, a launch's argument groups, the phased CPU
    mode."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        device = kernel.world.device if kernel.gpu else torch.device("cpu")
        self.dact, self.dx, self.wgrad = (kernel.tuning.tile(kind, device) for kind in ("dact", "dx", "wgrad"))
        rows, c = kernel.backward_ring().rows, kernel.config
        self.buffers = BackwardBuffers.allocate(kernel, rows, self.dact)
        M = max(1, -(-rows // c.bwd_minibatch))  # a window's minibatches
        T = -(-rows // c.tile_m) + kernel.shape.experts_per_rank + M
        shared_tiles = -(-max(kernel.shape.max_tokens, 1) // kernel.config.tile_m)
        self.counters = cnt = torch.zeros(2 * M + T + shared_tiles + 2, dtype=torch.int32, device=kernel.world.device)
        self.rows_ready, self.dx_done, self.dact_done = cnt[:M], cnt[M: 2 * M], cnt[2 * M: 2 * M + T]
        self.shared_done, self.dgrads_done, self.comm_done = cnt[2 * M + T: -2], cnt[-2:-1], cnt[-1:]
        self.checked_occupancy = set()

    def arguments(self, n, window: ScheduleWindow, h: torch.Tensor, tiles, w_gate_up, w_down, shared, activation,
                  d_w_gate_up, d_w_down, shared_grads, carry: WgradCarry,
                  has_shared: bool) -> tuple[tuple, BackwardConsts]:
        """(runtime arguments without the step index, constexprs) of a window's launch."""
        k, s, c, b = self.kernel, self.kernel.shape, self.kernel.config, self.buffers
        ring = k.backward_ring()
        D, I, L, Is = s.hidden, s.intermediate, s.experts_per_rank, s.shared_intermediate
        bm = c.tile_m
        desc = TensorDescriptor.from_tensor
        sym = k.sym
        da, dx, wg = self.dact, self.dx, self.wgrad
        routed = RoutedGradArgs(
            desc(ring.dy, [bm, da.block_k]), desc(w_down.view(L * D, I), [da.block_k, da.block_n]), h, h.stride(0),
            ring.row_w, b.d_h, b.act_w, b.partial, b.d_h.stride(0), b.act_w.stride(0), b.partial.stride(0),
            desc(b.d_h, [bm, dx.block_k]), desc(w_gate_up.view(L * 2 * I, D), [dx.block_k, dx.block_n]), ring.d_x,
            ring.d_x.stride(0), ring.d_router, d_w_down, d_w_gate_up)
        if has_shared:
            shared_args = SharedGradArgs(
                desc(sym.local("d_out"), [bm, da.block_k]), desc(shared[1], [da.block_k, da.block_n]),
                shared_grads.h, shared_grads.h.stride(0), b.ones, b.shared_d_h, b.shared_act_w, b.shared_partial,
                b.shared_d_h.stride(0), b.shared_act_w.stride(0), b.shared_partial.stride(0),
                desc(b.shared_d_h, [bm, dx.block_k]), desc(shared[0], [dx.block_k, dx.block_n]), b.shared_dx,
                b.shared_dx.stride(0), shared_grads.down, shared_grads.gate_up)
        else:  # never read (HAS_SHARED=False)
            r = routed
            shared_args = SharedGradArgs(r.dy_desc, r.w_down_desc, h, 0, b.ones, b.d_h, b.act_w, b.partial, 0, 0, 0,
                                         r.d_h_desc, r.w_gate_up_k_desc, ring.d_x, 0, d_w_down, d_w_gate_up)
        combine = sym.local("combine")
        args = ordered(
            WindowArgs(window.num_rows, window.src_rank, window.src_index, window.offsets, window.tokens_per_expert),
            RowTileArgs.of(tiles),
            RowsArgs(sym.peer_ptrs("d_out"), sym.local("d_out"), sym.peer_ptrs("x"), sym.local("x"), D, ring.dy,
                     ring.x, D, sym.peer_ptrs("combine"), combine, combine.stride(0)),
            routed,
            CarryArgs(carry.modes, carry.down_in, carry.down_out, carry.gate_up_in, carry.gate_up_out),
            shared_args,
            BackwardSyncArgs(self.rows_ready, self.dact_done, self.dx_done, self.shared_done, self.dgrads_done),
            PassEndArgs.of(k, self.comm_done),
            BackwardSizeArgs(n, k.world.rank, k.world.size, c.bwd_comm_sms, c.bwd_minibatch, L, I, D, Is,
                             activation.kernel_limit, activation.kernel_alpha, k.budget),
        )
        copy = k.launcher.consts  # the forward's copy tile of BF16 rows: the backward pulls and pushes such rows
        consts = BackwardConsts(
            s.top_k, copy["CHUNKS"], copy["CP"], copy["W"], copy["ROWS"], copy["ALIGN"], has_shared,
            activation.kernel_id, interpreting(), k.gpu, bm, da.block_n, da.block_k, dx.block_n, dx.block_k,
            wg.block_m, wg.block_n, wg.block_k, da.group_m, k.trace is not None and k.gpu)
        return args, consts

    def launch(self, args: tuple, consts: BackwardConsts, phase: int, programs: int, j: int = 0) -> None:
        fn = mkb.megakernel_bwd
        options = dict(asdict(consts), num_warps=self.dact.num_warps, num_stages=self.dact.num_stages)
        with scratch_allocator():  # the weight gradients make their TMA descriptors in the kernel
            variant = (phase, consts.HAS_SHARED)
            if self.kernel.gpu and variant not in self.checked_occupancy:
                compiled = fn.warmup(*args, j, PHASE=phase, grid=(programs,), **options)
                check_resident(compiled, options["num_warps"], self.kernel.world.device, "the backward megakernel")
                self.checked_occupancy.add(variant)
            fn[(programs,)](*args, j, PHASE=phase, **options)

    def run(self, args: tuple, consts: BackwardConsts, rows: int | None) -> None:
        """A window's launch: the whole grid at once on a GPU; on the CPU the steps in order (``rows``: the
        window's row count, read on the host there)."""
        c = self.kernel.config
        if self.kernel.gpu:
            self.launch(args, consts, mkb.PHASE_ALL.value, c.num_sms)
            return
        comm = c.bwd_comm_sms
        compute = c.num_sms - comm
        if consts.HAS_SHARED:
            self.launch(args, consts, mkb.PHASE_SHARED_DACT.value, compute)
            self.launch(args, consts, mkb.PHASE_SHARED_DX.value, compute)
        batches = -(-rows // c.bwd_minibatch)
        for j in range(batches):  # the comm workers pull every minibatch first (an uncut tile reaches into the next)
            self.launch(args, consts, mkb.PHASE_PULL.value, comm, j)
        for j in range(batches):
            self.launch(args, consts, mkb.PHASE_DACT.value, compute, j)
            self.launch(args, consts, mkb.PHASE_DX.value, compute, j)
        for j in range(batches):
            self.launch(args, consts, mkb.PHASE_PUSH.value, comm, j)
        self.launch(args, consts, mkb.PHASE_WGRAD.value, compute)


@dataclass(frozen=True)
class SharedGrads:
    """The shared expert's pre-activation the forward kept and where its weight gradients go."""

    h: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def fused_backward(kernel, saved: SavedForward, d_out: torch.Tensor, x: torch.Tensor, top_experts: torch.Tensor,
                   router_weights: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   shared: tuple[torch.Tensor, torch.Tensor] | None, activation: Activation, *,
                   check: bool = True, b_gate_up: torch.Tensor | None = None,
                   b_down: torch.Tensor | None = None) -> LayerGrads:
    """The backward of ``kernel``'s forward pass that left ``saved`` (collective; see the module docstring)."""
    k, s, c = kernel, kernel.shape, kernel.config
    if k._broken is not None:
        raise RuntimeError(k._broken)
    bl, ring = k.backward_launcher(), k.backward_ring()
    n, D, kk = x.shape[0], s.hidden, s.top_k
    sym = k.sym
    schedule, forward_ring = saved.schedule, saved.h.shape[0]
    # 1. stage
    sym.stage(x=x, d_out=d_out, router_weights=router_weights)
    k._barrier(0, "the start of a backward pass (every rank staged)")
    dev = x.device
    d_w_gate_up = torch.empty(w_gate_up.shape, dtype=torch.bfloat16, device=dev)
    d_w_down = torch.empty(w_down.shape, dtype=torch.bfloat16, device=dev)
    shared_grads = None if shared is None else SharedGrads(
        saved.shared_h, torch.empty(1, *shared[0].shape, dtype=torch.bfloat16, device=dev),
        torch.empty(1, *shared[1].shape, dtype=torch.bfloat16, device=dev))
    rows_per_expert = s.max_tokens * kk / max(s.experts_per_rank, 1)
    sms = runtime.num_programs(k.world.device)
    bias = BiasGrads.zeros(b_gate_up, b_down)  # FP32 across the windows, rounded once (the composed backward's)
    # 2. the windows
    for window in ring.windows(schedule):
        pull_route_scalars(sym, window, "router_weights", ring.row_w)
        h, _ = ring.saved_rows(saved, window)
        if not ring.in_forward_ring(saved, window) and schedule.capacity > forward_ring:
            x_rows = dispatch_pull(sym, ring.past_forward_ring(window, forward_ring), num_sms=sms, out=ring.x,
                                   sync=False)
            ring.replay(window, forward_ring, x_rows, w_gate_up, activation, None, rows_per_expert, b_gate_up)
        tiles = build_row_tiles(window.tokens_per_expert, window.offsets, window.capacity, c.tile_m,
                                minibatch=c.bwd_minibatch, cut=False)
        bl.counters.zero_()
        if k.trace is not None:
            k.trace.zero_()
        has_shared = shared is not None and window.index == 0
        args, consts = bl.arguments(n, window, h, tiles, w_gate_up, w_down, shared, activation, d_w_gate_up,
                                    d_w_down, shared_grads, ring.carry(window), has_shared)
        bl.run(args, consts, None if k.gpu else int(window.num_rows))
        if not k.gpu:
            k.world.barrier("the backward megakernel's end (every d_x push landed)")
        # the biases' sums over the rows the launch left (pulled d_out, d_h) and the down bias's router term,
        # before the router gradients leave: the composed backward's kernels in its order, so its bits
        bias_backward(bias, bl.buffers.d_h, ring.dy, ring.row_w, window.tokens_per_expert, window.offsets,
                      ring.d_router)
        push_route_scalars(sym, window, ring.d_router, "d_router")
    # 3. every router-gradient push landed; at home
    k._barrier(0, "the backward's router-gradient pushes")
    d_x, d_router = home_sums(sym.local("combine"), sym.local("d_router"), top_experts, n, kk, D,
                              bl.buffers.shared_dx[:n] if shared is not None else None)
    if check:
        k.check_errors()
    d_b_gate_up, d_b_down = bias.rounded(b_gate_up, b_down) if bias is not None else (None, None)
    return LayerGrads(d_x, d_router, d_w_gate_up, d_w_down,
                      None if shared is None else shared_grads.gate_up[0],
                      None if shared is None else shared_grads.down[0], d_b_gate_up, d_b_down)
