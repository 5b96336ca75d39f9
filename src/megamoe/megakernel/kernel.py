"""The megakernel of one layer shape: its pass, step by step.

(One object, one file, over 450 lines: :class:`MegaKernel` owns a layer shape's state — its config, workspace,
launcher, graphs, error word — and every entry that touches it; its launches' arguments, buffers, replay and the
backward's ring and launchers already live in their own modules beside it.)

A pass, all queued on the current stream with no host sync (so it can be captured in a CUDA graph once
``check=False``):

1. stage: this rank's x into the symmetric ``x``; its routing ids into row ``rank`` of every rank's ``routing``
   buffer;
2. a device barrier across ranks (every x and routing row is in place);
3. the pull schedule and its minibatch row tiles, built on the device;
4. the megakernel (``megamoe.kernels.megakernel``): communication workers pull minibatches into the ring and push
   finished ones home (when the ring holds every row, only the rows other ranks own: a rank's own outputs stay in
   the ring), compute workers run the shared expert and the routed gate/up + SwiGLU and down tiles; it ends with a
   barrier across ranks (every push landed);
5. the weighted sum of each token's k outputs (its combine slots, or the ring rows of its own routes; router
   weights, fixed order) plus the shared output, rounded once to bf16.

On a GPU steps 2-4 read only the kernel's and the layer's buffers and the weights, so from the second pass with the
same weights and layer buffers (addresses; values may change in place) and token count they replay from a CUDA
graph (:mod:`megamoe.megakernel.replay`; one per key, so each MoE layer of a model sharing this kernel gets its
own): an eager pass then pays the host for steps 1 and 5 only.

What the backward reads belongs to the layer, not to this kernel: each pass writes the
:class:`~megamoe.megakernel.buffers.LayerBuffers` it is given (new ones when none are) and returns them in its
:class:`~megamoe.megakernel.buffers.ForwardContext`. The kernel's own buffers (staging, combine slots, expert
outputs, counters) live only within a pass and are shared by every layer of its shape.

One rank has no peers and so nothing to overlap: there (unless asked for the megakernel) steps 2 and 4 become a
gather of the routed rows into the ring and the expert kernels on every SM (``megamoe.ops.experts``: the same tile
functions, the same bits), and the weighted sum reads each route's output row in place.

On the CPU (the Triton interpreter runs programs one after another, so programs cannot wait for each other) step 4
runs in phases (:mod:`megamoe.megakernel.launch`), with host barriers across the simulated ranks. Each tile is
computed by the same code on the same rows either way: outputs are bitwise equal across runs and across
``comm_sms``, ``minibatch`` and ``ring_rows``.

Several shared experts run as one: SwiGLU FFNs with intermediate sizes Is_1..Is_S sum to one FFN whose gate, up
and down weights are their concatenations.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import torch

from megamoe import checks
from megamoe.config import SWIGLU, Activation
from megamoe.inputs import MoEInputs
from megamoe.ops.comm import CommShape, comm_workspace
from megamoe.parallel.world import EPWorld
from megamoe.kernels import megakernel as mk
from megamoe.kernels import megakernel_bwd as mkb
from megamoe.kernels import sync
from megamoe.megakernel.backward_ring import BackwardRing
from megamoe.megakernel.buffers import ForwardContext, LayerBuffers
from megamoe.megakernel.launch import Launcher
from megamoe.megakernel.replay import GraphReplay, device_pool, layout_key
from megamoe.ops import experts as expert_ops
from megamoe.ops.expert_weights import QuantizedExperts, quantize_experts
from megamoe.ops.experts import ExpertForward, ExpertForwardQuantized, expert_forward
from megamoe.ops.experts_fp8 import expert_forward_fp8_block
from megamoe.ops.experts_mxfp8 import expert_forward_mxfp8, runs_as_bf16
from megamoe.ops.experts_mxfp8_bf16 import expert_forward_mxfp8_bf16
from megamoe.ops.quant import quantize_activations
from megamoe.planner.tiles import TileConfig, plan_tiles
from megamoe.planner.tuning import DEFAULT_TUNING, Tuning
from megamoe.planner.wgrads import reads_x_by_token
from megamoe.ops.weighted_sum import weighted_sum
from megamoe.planner import KernelConfig, LayerShape, check_kernel_config, plan
from megamoe.precision import SCALE_BLOCK, check_precision
from megamoe.routing.row_tiles import RowTiles, build_row_tiles
from megamoe.routing.schedule import PullSchedule, build_pull_schedule, row_tokens
from megamoe.runtime import INTERPRETER_PROGRAMS, compiled_gpu, resolve_wait_budget

#: The kernel's FMT code of each precision of the routed experts (the shared expert stays BF16). Each rank
#: quantises its tokens while staging them (1x32 / 1x128 along D), the weights are quantised once per optimizer
#: step (``quantize_experts``: mxfp8 1x32 along the reduction axis, fp8-block 128x128), act in the gate/up
#: epilogue; MXFP8 runs dequantise-on-load tiles (megamoe.ops.experts_mxfp8).
FMT = {"bf16": mk.FMT_BF16.value, "mxfp8": mk.FMT_MXFP8.value, "fp8-block": mk.FMT_FP8_BLOCK.value}

WAITS = {
    mkb.WAIT_BWD_ROWS.value: "backward rows_ready of minibatch",
    mkb.WAIT_DACT.value: "backward dact done of row tile",
    mkb.WAIT_DX.value: "backward dx done of minibatch",
    mkb.WAIT_SHARED_DACT.value: "backward shared dact done of row tile",
    mkb.WAIT_DGRADS.value: "backward dact tasks of every minibatch (total)",
    sync.WAIT_ROWS_READY.value: "rows_ready of minibatch",
    sync.WAIT_TILE_DONE.value: "gate/up done of row tile",
    sync.WAIT_Y_DONE.value: "y done of minibatch",
    sync.WAIT_SHARED_DONE.value: "shared gate/up done of row tile",
    sync.WAIT_PASS_END.value: "end-of-pass barrier flag of rank",
    sync.WAIT_PASS_START.value: "start-of-pass barrier flag of rank",
}


def default_config(world: EPWorld, shape: LayerShape, precision: str = "bf16") -> KernelConfig:
    """The planner's KernelConfig for this shape and precision on this device (GPU), or a small one for the
    interpreter."""
    tokens = max(shape.max_tokens, 1)
    if compiled_gpu(world.device):
        tile = plan_tiles("down", world.device)
        return plan(shape.config(), world.size, tokens, num_sms=available_sms(world), precision=precision,
                    tile_m=tile.block_m, tile_n=tile.block_n).config
    tile = plan_tiles("down", torch.device("cpu"))
    # Interpreter: small minibatches so even tiny shapes cross a few minibatches.
    minibatch = 2 * tile.block_m
    ring = max(1, math.ceil(tokens * shape.top_k / minibatch)) * minibatch
    return KernelConfig(INTERPRETER_PROGRAMS, 1, minibatch, ring, tile.block_m, tile.block_n)


def available_sms(world: EPWorld) -> int:
    """SMs one rank's grid may take: ranks sharing a GPU (correctness runs) split its SMs, since every rank's grid
    must be resident at once."""
    return torch.cuda.get_device_properties(world.device).multi_processor_count // world.ranks_per_device


#: ``MegaKernel.bad_route`` when no pass saw an out-of-range expert id.
NO_BAD_ROUTE = (1 << 63) - 1


class MegaKernel:
    """One rank's megakernel for one layer shape: symmetric workspace, pass buffers, counters, launches.

    Collective to build (allocates symmetric memory). ``forward`` is a pass;
    every rank makes the same sequence of passes. Layers of one shape may share a MegaKernel: each pass
    writes the layer's own :class:`LayerBuffers`. On one rank a pass runs the
    expert kernels on every SM instead of the megakernel (same bits) when the
    ring holds every routed row; ``one_rank_megakernel=True`` keeps the
    megakernel there (traces, tests). ``replay=False`` launches every pass's device work (the forward's, the
    composed backward's windows) from the host instead of replaying its CUDA graph (same bits). The outputs of a
    rank's own routes stay in the ring when it holds every row (1-2 % over pushing them too:
    benchmarks/results/2026-11-30-own-outputs).
    """

    def __init__(self, world: EPWorld, shape: LayerShape, config: KernelConfig | None = None, *,
                 precision: str = "bf16", wait_budget: int | None = None, trace: bool = False,
                 one_rank_megakernel: bool = False, replay: bool = True, tuning: Tuning | None = None):
        check_precision(precision)
        self.world, self.shape, self.precision = world, shape, precision
        # pins of the planner's choices (routed tiles, tile ring depth, comm copy tile); None: the planner's
        self.tuning = tuning or DEFAULT_TUNING
        self.fmt, self.scale_block = FMT[precision], SCALE_BLOCK[precision]
        self.quantized = precision != "bf16"
        self.gpu = compiled_gpu(world.device)
        self.config = config or default_config(world, shape, precision)
        if shape.num_ranks != world.size:
            raise ValueError(f"the shape is for {shape.num_ranks} ranks, the world has {world.size}")
        # one small all-gather per kernel, before any symmetric allocation (those would hang or misread)
        world.check_agree("MegaKernel", dict(max_tokens=shape.max_tokens, D=shape.hidden, I=shape.intermediate,
                                             L=shape.experts_per_rank, k=shape.top_k,
                                             shared_I=shape.shared_intermediate, precision=precision,
                                             config=self.config))
        check_kernel_config(self.config, shape, precision, tile_m=self.tiles()[0].block_m,
                            available_sms=available_sms(world) if self.gpu else None,
                            where=("the interpreter" if not self.gpu else "this GPU" if world.ranks_per_device == 1
                                   else f"this rank's share of a GPU ({world.ranks_per_device} ranks on one GPU)"))
        R, N, D, k = shape.num_ranks, shape.max_tokens, shape.hidden, shape.top_k
        Is, c = shape.shared_intermediate, self.config
        # One rank: the expert kernels on every SM, unless the megakernel is asked for or the ring is too small
        # to hold every routed row (kimi-k2 at EP 1: the megakernel's comm workers would only copy local rows,
        # and it ran 0.95x of nccl-torch; benchmarks/results/2026-11-30-one-rank). Its weighted sum reads the
        # outputs in place: no combine slots.
        self.direct = R == 1 and not one_rank_megakernel and c.ring_rows >= shape.capacity
        # the layer shape's one symmetric workspace (megamoe.ops.comm, kept on the world: the standalone launches
        # share it): this rank's x (FP8: quantised once per token while staging, not once per route on arrival:
        # that needed 19 comm SMs where copying E4M3 rows needs 12, benchmarks/results/2026-11-30-fp8-experts), the
        # routing ids, the combine slots (the backward's d_x slots), the backward's d_out and router weights (peers
        # pull and read them) and router-weight gradient slots, the pass barriers' flags and epochs
        self.sym = comm_workspace(world, CommShape(R, max(N, 1), D, k, shape.experts_per_rank,
                                                   row_format=precision))
        dev = world.device
        # the pass's own buffers (shared by the layers using this kernel; read within a pass only)
        self.y = torch.empty(c.ring_rows, D, dtype=torch.bfloat16, device=dev)
        self.shared_y = torch.empty(max(N, 1), D, dtype=torch.bfloat16, device=dev) if Is else None
        # counters: rows_ready [M] | y_done [M] | tile_done [tiles] | shared_done [shared tiles] | comm_done [1]
        self.max_batches = max(1, -(-shape.capacity // c.minibatch))
        self.max_tiles = -(-shape.capacity // c.tile_m) + shape.experts_per_rank + self.max_batches
        shared_tiles = -(-max(N, 1) // c.tile_m)
        self.counters = torch.zeros(2 * self.max_batches + self.max_tiles + shared_tiles + 1, dtype=torch.int32,
                                    device=dev)
        self.epochs = self.sym.local("pass_epochs")
        self.error = torch.zeros(4, dtype=torch.int32, device=dev)
        # the first out-of-range expert id a pass saw (token * k + slot) << 32 | id, NO_BAD_ROUTE if none: unchecked
        # passes treat such a route as none, and the next checked call raises on it
        self.bad_route = torch.full((1,), NO_BAD_ROUTE, dtype=torch.int64, device=dev)
        # trace (GPU only): per program its globaltimer stamps and wait totals, then its event log (kernels.sync)
        self.trace = torch.zeros(c.num_sms, sync.TRACE_ROW.value, dtype=torch.int64, device=dev) if trace else None
        self.budget = resolve_wait_budget(wait_budget)
        self.barrier_budget = resolve_wait_budget(wait_budget, barrier=True)  # waits on the peers' host too
        self.flag_ptrs = [self.sym.peer_ptrs("pass_flags") + row * R * 4 for row in range(2)]
        self.launcher = Launcher(self)
        # A route's output stays in y (the schedule's own_rows; else the weighted sum reads its combine slot):
        # on one rank every route; at EP >= 2 this rank's own routes when the ring holds every row (the kernel
        # then pushes only the other ranks' rows home).
        self._own_rows_within = shape.capacity if self.direct else c.ring_rows
        ints = dict(dtype=torch.int32, device=dev)
        if self.direct:
            self._shared_rows, self._shared_start = torch.zeros(1, **ints), torch.zeros(1, **ints)
            # the load's mean for the expert kernels' tile plan (their rows are the capacity)
            self._rows_per_expert = shape.capacity / shape.experts_per_rank
        self._broken: str | None = None
        self._scratch: LayerBuffers | None = None
        self._backward: object | None = None  # the backward megakernel's launcher, made at its first pass
        self._backward_ring: BackwardRing | None = None
        self._act_bf16: torch.Tensor | None = None  # one rank, mxfp8 run as BF16 kernels: act (made on first use)
        # GPU: a pass's device work replays from a CUDA graph once its weights, buffers and token count repeat
        self.replay = GraphReplay() if replay and self.gpu else None
        # and the composed backward's windows (their launches came 130-300 us apart, the GPU waiting on the host;
        # replayed, the backward 4.21 -> 3.66 ms at qwen3-30b-a3b 8192 on an H100:
        # benchmarks/results/2026-12-06-h100-backward-graphs); they leave nothing live, so they share one pool
        self.backward_replay = GraphReplay(shared_pool=True) if replay and self.gpu else None
        # what the graphs' keys name that a pass hands out (a training forward's h, the weight gradients), from a
        # pool of their own, so that their addresses, and the keys, repeat step after step (none without graphs)
        self.keyed_pool = device_pool(dev, enabled=None if replay and self.gpu else False)

    def tiles(self, routed: bool = True) -> tuple[TileConfig, TileConfig]:
        """(gate/up, down) tiles of the routed experts (``routed``) or of the shared expert (always BF16)."""
        device = self.world.device if self.gpu else torch.device("cpu")
        if routed:
            return tuple(self.tuning.tile(kind, device, fmt=self.precision) for kind in ("gate_up", "down"))
        return plan_tiles("gate_up", device), plan_tiles("down", device)

    def new_buffers(self) -> LayerBuffers:
        """A layer's buffers for this kernel's shape, config and precision (what one context keeps)."""
        return LayerBuffers.allocate(self.shape, self.config, self.precision, self.world.device)

    def scratch_buffers(self) -> LayerBuffers:
        """Buffers of this kernel for passes whose context nobody keeps (forward only): reused by each such pass."""
        if self._scratch is None:
            self._scratch = self.new_buffers()
        return self._scratch

    def training_buffers(self) -> LayerBuffers:
        """Buffers for a pass whose backward keeps only what the training op returns (``megamoe::layer_forward``):
        new ones for h, the shared expert's h and (FP8) the ring's E4M3 rows and scales, the kernel's scratch for
        the rest (BF16's ring rows, the activations: written and read within the pass). A layer's pass then
        allocates and zero-fills no ``[ring, D + I]`` of its own (the kept E4M3 ring is not zero-filled either)."""
        scratch = self.scratch_buffers()
        kept = dict(dtype=torch.bfloat16, device=self.world.device)
        rows, s = self.config.ring_rows, self.shape
        with self.keyed_pool.allocating():
            fresh = dict(h=torch.empty(rows, 2 * s.intermediate, **kept),
                         shared_h=None if scratch.shared_h is None else torch.empty_like(scratch.shared_h))
            if self.quantized:  # unfilled: no unwritten row reaches a result (results/2026-12-07-ring-poison-probe)
                fresh.update(ring_x=torch.empty_like(scratch.ring_x), ring_scale=torch.empty_like(scratch.ring_scale))
        return dataclasses.replace(scratch, **fresh)

    def backward_launcher(self):
        """The backward megakernel's launcher (made on first use)."""
        if self._backward is None:
            from megamoe.megakernel.backward import BackwardLauncher

            self._backward = BackwardLauncher(self)
        return self._backward

    def backward_ring(self) -> BackwardRing:
        """The backward's window buffers, both backwards' (made on first use; read within a pass only)."""
        if self._backward_ring is None:
            self._backward_ring = BackwardRing.allocate(self.shape, self.config, self.precision, self.world.device)
        return self._backward_ring

    def backward(self, saved, d_out, x, top_experts, router_weights, w_gate_up, w_down, shared, activation, *,
                 check: bool = True, fused: bool = True, b_gate_up=None, b_down=None, validated: bool = False):
        """The backward of a forward pass of this kernel that left ``saved`` (collective): the backward
        megakernel (``megamoe.megakernel.backward``), or with ``fused=False`` (and on one rank, where the forward
        ran the expert kernels directly) the standalone kernels composed (``megamoe.megakernel.backward_composed``:
        the same bits). ``b_gate_up``, ``b_down``: the forward's expert biases; ``validated``: the forward's inputs
        were checked by the caller (:meth:`forward`'s; ``d_out`` is checked here either way). Returns
        the :class:`~megamoe.megakernel.backward_composed.LayerGrads`."""
        from megamoe.megakernel.backward import fused_backward
        from megamoe.megakernel.backward_composed import composed_backward

        if self.precision != "bf16" and fused and not self.direct:
            raise ValueError(f"the backward megakernel runs BF16 experts: the {self.precision} backward runs the "
                             f"standalone kernels composed (fused_backward=False, moe()'s default)")
        if not validated:
            self.check_inputs(x, top_experts, router_weights, w_gate_up, w_down, shared, activation, b_gate_up,
                              b_down)
        if not isinstance(d_out, torch.Tensor) or d_out.shape != x.shape or d_out.dtype != torch.bfloat16:
            raise ValueError(f"d_out must be bfloat16 of x's shape {tuple(x.shape)}, got {checks.describe(d_out)}")
        if fused and not self.direct:
            return fused_backward(self, saved, d_out, x, top_experts, router_weights, w_gate_up, w_down, shared,
                                  activation, check=check, b_gate_up=b_gate_up, b_down=b_down)
        return composed_backward(self, saved, d_out, x, top_experts, router_weights, w_gate_up, w_down, shared,
                                 activation, check=check, b_gate_up=b_gate_up, b_down=b_down)

    def check_errors(self) -> None:
        """Raise RuntimeError if a wait of an earlier pass timed out, ValueError if an earlier pass (unchecked)
        had an expert id out of range (reads the error words: a host sync; the id record is cleared)."""
        if self._broken is not None:
            raise RuntimeError(self._broken)
        code, index, target, seen = self.error.tolist()
        if code:
            what = WAITS.get(code, f"wait #{code}")
            self._broken = (f"rank {self.world.rank}: the megakernel timed out waiting for {what} {index} "
                            f"(wanted >= {target}, saw {seen}); this MegaKernel's counters are out of step now")
            raise RuntimeError(self._broken)
        bad = int(self.bad_route.item())
        if bad != NO_BAD_ROUTE:
            self.bad_route.fill_(NO_BAD_ROUTE)
            route, expert = bad >> 32, (bad & 0xFFFFFFFF) - (1 << 32 if bad & 0x80000000 else 0)
            k, experts = self.shape.top_k, self.shape.experts_per_rank * self.shape.num_ranks
            raise ValueError(f"rank {self.world.rank}: a pass with check=False had top_experts[{route // k}, "
                             f"{route % k}] = {expert}, outside -1 (no route) and 0..{experts - 1}; it ran as no "
                             f"route (the first such id of those passes)")

    def _record_bad_routes(self, n: int) -> None:
        """Keep the first out-of-range id of this rank's staged routing (device ops only: no host sync)."""
        if n == 0:
            return
        ids = self.sym.local("routing")[self.world.rank, :n].reshape(-1).to(torch.int64)
        experts = self.shape.experts_per_rank * self.shape.num_ranks
        route = torch.arange(ids.numel(), device=ids.device, dtype=torch.int64)
        codes = torch.where((ids < -1) | (ids >= experts), (route << 32) | (ids & 0xFFFFFFFF), NO_BAD_ROUTE)
        torch.minimum(self.bad_route, codes.min().view(1), out=self.bad_route)

    # ---- a pass

    def forward(
        self,
        x: torch.Tensor,
        top_experts: torch.Tensor,
        router_weights: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        shared: tuple[torch.Tensor, torch.Tensor] | None = None,
        activation: Activation = SWIGLU,
        *,
        experts_q: QuantizedExperts | None = None,
        buffers: LayerBuffers | None = None,
        check: bool = True,
        b_gate_up: torch.Tensor | None = None,
        b_down: torch.Tensor | None = None,
        validated: bool = False,
    ) -> tuple[torch.Tensor, ForwardContext]:
        """One forward pass (collective). Inputs as :func:`~megamoe.megakernel.forward.megamoe_forward`
        (validated there), ``shared`` one (gate_up, down) pair or None. ``buffers``: the layer's buffers to
        write (:meth:`new_buffers`; None allocates new ones); the returned context owns them until it is
        dropped, so pass only buffers no live context holds. ``check`` reads the error word after the pass (a
        host sync). ``b_gate_up`` bf16 `[L, 2I]`, ``b_down`` bf16 `[L, D]`: the routed experts' optional biases,
        added in the gate/up and down epilogues (on the experts' rank). ``validated``: the caller checked these
        inputs against this kernel's shape (``moe``, ``megamoe_forward``: the kernel was chosen for their shape),
        so :meth:`check_inputs` is not run again (25-50 us of host time a pass on a 2-core CPU)."""
        if self._broken is not None:
            raise RuntimeError(self._broken)
        if not validated:
            self.check_inputs(x, top_experts, router_weights, w_gate_up, w_down, shared, activation, b_gate_up,
                              b_down)
        if check:  # an earlier unchecked pass's error first
            self.check_errors()
        if experts_q is not None:
            if not self.quantized:
                raise ValueError("experts_q is for the FP8 precisions; this pass runs bf16 experts")
            experts_q.check_source(w_gate_up, w_down, self.precision)
        buffers = self.new_buffers() if buffers is None else buffers
        s = self.shape
        n = x.shape[0]
        self._stage(x, top_experts, shared is not None)
        if self.quantized and experts_q is None:  # quantised in this pass, before the device work (its graph)
            experts_q = quantize_experts(w_gate_up, w_down, self.precision)
        # 2-4: the device work, replayed from a graph when the weights, buffers and token count repeat
        work = partial(self._device_work, n, buffers, w_gate_up, w_down, experts_q, shared, activation, b_gate_up,
                       b_down)
        if self.replay is None:
            schedule, tiles = work()
        else:
            q = () if experts_q is None else (experts_q.w_gate_up, experts_q.w_gate_up_scale, experts_q.w_down,
                                              experts_q.w_down_scale,
                                              *(experts_q.rounded.tensors() if experts_q.rounded is not None else ()))
            key = (n, activation, layout_key((w_gate_up, w_down, *q, *(shared or (None, None)), b_gate_up, b_down,
                                                *buffers.tensors())))
            schedule, tiles = self.replay(key, work)
        # 5. the weighted sum
        out = torch.empty(n, s.hidden, dtype=torch.bfloat16, device=x.device)
        if n:
            self._weighted_sum(out, schedule.own_rows, top_experts, router_weights, shared is not None)
        if check:
            self.check_errors()
        return out, ForwardContext(schedule, tiles, self.config, buffers)

    def check_inputs(self, x, top_experts, router_weights, w_gate_up, w_down, shared, activation, b_gate_up=None,
                     b_down=None) -> None:
        """ValueError unless a pass's arguments fit this kernel's shape (no host sync: the ids are not read)."""
        s = self.shape
        pairs = () if shared is None else (shared,)
        dims = MoEInputs(x, top_experts, router_weights, w_gate_up, w_down, pairs, activation, b_gate_up,
                         b_down).validate(dtypes="bf16", world=self.world, check_ids=False)
        n = dims.tokens
        got = dict(D=dims.hidden, k=dims.top_k, L=dims.experts, I=dims.intermediate,
                   shared_I=sum(dn.shape[1] for _, dn in pairs))
        want = dict(D=s.hidden, k=s.top_k, L=s.experts_per_rank, I=s.intermediate, shared_I=s.shared_intermediate)
        for name in got:
            if got[name] != want[name]:
                raise ValueError(f"this MegaKernel was built for {name}={want[name]}, the pass has {name}={got[name]}")
        if n > s.max_tokens:
            raise ValueError(f"this MegaKernel was built for at most {s.max_tokens} tokens per rank, the pass has {n}")

    @property
    def _rounds_staged_x(self) -> bool:
        """One rank's mxfp8 as the BF16 kernels (the switch read at each pass), reading the tokens by index, and
        nobody their E4M3 rows (the backward reads x by token): x is staged BF16 and rounded to the grid in the
        device work (a copy at the stage, not a quantiser launch; the same values)."""
        return self.direct and runs_as_bf16(self.precision) and reads_x_by_token(self.precision, self.shape)

    def _stage(self, x: torch.Tensor, top_experts: torch.Tensor, has_shared: bool) -> None:
        """Step 1: x into the symmetric rows (FP8: quantised, once per token; the BF16 rows only for the shared
        expert, from the same read of x; BF16 rows alone where nobody reads E4M3 ones, ``_rounds_staged_x``) and the
        routing ids into row ``rank`` of every rank's routing buffer."""
        n, me = x.shape[0], self.world.rank
        x_sym = self.sym.local("x")[:n]
        if not self.quantized or self._rounds_staged_x:
            x_sym.copy_(x)
        elif n:  # straight into the symmetric rows the comm workers pull
            quantize_activations(x, self.precision, out=(self.sym.local("x_q")[:n].view(torch.float8_e4m3fn),
                                                        self.sym.local("x_scale")[:n]),
                                 copy=x_sym if has_shared else None)
        if top_experts.dtype != torch.int32:  # wider ids saturate: an id past int32 stays out of range (recorded)
            top_experts = top_experts.clamp(-2**31, 2**31 - 1)
        for r in range(self.world.size):
            row = self.sym.peer("routing", r)[me]
            row[:n].copy_(top_experts)
            if n < row.shape[0]:  # padding rows: no route
                row[n:].fill_(-1)

    def _device_work(self, n, buffers, w_gate_up, w_down, experts_q, shared, activation, b_gate_up=None,
                     b_down=None) -> tuple[PullSchedule, RowTiles]:
        """Steps 2-4 of a pass (x and the routing ids staged): reads only this kernel's and the layer's buffers
        and the weights."""
        s, c, me = self.shape, self.config, self.world.rank
        self._record_bad_routes(n)
        # 2. every rank staged
        if not self.direct:
            self._barrier(0)
        # 3. the schedule and its minibatch row tiles
        schedule = build_pull_schedule(self.sym.local("routing")[:, : max(s.max_tokens, 1)], me, s.experts_per_rank,
                                       own_rows_within=self._own_rows_within)
        # tiles are cut at minibatch boundaries only when the ring wraps (decided on the device: the cuts cost
        # the GEMMs ~6 % at 1920-row minibatches, benchmarks/results/2026-11-30-one-rank, section 8)
        tiles = build_row_tiles(schedule.tokens_per_expert, schedule.offsets, schedule.capacity, c.tile_m,
                                minibatch=c.minibatch, cut=schedule.num_rows > c.ring_rows)
        # 4. the megakernel (one rank: the expert kernels)
        if self.direct:
            self._run_experts(n, schedule, buffers, w_gate_up, w_down, experts_q, shared, activation, b_gate_up,
                              b_down)
        else:
            self.counters.zero_()
            if self.trace is not None:
                self.trace.zero_()
            args, consts = self.launcher.arguments(n, schedule, tiles, buffers, w_gate_up, w_down, experts_q, shared,
                                                   activation, b_gate_up, b_down)
            self.launcher.run(schedule, args, consts)
            if not self.gpu:
                self.world.barrier("the end of a forward pass (every push landed)")
            elif not c.overlap:  # the one launch's own end-of-pass barrier, as a launch of its own
                self._barrier(1, "the end of a forward pass (every push landed)")
        return schedule, tiles

    def _barrier(self, row: int, what: str = "the start of a forward pass (every rank staged)") -> None:
        if self.world.size == 1:  # nobody to wait for: the stream orders one rank's own work (and a launch less)
            return
        if not self.gpu:
            self.world.barrier(what)
            return
        sync.pass_barrier_kernel[(1,)](self.flag_ptrs[row], self.sym.local("pass_flags")[row], self.epochs[row:],
                                     self.world.rank, self.world.size, self.barrier_budget, self.error,
                                     num_warps=1)

    def _run_experts(self, n, schedule, buffers, w_gate_up, w_down, experts_q, shared, activation, b_gate_up=None,
                     b_down=None) -> None:
        """One rank: the routed rows gathered into the ring (BF16 with ``GATHER_FORWARD``: read from the tokens by
        index instead, no copy; mxfp8 as the BF16 kernels where the backward reads x by token: none, as nobody reads
        them), the expert kernels on every SM, and the map from each route to its output row (the weighted sum reads
        the rows in place: no combine copy)."""
        cap = schedule.capacity
        rows = slice(0, cap)
        b = buffers
        token = row_tokens(schedule.src_index, self.shape.top_k)
        counts, offsets = schedule.tokens_per_expert, schedule.offsets
        if self.quantized:
            x_index, token = token, token.long()
            q = experts_q  # never None here: forward quantises before the device work when the caller did not
            rounds_x = self._rounds_staged_x
            if not rounds_x:
                torch.index_select(self.sym.local("x_q"), 0, token, out=b.ring_x.view(torch.uint8)[rows])
                torch.index_select(self.sym.local("x_scale"), 0, token, out=b.ring_scale[rows])
            if runs_as_bf16(self.precision):  # the BF16 kernels on the tokens' E4M3 rows dequantised (the ring's
                # E4M3 rows only for a backward that reads them), the pack's rounded weights, act rounded in gate/up
                if self._act_bf16 is None:
                    self._act_bf16 = torch.empty(self.config.ring_rows, self.shape.intermediate, dtype=torch.bfloat16,
                                                 device=self.world.device)
                x_rows = ((self.sym.local("x")[:n], None) if rounds_x else
                          (self.sym.local("x_q")[:n].view(torch.float8_e4m3fn), self.sym.local("x_scale")[:n]))
                expert_forward_mxfp8_bf16(
                    *x_rows, counts, offsets, q.rounded_weights(w_gate_up, w_down), activation=activation,
                    b_gate_up=b_gate_up, b_down=b_down,
                    out=ExpertForward(b.h[rows], self._act_bf16[rows], self.y[rows]),
                    rows_per_expert=self._rows_per_expert, x_index=x_index, tuning=self.tuning)
            else:
                forward = expert_forward_fp8_block if self.precision == "fp8-block" else expert_forward_mxfp8
                plan = {"rows_per_expert": self._rows_per_expert} if forward is expert_forward_fp8_block else {}
                forward(b.ring_x[rows], b.ring_scale[rows], counts, offsets, q.w_gate_up, q.w_gate_up_scale,
                        q.w_down, q.w_down_scale, activation=activation, b_gate_up=b_gate_up, b_down=b_down,
                        out=ExpertForwardQuantized(b.h[rows], b.act[rows], b.act_scale[rows], self.y[rows]),
                        tuning=self.tuning, **plan)
        else:
            if expert_ops.GATHER_FORWARD and self.gpu:  # the gate/up tiles read the tokens by index (the CPU copies)
                x, x_index = self.sym.local("x")[: max(n, 1)], token
            else:
                x, x_index = torch.index_select(self.sym.local("x"), 0, token.long(), out=b.ring_x[rows]), None
            expert_forward(x, counts, offsets, w_gate_up, w_down, activation=activation, b_gate_up=b_gate_up,
                           b_down=b_down, out=ExpertForward(b.h[rows], b.act[rows], self.y[rows]),
                           rows_per_expert=self._rows_per_expert, x_index=x_index, tuning=self.tuning)
        if shared is not None and n:
            self._shared_rows.fill_(n)
            expert_forward(self.sym.local("x")[:n], self._shared_rows, self._shared_start, shared[0][None],
                           shared[1][None], activation=activation,
                           out=ExpertForward(b.shared_h[:n], b.shared_act[:n], self.shared_y[:n]))

    def _weighted_sum(self, out, own_rows, top_experts, router_weights, has_shared: bool) -> None:
        weighted_sum(out, self.sym.local("combine"), top_experts, router_weights,
                     self.shape.experts_per_rank * self.shape.num_ranks, y=self.y, own_rows=own_rows,
                     shared=self.shared_y if has_shared else None)
