"""The layer's backward as one megakernel pass (``megamoe.kernels.megakernel_bwd``), per rank.

A pass, all queued on the current stream (no host sync on a GPU with ``check=False``):

1. stage: this layer's x again, the upstream gradient ``d_out`` and the router weights into the kernel's
   symmetric buffers; a device barrier;
2. each routed row's router weight, read from its home rank; the row tiles, cut at the backward's minibatch
   boundaries (``KernelConfig.bwd_minibatch``) only when the forward's ring wrapped;
3. the backward megakernel: comm workers pull every routed row's d_out (unscaled) and x, and push each
   minibatch's d_x rows into the home ranks' ``[N*k, D]`` slots; compute workers run the shared expert's
   backward, per minibatch the replayed gate/up (past the ring), dact and dx tiles, and last every weight
   gradient; it ends with a barrier across ranks (every push landed);
4. each row's router-weight gradient into its home rank's slots; a device barrier;
5. at home: the k d_x slots of each token in fixed order in FP32, plus the shared experts' d_x, rounded once;
   the router-weight gradients from their slots.

The tiles are the composed backward's (``megamoe.megakernel.backward_composed``), so the gradients are its bits.
On the CPU step 3 runs in phases (the interpreter runs programs one after another): the same code, one step of
one role per launch, sequenced by the host. One rank (the forward ran the expert kernels directly) takes the
composed backward: there is nothing to overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.kernels import megakernel_bwd as mkb
from megamoe.megakernel.launch import check_resident
from megamoe.megakernel.backward_composed import LayerGrads, SavedForward, home_sums, push_router_grads, row_weights
from megamoe.ops.launch import scratch_allocator
from megamoe.ops.tiles import TileConfig, plan_tiles
from megamoe.routing.row_tiles import build_row_tiles
from megamoe.runtime import interpreting


@dataclass(frozen=True)
class BackwardBuffers:
    """The backward pass's own buffers (the kernel's, shared by the layers of its shape; a pass writes them all
    before it reads them). Routed rows live at their row (capacity rows), so the weight gradients find every
    row after the last minibatch."""

    dy: torch.Tensor          # bf16 [cap, D]   d_out of each row's token (pulled)
    x_rows: torch.Tensor      # bf16 [cap, D]   x of each row's token (pulled)
    row_w: torch.Tensor       # fp32 [cap]      each row's router weight
    h_replay: torch.Tensor    # bf16 [cap - ring_rows (>= 1), 2I]   recomputed h of the rows the ring lost
    act_replay: torch.Tensor  # bf16 [same, I]  the replay's act (not read)
    d_h: torch.Tensor         # bf16 [cap, 2I]
    act_w: torch.Tensor       # bf16 [cap, I]   w * act (dW_down's B operand)
    partial: torch.Tensor     # fp32 [cap, cdiv(I, BN_DA)]   router-gradient partials per n-tile
    d_router: torch.Tensor    # fp32 [cap]
    dx: torch.Tensor          # bf16 [cap, D]
    ones: torch.Tensor        # fp32 [N]        the shared expert's row weights
    shared_d_h: torch.Tensor  # bf16 [N, 2Is] (or [1, 1] without)
    shared_act_w: torch.Tensor
    shared_partial: torch.Tensor
    shared_dx: torch.Tensor   # bf16 [N, D]

    @classmethod
    def allocate(cls, kernel, dact: TileConfig) -> BackwardBuffers:
        s, c, dev = kernel.shape, kernel.config, kernel.world.device
        cap, D, I, Is, n = s.capacity, s.hidden, s.intermediate, s.shared_intermediate, max(s.max_tokens, 1)
        bf16, f32 = dict(dtype=torch.bfloat16, device=dev), dict(dtype=torch.float32, device=dev)
        replay = max(cap - c.ring_rows, 1)
        num_n = -(-I // dact.block_n)
        shared_n = -(-max(Is, 1) // dact.block_n)
        return cls(
            dy=torch.zeros(cap, D, **bf16), x_rows=torch.zeros(cap, D, **bf16), row_w=torch.zeros(cap, **f32),
            h_replay=torch.zeros(replay, 2 * I, **bf16), act_replay=torch.empty(replay, I, **bf16),
            d_h=torch.zeros(cap, 2 * I, **bf16), act_w=torch.zeros(cap, I, **bf16),
            partial=torch.zeros(cap, num_n, **f32), d_router=torch.zeros(cap, **f32), dx=torch.empty(cap, D, **bf16),
            ones=torch.ones(n, **f32), shared_d_h=torch.zeros(n if Is else 1, 2 * Is if Is else 1, **bf16),
            shared_act_w=torch.zeros(n if Is else 1, Is if Is else 1, **bf16),
            shared_partial=torch.zeros(n, shared_n, **f32), shared_dx=torch.zeros(n, D, **bf16),
        )


class BackwardLauncher:
    """One MegaKernel's backward passes: tiles, buffers, the launch's arguments by name, the phased CPU mode."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        device = kernel.world.device if kernel.gpu else torch.device("cpu")
        self.gate_up = kernel.tiles()[0]  # the replay recomputes h with the forward's gate/up tiles
        self.dact, self.dx, self.wgrad = (plan_tiles(kind, device) for kind in ("dact", "dx", "wgrad"))
        self.buffers = BackwardBuffers.allocate(kernel, self.dact)
        cap, c = kernel.shape.capacity, kernel.config
        M = max(1, -(-cap // c.bwd_minibatch))  # the backward's own minibatches
        T = -(-cap // c.tile_m) + kernel.shape.experts_per_rank + M
        shared_tiles = -(-max(kernel.shape.max_tokens, 1) // kernel.config.tile_m)
        self.counters = torch.zeros(2 * M + 2 * T + shared_tiles + 2, dtype=torch.int32, device=kernel.world.device)
        cnt = self.counters
        self.views = dict(rows_ready_ptr=cnt[:M], dx_done_ptr=cnt[M: 2 * M], replay_done_ptr=cnt[2 * M: 2 * M + T],
                          dact_done_ptr=cnt[2 * M + T: 2 * M + 2 * T],
                          shared_done_ptr=cnt[2 * M + 2 * T: 2 * M + 2 * T + shared_tiles],
                          dgrads_done_ptr=cnt[-2:-1], comm_done_ptr=cnt[-1:])
        self.checked_occupancy = False

    def arguments(self, n, saved: SavedForward, tiles, w_gate_up, w_down, shared, swiglu_limit, grads) -> dict:
        """The launch's runtime arguments and constexprs by name (the kernel's signature orders them)."""
        k, s, c, b = self.kernel, self.kernel.shape, self.kernel.config, self.buffers
        D, I, L, Is = s.hidden, s.intermediate, s.experts_per_rank, s.shared_intermediate
        bm = c.tile_m
        desc = TensorDescriptor.from_tensor
        sym = k.sym
        sch = saved.schedule
        gu, da, dx, wg = self.gate_up, self.dact, self.dx, self.wgrad
        values = dict(
            num_rows_ptr=sch.num_rows, src_rank_ptr=sch.src_rank, src_index_ptr=sch.src_index,
            offsets_ptr=sch.offsets, counts_ptr=sch.tokens_per_expert, tile_expert_ptr=tiles.tile_expert,
            tile_row0_ptr=tiles.tile_row0, tile_row_end_ptr=tiles.tile_row_end, tile_run_ptr=tiles.tile_run,
            minibatch_tiles_ptr=tiles.minibatch_tiles,
            d_out_peer_ptrs=sym.peer_ptrs("d_out"), d_out_ptr=sym.local("d_out"), x_peer_ptrs=sym.peer_ptrs("x"),
            x_ptr=sym.local("x"), stride_rows=D, dy_ptr=b.dy, x_rows_ptr=b.x_rows, stride_pass=D,
            slots_peer_ptrs=sym.peer_ptrs("combine"), slots_ptr=sym.local("combine"),
            stride_slots=sym.local("combine").stride(0),
            dy_desc=desc(b.dy, [bm, da.block_k]), w_down_desc=desc(w_down.view(L * D, I), [da.block_k, da.block_n]),
            ring_h_ptr=saved.h, stride_ring_h=saved.h.stride(0), h_replay_ptr=b.h_replay, act_replay_ptr=b.act_replay,
            stride_h_replay=b.h_replay.stride(0), stride_act_replay=b.act_replay.stride(0),
            x_desc=desc(b.x_rows, [bm, gu.block_k]),
            w_gate_up_desc=desc(w_gate_up.view(L * 2 * I, D), [gu.block_n, gu.block_k]),
            row_w_ptr=b.row_w, d_h_ptr=b.d_h, act_w_ptr=b.act_w, partial_ptr=b.partial,
            stride_d_h=b.d_h.stride(0), stride_act_w=b.act_w.stride(0), stride_partial=b.partial.stride(0),
            d_h_desc=desc(b.d_h, [bm, dx.block_k]),
            w_gate_up_k_desc=desc(w_gate_up.view(L * 2 * I, D), [dx.block_k, dx.block_n]),
            dx_ptr=b.dx, stride_dx=b.dx.stride(0), d_router_ptr=b.d_router, d_w_down_ptr=grads.w_down,
            d_w_gate_up_ptr=grads.w_gate_up,
            flag_peer_ptrs=k.flag_ptrs[1], flags_ptr=sym.local("flags")[1], epoch_ptr=k.epochs[1:],
            error_ptr=k.error, trace_base_ptr=k.error if k.trace is None else k.trace,
            tokens=n, my_rank=k.world.rank, num_ranks=k.world.size, comm_sms=c.bwd_comm_sms,
            minibatch=c.bwd_minibatch, slots=c.ring_rows // c.bwd_minibatch, ring_rows=c.ring_rows, experts=L, I=I, D=D,
            shared_I=Is, limit=float(swiglu_limit or 0.0), budget=k.budget, **self.views,
        )
        if shared is not None:
            values.update(
                shared_dy_desc=desc(sym.local("d_out"), [bm, da.block_k]),
                shared_w_down_desc=desc(shared[1], [da.block_k, da.block_n]), shared_h_ptr=saved.shared_h,
                stride_shared_h=saved.shared_h.stride(0), ones_ptr=b.ones, shared_d_h_ptr=b.shared_d_h,
                shared_act_w_ptr=b.shared_act_w, shared_partial_ptr=b.shared_partial,
                stride_shared_d_h=b.shared_d_h.stride(0), stride_shared_act_w=b.shared_act_w.stride(0),
                stride_shared_partial=b.shared_partial.stride(0), shared_d_h_desc=desc(b.shared_d_h, [bm, dx.block_k]),
                shared_w_gate_up_k_desc=desc(shared[0], [dx.block_k, dx.block_n]), shared_dx_ptr=b.shared_dx,
                stride_shared_dx=b.shared_dx.stride(0), d_shared_down_ptr=grads.shared_down,
                d_shared_gate_up_ptr=grads.shared_gate_up)
        else:  # never read (HAS_SHARED=False)
            values.update(
                shared_dy_desc=values["dy_desc"], shared_w_down_desc=values["w_down_desc"], shared_h_ptr=saved.h,
                stride_shared_h=0, ones_ptr=b.ones, shared_d_h_ptr=b.d_h, shared_act_w_ptr=b.act_w,
                shared_partial_ptr=b.partial, stride_shared_d_h=0, stride_shared_act_w=0, stride_shared_partial=0,
                shared_d_h_desc=values["d_h_desc"], shared_w_gate_up_k_desc=values["w_gate_up_k_desc"],
                shared_dx_ptr=b.dx, stride_shared_dx=0, d_shared_down_ptr=grads.w_down,
                d_shared_gate_up_ptr=grads.w_gate_up)
        chunks, cp, w, rows, align = k.launcher.consts["CHUNKS"], k.launcher.consts["CP"], k.launcher.consts["W"], \
            k.launcher.consts["ROWS"], k.launcher.consts["ALIGN"]
        values.update(
            TOP_K=s.top_k, CHUNKS=chunks, CP=cp, W=w, ROWS=rows, ALIGN=align, HAS_SHARED=shared is not None,
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
            if self.kernel.gpu and not self.checked_occupancy:
                compiled = fn.warmup(**args, phase_minibatch=j, PHASE=phase, grid=(programs,), **options)
                check_resident(compiled, options["num_warps"], self.kernel.world.device, "the backward megakernel")
                self.checked_occupancy = True
            fn[(programs,)](**args, phase_minibatch=j, PHASE=phase, **options)

    def run(self, values: dict, rows: int | None) -> None:
        """The pass: one launch of the whole grid on a GPU; on the CPU the steps in order (``rows``: the
        schedule's row count, read on the host there)."""
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
        slots = c.ring_rows // c.bwd_minibatch
        for j in range(batches):  # the comm workers pull every minibatch first (an uncut tile reaches into the next)
            self.launch(values, mkb.PHASE_PULL.value, comm, j)
        for j in range(batches):
            if j >= slots:
                self.launch(values, mkb.PHASE_REPLAY.value, compute, j)
            self.launch(values, mkb.PHASE_DACT.value, compute, j)
            self.launch(values, mkb.PHASE_DX.value, compute, j)
        for j in range(batches):
            self.launch(values, mkb.PHASE_PUSH.value, comm, j)
        self.launch(values, mkb.PHASE_WGRAD.value, compute)


def fused_backward(kernel, saved: SavedForward, d_out: torch.Tensor, x: torch.Tensor, top_experts: torch.Tensor,
                   router_weights: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   shared: tuple[torch.Tensor, torch.Tensor] | None, swiglu_limit: float | None, *,
                   check: bool = True) -> LayerGrads:
    """The backward of ``kernel``'s forward pass that left ``saved`` (collective; see the module docstring)."""
    k, s, c = kernel, kernel.shape, kernel.config
    if k._broken is not None:
        raise RuntimeError(k._broken)
    bl = k.backward_launcher()
    n, D, kk = x.shape[0], s.hidden, s.top_k
    sym = k.sym
    # 1. stage
    sym.local("x")[:n].copy_(x)
    sym.local("d_out")[:n].copy_(d_out)
    sym.local("router_weights")[:n].copy_(router_weights)
    k._barrier(0, "the start of a backward pass (every rank staged)")
    # 2. row weights from the home ranks; the forward's row tiles
    sch = saved.schedule
    bl.buffers.row_w.copy_(row_weights(sym, sch, k.world.size))
    # cut at the backward's minibatches when the ring wrapped (the ring's end is one of their boundaries)
    tiles = build_row_tiles(sch.tokens_per_expert, sch.offsets, sch.capacity, c.tile_m, minibatch=c.bwd_minibatch,
                            cut=sch.num_rows > c.ring_rows)
    grads = LayerGrads(
        x=None, router_weights=None,
        w_gate_up=torch.empty(w_gate_up.shape, dtype=torch.bfloat16, device=x.device),
        w_down=torch.empty(w_down.shape, dtype=torch.bfloat16, device=x.device),
        shared_gate_up=None if shared is None else torch.empty(1, *shared[0].shape, dtype=torch.bfloat16,
                                                                device=x.device),
        shared_down=None if shared is None else torch.empty(1, *shared[1].shape, dtype=torch.bfloat16,
                                                             device=x.device))
    # 3. the megakernel
    bl.counters.zero_()
    if k.trace is not None:
        k.trace.zero_()
    values = bl.arguments(n, saved, tiles, w_gate_up, w_down, shared, swiglu_limit, grads)
    bl.run(values, None if k.gpu else int(sch.num_rows))
    if not k.gpu:
        k.world.barrier("the backward megakernel's end (every d_x push landed)")
    # 4. router-weight gradients home
    push_router_grads(sym, sch, bl.buffers.d_router, k.world.size)
    k._barrier(0, "the backward's router-gradient pushes")
    # 5. at home
    d_x, d_router = home_sums(sym.local("combine"), sym.local("d_router"), top_experts, n, kk, D,
                              bl.buffers.shared_dx[:n] if shared is not None else None)
    if check:
        k.check_errors()
    return LayerGrads(d_x, d_router, grads.w_gate_up, grads.w_down,
                      None if shared is None else grads.shared_gate_up[0],
                      None if shared is None else grads.shared_down[0])
