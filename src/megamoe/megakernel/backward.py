"""The layer's backward as one megakernel launch per window of the backward's ring
(``megamoe.kernels.megakernel_bwd``), per rank.

A pass, all queued on the current stream (no host sync on a GPU with ``check=False``):

1. stage: this layer's x again, the upstream gradient ``d_out`` and the router weights into the layer shape's
   symmetric workspace; a device barrier;
2. per window of the schedule's rows (``megamoe.megakernel.backward_ring``: the composed backward's windows,
   buffers and carries):
   - each row's router weight, read from its home rank; the window's h (the forward ring's, in place or
     gathered; rows a wrapped forward ring lost recomputed from x pulled for them);
   - the backward megakernel over the window's rows: comm workers pull every row's d_out (unscaled) and x, and
     push each minibatch's d_x rows into the home ranks' ``[N*k, D]`` slots; compute workers run (in the first
     window) the shared expert's backward, per minibatch the dact and dx tiles, and last the window's weight
     gradient blocks (FP32 carries across windows); it ends with a barrier across ranks (every push landed);
   - each row's router-weight gradient into its home rank's slots;
3. a device barrier; at home: the k d_x slots of each token in fixed order in FP32, plus the shared experts'
   d_x, rounded once; the router-weight gradients from their slots.

The tiles are the composed backward's (``megamoe.megakernel.backward_composed``), so the gradients are its bits.
On the CPU each window's launch runs in phases (the interpreter runs programs one after another): the same code,
one step of one role per launch, sequenced by the host. One rank (the forward ran the expert kernels directly)
takes the composed backward: there is nothing to overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe import runtime
from megamoe.kernels import megakernel_bwd as mkb
from megamoe.megakernel.launch import check_resident
from megamoe.megakernel.saved import LayerGrads, SavedForward, home_sums
from megamoe.ops.comm import dispatch_pull, pull_route_scalars, push_route_scalars
from megamoe.ops.experts_bwd import WgradCarry
from megamoe.ops.launch import scratch_allocator
from megamoe.ops.tiles import TileConfig, plan_tiles
from megamoe.routing.row_tiles import build_row_tiles
from megamoe.routing.windows import ScheduleWindow
from megamoe.runtime import interpreting


#: ``slots`` for the kernel: no minibatch of a window is replayed inside the launch (a window's lost rows are
#: recomputed before it), so none reaches it.
NO_REPLAY = 2**30


@dataclass(frozen=True)
class BackwardBuffers:
    """The backward megakernel's own buffers beside the ring (the kernel's, shared by the layers of its shape;
    a launch writes them before it reads them): per window row the dact's outputs, per token the shared
    expert's."""

    d_h: torch.Tensor         # bf16 [rows, 2I]
    act_w: torch.Tensor       # bf16 [rows, I]   w * act (dW_down's B operand)
    partial: torch.Tensor     # fp32 [rows, cdiv(I, BN_DA)]   router-gradient partials per n-tile
    unused: torch.Tensor      # bf16 [1, 2I]    the replay buffers' stand-in (never read: NO_REPLAY)
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
            partial=torch.zeros(rows, num_n, **f32), unused=torch.zeros(1, 2 * I, **bf16),
            ones=torch.ones(n, **f32), shared_d_h=torch.zeros(n if Is else 1, 2 * Is if Is else 1, **bf16),
            shared_act_w=torch.zeros(n if Is else 1, Is if Is else 1, **bf16),
            shared_partial=torch.zeros(n, shared_n, **f32), shared_dx=torch.zeros(n, D, **bf16),
        )


class BackwardLauncher:
    """One MegaKernel's backward launches: tiles, buffers, a launch's arguments by name, the phased CPU mode."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        device = kernel.world.device if kernel.gpu else torch.device("cpu")
        self.gate_up = kernel.tiles()[0]  # the kernel's replay tiles (compiled in, never run: NO_REPLAY)
        self.dact, self.dx, self.wgrad = (plan_tiles(kind, device) for kind in ("dact", "dx", "wgrad"))
        rows, c = kernel.backward_ring().rows, kernel.config
        self.buffers = BackwardBuffers.allocate(kernel, rows, self.dact)
        M = max(1, -(-rows // c.bwd_minibatch))  # a window's minibatches
        T = -(-rows // c.tile_m) + kernel.shape.experts_per_rank + M
        shared_tiles = -(-max(kernel.shape.max_tokens, 1) // kernel.config.tile_m)
        self.counters = torch.zeros(2 * M + 2 * T + shared_tiles + 2, dtype=torch.int32, device=kernel.world.device)
        cnt = self.counters
        self.views = dict(rows_ready_ptr=cnt[:M], dx_done_ptr=cnt[M: 2 * M], replay_done_ptr=cnt[2 * M: 2 * M + T],
                          dact_done_ptr=cnt[2 * M + T: 2 * M + 2 * T],
                          shared_done_ptr=cnt[2 * M + 2 * T: 2 * M + 2 * T + shared_tiles],
                          dgrads_done_ptr=cnt[-2:-1], comm_done_ptr=cnt[-1:])
        self.checked_occupancy = set()

    def arguments(self, n, window: ScheduleWindow, h: torch.Tensor, tiles, w_gate_up, w_down, shared, swiglu_limit,
                  d_w_gate_up, d_w_down, shared_grads, carry: WgradCarry, has_shared: bool) -> dict:
        """A window's launch: its runtime arguments and constexprs by name (the kernel's signature orders them)."""
        k, s, c, b = self.kernel, self.kernel.shape, self.kernel.config, self.buffers
        ring = k.backward_ring()
        D, I, L, Is = s.hidden, s.intermediate, s.experts_per_rank, s.shared_intermediate
        bm = c.tile_m
        desc = TensorDescriptor.from_tensor
        sym = k.sym
        gu, da, dx, wg = self.gate_up, self.dact, self.dx, self.wgrad
        values = dict(
            num_rows_ptr=window.num_rows, src_rank_ptr=window.src_rank, src_index_ptr=window.src_index,
            offsets_ptr=window.offsets, counts_ptr=window.tokens_per_expert, tile_expert_ptr=tiles.tile_expert,
            tile_row0_ptr=tiles.tile_row0, tile_row_end_ptr=tiles.tile_row_end, tile_run_ptr=tiles.tile_run,
            minibatch_tiles_ptr=tiles.minibatch_tiles,
            d_out_peer_ptrs=sym.peer_ptrs("d_out"), d_out_ptr=sym.local("d_out"), x_peer_ptrs=sym.peer_ptrs("x"),
            x_ptr=sym.local("x"), stride_rows=D, dy_ptr=ring.dy, x_rows_ptr=ring.x, stride_pass=D,
            slots_peer_ptrs=sym.peer_ptrs("combine"), slots_ptr=sym.local("combine"),
            stride_slots=sym.local("combine").stride(0),
            dy_desc=desc(ring.dy, [bm, da.block_k]), w_down_desc=desc(w_down.view(L * D, I), [da.block_k, da.block_n]),
            ring_h_ptr=h, stride_ring_h=h.stride(0), h_replay_ptr=b.unused, act_replay_ptr=b.unused,
            stride_h_replay=0, stride_act_replay=0, x_desc=desc(ring.x, [bm, gu.block_k]),
            w_gate_up_desc=desc(w_gate_up.view(L * 2 * I, D), [gu.block_n, gu.block_k]),
            row_w_ptr=ring.row_w, d_h_ptr=b.d_h, act_w_ptr=b.act_w, partial_ptr=b.partial,
            stride_d_h=b.d_h.stride(0), stride_act_w=b.act_w.stride(0), stride_partial=b.partial.stride(0),
            d_h_desc=desc(b.d_h, [bm, dx.block_k]),
            w_gate_up_k_desc=desc(w_gate_up.view(L * 2 * I, D), [dx.block_k, dx.block_n]),
            dx_ptr=ring.d_x, stride_dx=ring.d_x.stride(0), d_router_ptr=ring.d_router, d_w_down_ptr=d_w_down,
            d_w_gate_up_ptr=d_w_gate_up, modes_ptr=carry.modes, down_in_ptr=carry.down_in,
            down_out_ptr=carry.down_out, gate_up_in_ptr=carry.gate_up_in, gate_up_out_ptr=carry.gate_up_out,
            flag_peer_ptrs=k.flag_ptrs[1], flags_ptr=sym.local("pass_flags")[1], epoch_ptr=k.epochs[1:],
            error_ptr=k.error, trace_base_ptr=k.error if k.trace is None else k.trace,
            tokens=n, my_rank=k.world.rank, num_ranks=k.world.size, comm_sms=c.bwd_comm_sms,
            minibatch=c.bwd_minibatch, slots=NO_REPLAY, ring_rows=0, experts=L, I=I, D=D,
            shared_I=Is, limit=float(swiglu_limit or 0.0), budget=k.budget, **self.views,
        )
        if has_shared:
            values.update(
                shared_dy_desc=desc(sym.local("d_out"), [bm, da.block_k]),
                shared_w_down_desc=desc(shared[1], [da.block_k, da.block_n]), shared_h_ptr=shared_grads.h,
                stride_shared_h=shared_grads.h.stride(0), ones_ptr=b.ones, shared_d_h_ptr=b.shared_d_h,
                shared_act_w_ptr=b.shared_act_w, shared_partial_ptr=b.shared_partial,
                stride_shared_d_h=b.shared_d_h.stride(0), stride_shared_act_w=b.shared_act_w.stride(0),
                stride_shared_partial=b.shared_partial.stride(0), shared_d_h_desc=desc(b.shared_d_h, [bm, dx.block_k]),
                shared_w_gate_up_k_desc=desc(shared[0], [dx.block_k, dx.block_n]), shared_dx_ptr=b.shared_dx,
                stride_shared_dx=b.shared_dx.stride(0), d_shared_down_ptr=shared_grads.down,
                d_shared_gate_up_ptr=shared_grads.gate_up)
        else:  # never read (HAS_SHARED=False)
            values.update(
                shared_dy_desc=values["dy_desc"], shared_w_down_desc=values["w_down_desc"], shared_h_ptr=h,
                stride_shared_h=0, ones_ptr=b.ones, shared_d_h_ptr=b.d_h, shared_act_w_ptr=b.act_w,
                shared_partial_ptr=b.partial, stride_shared_d_h=0, stride_shared_act_w=0, stride_shared_partial=0,
                shared_d_h_desc=values["d_h_desc"], shared_w_gate_up_k_desc=values["w_gate_up_k_desc"],
                shared_dx_ptr=ring.d_x, stride_shared_dx=0, d_shared_down_ptr=d_w_down,
                d_shared_gate_up_ptr=d_w_gate_up)
        chunks, cp, w, rows, align = k.launcher.consts["CHUNKS"], k.launcher.consts["CP"], k.launcher.consts["W"], \
            k.launcher.consts["ROWS"], k.launcher.consts["ALIGN"]
        values.update(
            TOP_K=s.top_k, CHUNKS=chunks, CP=cp, W=w, ROWS=rows, ALIGN=align, HAS_SHARED=has_shared,
            HAS_LIMIT=swiglu_limit is not None, DOT_FP32=interpreting(), FENCE=k.gpu, BLOCK_M=bm,
            BN_GU=gu.block_n, BK_GU=gu.block_k, BN_DA=da.block_n, BK_DA=da.block_k, BN_DX=dx.block_n,
            BK_DX=dx.block_k, BM_W=wg.block_m, BN_W=wg.block_n, BK_W=wg.block_k, GROUP_M=da.group_m,
            TRACE=k.trace is not None and k.gpu)
        return values

    def launch(self, values: dict, phase: int, programs: int, j: int = 0) -> None:
        fn = mkb.megakernel_bwd
        args = {name: values[name] for name in fn.arg_names if name not in ("PHASE", "phase_minibatch")}
        options = dict(num_warps=self.dact.num_warps, num_stages=self.dact.num_stages)
        with scratch_allocator():  # the weight gradients make their TMA descriptors in the kernel
            variant = (phase, values["HAS_SHARED"])
            if self.kernel.gpu and variant not in self.checked_occupancy:
                compiled = fn.warmup(**args, phase_minibatch=j, PHASE=phase, grid=(programs,), **options)
                check_resident(compiled, options["num_warps"], self.kernel.world.device, "the backward megakernel")
                self.checked_occupancy.add(variant)
            fn[(programs,)](**args, phase_minibatch=j, PHASE=phase, **options)

    def run(self, values: dict, rows: int | None) -> None:
        """A window's launch: the whole grid at once on a GPU; on the CPU the steps in order (``rows``: the
        window's row count, read on the host there)."""
        c = self.kernel.config
        if self.kernel.gpu:
            self.launch(values, mkb.PHASE_ALL.value, c.num_sms)
            return
        comm = c.bwd_comm_sms
        compute = c.num_sms - comm
        if values["HAS_SHARED"]:
            self.launch(values, mkb.PHASE_SHARED_DACT.value, compute)
            self.launch(values, mkb.PHASE_SHARED_DX.value, compute)
        batches = -(-rows // c.bwd_minibatch)
        for j in range(batches):  # the comm workers pull every minibatch first (an uncut tile reaches into the next)
            self.launch(values, mkb.PHASE_PULL.value, comm, j)
        for j in range(batches):
            self.launch(values, mkb.PHASE_DACT.value, compute, j)
            self.launch(values, mkb.PHASE_DX.value, compute, j)
        for j in range(batches):
            self.launch(values, mkb.PHASE_PUSH.value, comm, j)
        self.launch(values, mkb.PHASE_WGRAD.value, compute)


@dataclass(frozen=True)
class SharedGrads:
    """The shared expert's pre-activation the forward kept and where its weight gradients go."""

    h: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def fused_backward(kernel, saved: SavedForward, d_out: torch.Tensor, x: torch.Tensor, top_experts: torch.Tensor,
                   router_weights: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   shared: tuple[torch.Tensor, torch.Tensor] | None, swiglu_limit: float | None, *,
                   check: bool = True) -> LayerGrads:
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
    # 2. the windows
    for window in ring.windows(schedule):
        pull_route_scalars(sym, window, "router_weights", ring.row_w)
        h, _ = ring.saved_rows(saved, window)
        if not ring.in_forward_ring(saved, window) and schedule.capacity > forward_ring:
            x_rows = dispatch_pull(sym, ring.past_forward_ring(window, forward_ring), num_sms=sms, out=ring.x,
                                   sync=False)
            ring.replay(window, forward_ring, x_rows, w_gate_up, swiglu_limit, None, rows_per_expert)
        tiles = build_row_tiles(window.tokens_per_expert, window.offsets, window.capacity, c.tile_m,
                                minibatch=c.bwd_minibatch, cut=False)
        bl.counters.zero_()
        if k.trace is not None:
            k.trace.zero_()
        has_shared = shared is not None and window.index == 0
        values = bl.arguments(n, window, h, tiles, w_gate_up, w_down, shared, swiglu_limit, d_w_gate_up, d_w_down,
                              shared_grads, ring.carry(window), has_shared)
        bl.run(values, None if k.gpu else int(window.num_rows))
        if not k.gpu:
            k.world.barrier("the backward megakernel's end (every d_x push landed)")
        push_route_scalars(sym, window, ring.d_router, "d_router")
    # 3. every router-gradient push landed; at home
    k._barrier(0, "the backward's router-gradient pushes")
    d_x, d_router = home_sums(sym.local("combine"), sym.local("d_router"), top_experts, n, kk, D,
                              bl.buffers.shared_dx[:n] if shared is not None else None)
    if check:
        k.check_errors()
    return LayerGrads(d_x, d_router, d_w_gate_up, d_w_down,
                      None if shared is None else shared_grads.gate_up[0],
                      None if shared is None else shared_grads.down[0])
