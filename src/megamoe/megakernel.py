"""`impl=megamoe`: the MoE layer's forward as one persistent kernel per pass.

A pass, all queued on the current stream with no host sync (so it can be
captured in a CUDA graph once ``check=False``):

1. stage: this rank's x into the symmetric ``x``; its routing ids into row
   ``rank`` of every rank's ``routing`` buffer;
2. a device barrier across ranks (every x and routing row is in place);
3. the pull schedule and its minibatch row tiles, built on the device;
4. the megakernel (``megamoe.kernels.megakernel``): communication workers pull
   minibatches into the ring and push finished ones home (when the ring holds
   every row, only the rows other ranks own: a rank's own outputs stay in the
   ring), compute workers run the shared expert and the routed gate/up +
   SwiGLU and down tiles; it ends with a barrier across ranks (every push
   landed);
5. the weighted sum of each token's k outputs (its combine slots, or the ring
   rows of its own routes; router weights, fixed order) plus the shared
   output, rounded once to bf16.

On a GPU steps 2-4 read only the layer's own buffers and the weights, so from
the second pass with the same weights (addresses; values may change in place)
and token count they replay from a CUDA graph (``megamoe.replay``; one per set
of weights, so each MoE layer of a model sharing this kernel gets its own): an
eager pass then pays the host for steps 1 and 5 only.

One rank has no peers and so nothing to overlap: there (unless asked for the
megakernel) steps 2 and 4 become a gather of the routed rows into the ring and
the expert kernels on every SM (``megamoe.experts``: the same tile functions,
the same bits), and the weighted sum reads each route's output row in place.

On the CPU (the Triton interpreter runs programs one after another, so
programs cannot wait for each other) step 4 runs in phases: the same kernel
code, one step of one role per launch, sequenced by the host, with host
barriers across the simulated ranks. Each tile is computed by the same code
on the same rows either way: outputs are bitwise equal across runs and across
``comm_sms``, ``minibatch`` and ``ring_rows``.

Several shared experts run as one: SwiGLU FFNs with intermediate sizes Is_1..
Is_S sum to one FFN whose gate, up and down weights are their concatenations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe import checks
from megamoe.comm import DEFAULT_WAIT_BUDGET, DEFAULT_WAIT_BUDGET_INTERPRETED, _tile
from megamoe.comm import CommTuning
from megamoe.config import MoEConfig
from megamoe.experts import (ExpertForward, ExpertForwardQuantized, RowTiles, TileConfig, build_row_tiles,
                             expert_forward, interpreting, plan_tiles)
from megamoe.experts_fp8 import expert_forward_fp8_block, plan_tiles_fp8
from megamoe.experts_mxfp8 import expert_forward_mxfp8, plan_tiles_mxfp8
from megamoe.formats import FP8_BLOCK, MX_BLOCK
from megamoe.kernels import megakernel as mk
from megamoe.kernels.quant import quantize_activations, soft_e4m3_default
from megamoe.plan import KernelConfig, plan
from megamoe.quantized_experts import QuantizedExperts, quantize_experts
from megamoe.replay import GraphReplay, layout_key
from megamoe.schedule import PullSchedule, build_pull_schedule
from megamoe.world import BufferSpec, EPWorld, workspace

#: Precisions of the routed experts (the shared expert stays BF16) -> (the kernel's FMT, elements per
#: activation scale, scale dtype). Each rank quantises its tokens while staging them (1x32 / 1x128 along
#: D), the weights are quantised once per optimizer step (``quantize_experts``: mxfp8 1x32 along the
#: reduction axis, fp8-block 128x128), act in the gate/up epilogue; MXFP8 runs dequantise-on-load tiles
#: (megamoe.experts_mxfp8).
FORMATS = {
    "bf16": (mk.FMT_BF16.value, 1, None),
    "mxfp8": (mk.FMT_MXFP8.value, MX_BLOCK, torch.uint8),
    "fp8-block": (mk.FMT_FP8_BLOCK.value, FP8_BLOCK, torch.float32),
}
PRECISIONS = tuple(FORMATS)

WAITS = {
    mk.WAIT_ROWS_READY.value: "rows_ready of minibatch",
    mk.WAIT_TILE_DONE.value: "gate/up done of row tile",
    mk.WAIT_Y_DONE.value: "y done of minibatch",
    mk.WAIT_SHARED_DONE.value: "shared gate/up done of row tile",
    mk.WAIT_PASS_END.value: "end-of-pass barrier flag of rank",
    mk.WAIT_PASS_START.value: "start-of-pass barrier flag of rank",
}

#: The communication workers' copy tile: one row per warp of the kernel's 8 warps (E4M3 rows and the scales
#: get the same rows per tile; narrower rows give more of them). Benchmarks may swap it.
COMM_TUNING = CommTuning(tile_rows=8)


def copy_tile_consts(hidden: int, scale_block: int, scale_rows: tuple[int, int] | None) -> dict[str, int]:
    """The megakernel's copy-tile constexprs (``megamoe.comm._tile``): CHUNKS, CP, W, ROWS, ALIGN of the BF16
    output rows it pushes, ``P_*`` of the rows it pulls (BF16, or E4M3 bytes) and ``S_*`` of their scales
    (``scale_rows`` = (width, bytes per element) of the FP8 scale rows; None for BF16 rows)."""
    names = ("CHUNKS", "CP", "W", "ROWS", "ALIGN")
    routed = _tile(hidden, 2, COMM_TUNING, min_block=scale_block)
    pulled = routed if scale_rows is None else _tile(hidden, 1, COMM_TUNING)
    scales = pulled if scale_rows is None else _tile(*scale_rows, COMM_TUNING)
    return {prefix + name: value for prefix, tile in (("", routed), ("P_", pulled), ("S_", scales))
            for name, value in zip(names, tile)}


#: Interpreter launches: this many programs (the CPU default KernelConfig's grid).
CPU_SMS = 4
#: The weighted sum's tile on a GPU (BLOCK_T tokens x BLOCK_D columns, warps), k slot loads unrolled, one load
#: per slot: kimi-k2 0.32 ms (3.7 TB/s), qwen3.5-397b 0.22 (benchmarks/results/2026-11-30-qwen-pass,
#: weighted_sum_bench.py). The sm_90 build test counts its 16-byte loads.
WEIGHTED_SUM_TILE = (16, 512, 8)


@dataclass(frozen=True)
class ForwardContext:
    """What a forward pass leaves for the backward (per rank).

    The ring holds the minibatches visited last, which are the first ones
    (minibatches are visited in reverse): minibatch ``j < ring_rows / minibatch``
    has its routed rows, pre-activation and activation at ring rows
    ``j * minibatch ..``. The others must be replayed from the schedule
    (pull x again, recompute h) before their gradients.

    Attributes:
        schedule: the pull schedule of the pass.
        row_tiles: its row tiles by minibatch (cut at minibatch boundaries only when the ring wraps; else
            a minibatch's tiles are those starting in it).
        config: the KernelConfig the pass ran with.
        ring_x, h, act: `[ring_rows, D]`, `[ring_rows, 2I]`, `[ring_rows, I]`; bf16, but ring_x and act are
            E4M3 with mxfp8 and fp8-block.
        ring_scale, act_scale: their scales along D and I (mxfp8 E8M0 1x32, fp8-block fp32 1x128; None with
            bf16).
        shared_h, shared_act: the shared expert's `[N, 2Is]`, `[N, Is]` (None without one).
    """

    schedule: PullSchedule
    row_tiles: RowTiles
    config: KernelConfig
    ring_x: torch.Tensor
    h: torch.Tensor
    act: torch.Tensor
    ring_scale: torch.Tensor | None
    act_scale: torch.Tensor | None
    shared_h: torch.Tensor | None
    shared_act: torch.Tensor | None

    def resident_minibatches(self) -> int:
        """Minibatches 0 .. this-1 are still in the ring."""
        return self.config.ring_rows // self.config.minibatch


@dataclass(frozen=True)
class LayerShape:
    """What sizes a megakernel's buffers (every rank of the group builds the same)."""

    num_ranks: int
    max_tokens: int
    hidden: int
    intermediate: int
    experts_per_rank: int
    top_k: int
    shared_intermediate: int

    @classmethod
    def of(cls, cfg: MoEConfig, ranks: int, max_tokens: int) -> LayerShape:
        """The shape of ``cfg``'s layer on ``ranks`` ranks holding at most ``max_tokens`` tokens each."""
        return cls(ranks, max_tokens, cfg.hidden, cfg.intermediate, cfg.experts_per_rank(ranks), cfg.top_k,
                   sum(cfg.shared))

    @property
    def capacity(self) -> int:
        return self.num_ranks * max(self.max_tokens, 1) * self.top_k


def default_config(world: EPWorld, shape: LayerShape, precision: str = "bf16") -> KernelConfig:
    """The planner's KernelConfig for this shape and precision on this device (GPU), or a small one for the
    interpreter."""
    cfg = MoEConfig(hidden=shape.hidden, intermediate=shape.intermediate,
                    num_experts=shape.experts_per_rank * shape.num_ranks, top_k=shape.top_k,
                    shared=(shape.shared_intermediate,) if shape.shared_intermediate else ())
    tokens = max(shape.max_tokens, 1)
    if _on_gpu(world):
        # ranks sharing a GPU (correctness runs) split its SMs: every rank's grid must be resident at once
        sms = torch.cuda.get_device_properties(world.device).multi_processor_count // world.ranks_per_device
        tile = plan_tiles("down", world.device)
        return plan(cfg, world.size, tokens, num_sms=sms, precision=precision, tile_m=tile.block_m,
                    tile_n=tile.block_n).config
    tile = plan_tiles("down", torch.device("cpu"))
    # Interpreter: small minibatches so even tiny shapes cross a few minibatches.
    minibatch = 2 * tile.block_m
    ring = max(1, math.ceil(tokens * shape.top_k / minibatch)) * minibatch
    return KernelConfig(CPU_SMS, 1, minibatch, ring, tile.block_m, tile.block_n)


class MegaKernel:
    """One rank's megakernel for one layer shape: symmetric workspace, ring buffers, counters.

    Collective to build (allocates symmetric memory). ``forward`` is a pass;
    every rank makes the same sequence of passes. On one rank a pass runs the
    expert kernels on every SM instead of the megakernel (same bits) when the
    ring holds every routed row; ``one_rank_megakernel=True`` keeps the
    megakernel there (traces, tests). ``replay=False`` launches every pass's device work from the host
    instead of replaying its CUDA graph (same bits). ``keep_own_outputs=False`` pushes the outputs of a
    rank's own routes into its combine slots too, as the other ranks' are (same bits; the layout before
    24c8091, kept for A/B measurements): by default they stay in the ring when it holds every row.
    """

    def __init__(self, world: EPWorld, shape: LayerShape, config: KernelConfig | None = None, *,
                 precision: str = "bf16", wait_budget: int | None = None, trace: bool = False,
                 one_rank_megakernel: bool = False, replay: bool = True, keep_own_outputs: bool = True):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS} for the megakernel, got {precision!r}")
        self.world, self.shape, self.precision = world, shape, precision
        self.keep_own_outputs = bool(keep_own_outputs)
        self.requested = (config, precision)
        self.fmt, self.scale_block, scale_dtype = FORMATS[precision]
        self.quantized = precision != "bf16"
        self.config = config or default_config(world, shape, precision)
        self.gpu = _on_gpu(world)
        self._check_config()
        R, N, D, k = shape.num_ranks, shape.max_tokens, shape.hidden, shape.top_k
        I, Is, c = shape.intermediate, shape.shared_intermediate, self.config
        # One rank: the expert kernels on every SM, unless the megakernel is asked for or the ring is too small
        # to hold every routed row (kimi-k2 at EP 1: the megakernel's comm workers would only copy local rows,
        # and it ran 0.95x of nccl-torch; benchmarks/results/2026-11-30-one-rank). Its weighted sum reads the
        # outputs in place: no combine slots.
        self.direct = R == 1 and not one_rank_megakernel and c.ring_rows >= shape.capacity
        # FP8: each rank quantises its tokens once while staging them (not once per route on arrival: that
        # needed 19 comm SMs where copying E4M3 rows needs 12, benchmarks/results/2026-11-30-fp8-experts)
        quantized_rows = (BufferSpec("x_q", (max(N, 1), D), torch.uint8),
                          BufferSpec("x_scale", (max(N, 1), D // self.scale_block), scale_dtype))
        self.sym = workspace(world, (
            BufferSpec("x", (max(N, 1), D), torch.bfloat16),
            BufferSpec("combine", (1 if self.direct else max(N * k, 1), D), torch.bfloat16),
            BufferSpec("routing", (R, max(N, 1), k), torch.int32),
            BufferSpec("flags", (2, R), torch.int32),
            # this rank's barrier epochs: with the flags, shared by every MegaKernel on this workspace
            BufferSpec("epochs", (2,), torch.int32),
        ) + (quantized_rows if self.quantized else ()))
        dev = world.device
        bf16 = dict(dtype=torch.bfloat16, device=dev)
        row_dtype = torch.float8_e4m3fn if self.quantized else torch.bfloat16
        self.ring_x = torch.zeros(c.ring_rows, D, dtype=row_dtype, device=dev)
        self.h = torch.empty(c.ring_rows, 2 * I, **bf16)
        self.act = torch.zeros(c.ring_rows, I, dtype=row_dtype, device=dev)
        block, scales = self.scale_block, dict(dtype=scale_dtype, device=dev)
        self.ring_scale = torch.zeros(c.ring_rows, D // block, **scales) if self.quantized else None
        self.act_scale = torch.zeros(c.ring_rows, I // block, **scales) if self.quantized else None
        self.y = torch.empty(c.ring_rows, D, **bf16)
        self.shared_h = torch.empty(max(N, 1), 2 * Is, **bf16) if Is else None
        self.shared_act = torch.zeros(max(N, 1), Is, **bf16) if Is else None
        self.shared_y = torch.empty(max(N, 1), D, **bf16) if Is else None
        # counters: rows_ready [M] | y_done [M] | tile_done [tiles] | shared_done [shared tiles] | comm_done [1]
        self.max_batches = max(1, -(-shape.capacity // c.minibatch))
        self.max_tiles = -(-shape.capacity // c.tile_m) + shape.experts_per_rank + self.max_batches
        shared_tiles = -(-max(N, 1) // c.tile_m)
        self.counters = torch.zeros(2 * self.max_batches + self.max_tiles + shared_tiles + 1, dtype=torch.int32,
                                    device=dev)
        self.epochs = self.sym.local("epochs")
        self.error = torch.zeros(4, dtype=torch.int32, device=dev)
        # trace (GPU only): per program [start, end, ns waiting, waits, shared done] globaltimer stamps
        self.trace = torch.zeros(c.num_sms, mk.TRACE_FIELDS.value, dtype=torch.int64, device=dev) if trace else None
        self.budget = wait_budget or (DEFAULT_WAIT_BUDGET_INTERPRETED if interpreting() else DEFAULT_WAIT_BUDGET)
        self.flag_ptrs = [self.sym.peer_ptrs("flags") + row * R * 4 for row in range(2)]
        self._prepare_launches()
        # A route's output stays in y (the schedule's own_rows; else the weighted sum reads its combine slot):
        # on one rank every route; at EP >= 2 this rank's own routes when the ring holds every row (the kernel
        # then pushes only the other ranks' rows home), unless keep_own_outputs is off.
        self._own_rows_within = (shape.capacity if self.direct else
                                 c.ring_rows if self.keep_own_outputs else -1)
        ints = dict(dtype=torch.int32, device=dev)
        if self.direct:
            self._shared_rows, self._shared_start = torch.zeros(1, **ints), torch.zeros(1, **ints)
            per_expert = shape.capacity / shape.experts_per_rank
            self._direct_tiles = {kind: plan_tiles(kind, dev, per_expert) for kind in ("gate_up", "down")}
        self._broken: str | None = None
        self._checked_occupancy = False
        # GPU: a pass's device work replays from a CUDA graph once its weights and token count repeat
        self.replay = GraphReplay() if replay and self.gpu else None

    # ---- validation

    def _check_config(self) -> None:
        c = self.config
        gate_up, down = self._tiles()
        block = FORMATS[self.precision][1]
        if self.shape.hidden % block or self.shape.intermediate % block:
            raise ValueError(f"{self.precision} needs D and I multiples of {block}, got D={self.shape.hidden}, "
                             f"I={self.shape.intermediate}")
        if c.tile_m != gate_up.block_m:
            raise ValueError(f"KernelConfig.tile_m ({c.tile_m}) must be the expert tiles' rows ({gate_up.block_m} "
                             f"on {'this GPU' if self.gpu else 'the interpreter'})")
        if self.gpu:
            share = self.world.ranks_per_device
            sms = torch.cuda.get_device_properties(self.world.device).multi_processor_count // share
            if c.num_sms > sms:
                whose = "the GPU's" if share == 1 else f"this rank's share ({share} ranks on one GPU) of the"
                raise ValueError(f"KernelConfig.num_sms ({c.num_sms}) exceeds {whose} {sms} SMs: the programs wait "
                                 f"for each other and must all be resident at once")
        if self.shape.hidden % 64 or self.shape.intermediate % 8 or self.shape.shared_intermediate % 8:
            raise ValueError("D must be a multiple of 64, I and the shared I multiples of 8")

    def _tiles(self, routed: bool = True) -> tuple[TileConfig, TileConfig]:
        """(gate/up, down) tiles of the routed experts (``routed``) or of the shared expert (always BF16)."""
        device = self.world.device if self.gpu else torch.device("cpu")
        if routed and self.precision == "fp8-block":
            return plan_tiles_fp8("gate_up", device), plan_tiles_fp8("down", device)
        if routed and self.precision == "mxfp8":
            return plan_tiles_mxfp8("gate_up", "dequant", device), plan_tiles_mxfp8("down", "dequant", device)
        return plan_tiles("gate_up", device), plan_tiles("down", device)

    def check_errors(self) -> None:
        """Raise RuntimeError if a wait of an earlier pass timed out (reads the error word: a host sync)."""
        if self._broken is not None:
            raise RuntimeError(self._broken)
        code, index, target, seen = self.error.tolist()
        if code:
            what = WAITS.get(code, f"wait #{code}")
            self._broken = (f"rank {self.world.rank}: the megakernel timed out waiting for {what} {index} "
                            f"(wanted >= {target}, saw {seen}); this MegaKernel's counters are out of step now")
            raise RuntimeError(self._broken)

    # ---- a pass

    def forward(
        self,
        x: torch.Tensor,
        top_experts: torch.Tensor,
        router_weights: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        shared: tuple[torch.Tensor, torch.Tensor] | None = None,
        swiglu_limit: float | None = None,
        *,
        experts_q: QuantizedExperts | None = None,
        check: bool = True,
    ) -> tuple[torch.Tensor, ForwardContext]:
        """One forward pass (collective). Inputs as :func:`megamoe_forward` (validated there), ``shared`` one
        (gate_up, down) pair or None. ``check`` reads the error word after the pass (a host sync)."""
        if self._broken is not None:
            raise RuntimeError(self._broken)
        if experts_q is not None:
            if not self.quantized:
                raise ValueError("experts_q is for the FP8 precisions; this pass runs bf16 experts")
            experts_q.check_source(w_gate_up, w_down, self.precision)
        s, c = self.shape, self.config
        n = x.shape[0]
        self._stage(x, top_experts, shared is not None)
        if self.quantized and experts_q is None:  # quantised in this pass, before the device work (its graph)
            experts_q = quantize_experts(w_gate_up, w_down, self.precision)
        # 2-4: the device work, replayed from a graph when the weights and token count repeat
        work = partial(self._device_work, n, w_gate_up, w_down, experts_q, shared, swiglu_limit)
        if self.replay is None:
            schedule, tiles = work()
        else:
            q = () if experts_q is None else (experts_q.w_gate_up, experts_q.w_gate_up_scale, experts_q.w_down,
                                              experts_q.w_down_scale)
            key = (n, swiglu_limit, layout_key((w_gate_up, w_down, *q, *(shared or (None, None)))))
            schedule, tiles = self.replay(key, work)
        # 5. the weighted sum
        out = torch.empty(n, s.hidden, dtype=torch.bfloat16, device=x.device)
        if n:
            self._weighted_sum(out, schedule.own_rows, top_experts, router_weights, shared is not None)
        if check:
            self.check_errors()
        ctx = ForwardContext(schedule, tiles, c, self.ring_x, self.h, self.act, self.ring_scale, self.act_scale,
                             self.shared_h, self.shared_act)
        return out, ctx

    def _stage(self, x: torch.Tensor, top_experts: torch.Tensor, has_shared: bool) -> None:
        """Step 1: x into the symmetric rows (FP8: quantised, once per token; the BF16 rows only for the shared
        expert, from the same read of x) and the routing ids into row ``rank`` of every rank's routing buffer."""
        n, me = x.shape[0], self.world.rank
        x_sym = self.sym.local("x")[:n]
        if not self.quantized:
            x_sym.copy_(x)
        elif n:  # straight into the symmetric rows the comm workers pull
            quantize_activations(x, self.precision, out=(self.sym.local("x_q")[:n].view(torch.float8_e4m3fn),
                                                        self.sym.local("x_scale")[:n]),
                                 copy=x_sym if has_shared else None)
        for r in range(self.world.size):
            row = self.sym.peer("routing", r)[me]
            row[:n].copy_(top_experts)
            if n < row.shape[0]:  # padding rows: no route
                row[n:].fill_(-1)

    def _device_work(self, n, w_gate_up, w_down, experts_q, shared, swiglu_limit) -> tuple[PullSchedule, RowTiles]:
        """Steps 2-4 of a pass (x and the routing ids staged): reads only this kernel's buffers and the weights."""
        s, c, me = self.shape, self.config, self.world.rank
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
            self._run_experts(n, schedule, w_gate_up, w_down, experts_q, shared, swiglu_limit)
        else:
            self.counters.zero_()
            if self.trace is not None:
                self.trace.zero_()
            self._launch(n, schedule, tiles, w_gate_up, w_down, experts_q, shared, swiglu_limit)
        return schedule, tiles

    def _barrier(self, row: int) -> None:
        if not self.gpu:
            self.world.barrier()
            return
        mk.pass_barrier_kernel[(1,)](self.flag_ptrs[row], self.sym.local("flags")[row], self.epochs[row:],
                                     self.world.rank, self.world.size, self.budget, self.error, num_warps=1)

    def _prepare_launches(self) -> None:
        """What every pass's launch shares (built once, off the hot path): tiles, constexprs, the counters'
        views and the descriptors of this kernel's own buffers."""
        s, c = self.shape, self.config
        self._routed_tiles = gate_up, down = self._tiles()
        self._shared_tiles = shared_gate_up, shared_down = self._tiles(routed=False)
        bm, bk, sbk = c.tile_m, gate_up.block_k, shared_gate_up.block_k
        desc = TensorDescriptor.from_tensor
        self._ring_desc, self._act_desc = desc(self.ring_x, [bm, bk]), desc(self.act, [bm, bk])
        if s.shared_intermediate:
            self._shared_x_desc = desc(self.sym.local("x"), [bm, sbk])
            self._shared_act_desc = desc(self.shared_act, [bm, sbk])
        M, T = self.max_batches, self.max_tiles
        # rows_ready, tile_done, y_done, shared_done, comm_done (the kernel's argument order)
        self._counter_views = (self.counters[:M], self.counters[2 * M: 2 * M + T], self.counters[M: 2 * M],
                               self.counters[2 * M + T: -1], self.counters[-1:])
        if self.quantized:  # E4M3 rows and their scales
            x_q, x_scale = self.sym.local("x_q"), self.sym.local("x_scale")
            self._pulled_args = (self.sym.peer_ptrs("x_q"), x_q, x_q.stride(0),
                                 self.sym.peer_ptrs("x_scale"), x_scale, x_scale.stride(0))
            scale_rows = (x_scale.shape[1], x_scale.element_size())
        else:  # BF16 rows; the scales are never read
            x_sym = self.sym.local("x")
            self._pulled_args = (self.sym.peer_ptrs("x"), x_sym, x_sym.stride(0), self.sym.peer_ptrs("x"), x_sym, 0)
            scale_rows = None
        pulled = copy_tile_consts(s.hidden, self.scale_block, scale_rows)
        self._consts = dict(
            TOP_K=s.top_k, DOT_FP32=interpreting(),
            FENCE=self.gpu, BLOCK_M=bm, BN_GU=gate_up.block_n, BN_DN=down.block_n, BLOCK_K=bk,
            GROUP_GU=gate_up.group_m, GROUP_DN=down.group_m, TRACE=self.trace is not None and self.gpu,
            FMT=self.fmt, SOFT_E4M3=soft_e4m3_default(),
            SHARED_BN_GU=shared_gate_up.block_n, SHARED_BN_DN=shared_down.block_n, SHARED_BK=sbk, **pulled,
            num_warps=gate_up.num_warps, num_stages=gate_up.num_stages,
        )

    def _launch(self, n, schedule, tiles, w_gate_up, w_down, experts_q, shared, swiglu_limit) -> None:
        s, c = self.shape, self.config
        (gate_up_tile, down_tile), (shared_gate_up, shared_down) = self._routed_tiles, self._shared_tiles
        D, I, L = s.hidden, s.intermediate, s.experts_per_rank
        bk, sbk = gate_up_tile.block_k, shared_gate_up.block_k
        desc = TensorDescriptor.from_tensor
        if self.quantized:  # experts_q: from the caller (once per optimizer step) or from forward, before this
            q = experts_q
            w_gate_up, w_gu_scale, w_down, w_dn_scale = q.w_gate_up, q.w_gate_up_scale, q.w_down, q.w_down_scale
            scale_args = (self.ring_scale, w_gu_scale, self.act_scale, w_dn_scale, self.ring_scale.stride(0),
                          w_gu_scale.stride(1), self.act_scale.stride(0), w_dn_scale.stride(1))
        else:  # never read
            scale_args = (self.error, self.error, self.error, self.error, 0, 0, 0, 0)
        w_gu_desc = desc(w_gate_up.view(L * 2 * I, D), [gate_up_tile.block_n, bk])
        w_dn_desc = desc(w_down.view(L * D, I), [down_tile.block_n, bk])
        if shared is not None:
            shared_args = (self._shared_x_desc, desc(shared[0], [shared_gate_up.block_n, sbk]), self.shared_h,
                           self.shared_act, self.shared_h.stride(0), self.shared_act.stride(0),
                           self._shared_act_desc, desc(shared[1], [shared_down.block_n, sbk]),
                           self.shared_y, self.shared_y.stride(0))
        else:  # never read (HAS_SHARED=False)
            shared_args = (self._ring_desc, w_gu_desc, self.h, self.act, 0, 0, self._act_desc, w_dn_desc, self.y, 0)
        combine = self.sym.local("combine")
        bytes_view = (lambda t: t.view(torch.uint8)) if self.quantized else (lambda t: t)
        args = (
            schedule.num_rows, schedule.src_rank, schedule.src_index,
            tiles.tile_expert, tiles.tile_row0, tiles.tile_row_end, tiles.minibatch_tiles,
            *self._pulled_args, bytes_view(self.ring_x), self.ring_x.stride(0),
            self.sym.peer_ptrs("combine"), combine, combine.stride(0),
            self._ring_desc, w_gu_desc, self.h, bytes_view(self.act), self.h.stride(0), self.act.stride(0),
            self._act_desc, w_dn_desc, self.y, self.y.stride(0),
            *scale_args,
            *shared_args,
            *self._counter_views,
            self.flag_ptrs[1], self.sym.local("flags")[1], self.epochs[1:], self.error,
            self.error if self.trace is None else self.trace,
            n, self.world.rank, self.world.size, c.comm_sms, c.minibatch, c.ring_rows // c.minibatch, L, I, D,
            s.shared_intermediate, float(swiglu_limit or 0.0), self.budget, int(self.keep_own_outputs),
        )
        consts = dict(self._consts, HAS_SHARED=shared is not None, HAS_LIMIT=swiglu_limit is not None)
        if self.gpu:
            if not self._checked_occupancy:
                self._check_occupancy(args, consts)
            mk.megakernel[(c.num_sms,)](*args, 0, PHASE=mk.PHASE_ALL.value, **consts)
        else:
            self._launch_phased(schedule, shared is not None, args, consts)
            self.world.barrier()  # every rank's pushes landed

    def _launch_phased(self, schedule, has_shared: bool, args, consts) -> None:
        c = self.config
        compute = c.num_sms - c.comm_sms

        def step(phase: int, programs: int, j: int = 0) -> None:
            mk.megakernel[(programs,)](*args, j, PHASE=phase, **consts)

        if has_shared:
            step(mk.PHASE_SHARED_GATE_UP.value, compute)
            step(mk.PHASE_SHARED_DOWN.value, compute)
        batches = -(-int(schedule.num_rows) // c.minibatch)  # the CPU: reading it costs nothing
        slots = c.ring_rows // c.minibatch
        for p in range(batches):
            j = batches - 1 - p
            if p >= slots:
                step(mk.PHASE_PUSH.value, c.comm_sms, j + slots)
            step(mk.PHASE_PULL.value, c.comm_sms, j)
            step(mk.PHASE_GATE_UP.value, compute, j)
            step(mk.PHASE_DOWN.value, compute, j)
        for p in range(max(batches - slots, 0), batches):
            step(mk.PHASE_PUSH.value, c.comm_sms, batches - 1 - p)

    def _check_occupancy(self, args, consts) -> None:
        """Refuse a grid whose programs cannot all be resident at once (they would wait on each other forever)."""
        compiled = mk.megakernel.warmup(*args, 0, PHASE=mk.PHASE_ALL.value, grid=(self.config.num_sms,), **consts)
        compiled._init_handles()  # loads the module: fills n_regs
        props = torch.cuda.get_device_properties(self.world.device)
        threads = 32 * consts["num_warps"]
        regs = compiled.n_regs * threads
        smem = compiled.metadata.shared
        if regs > props.regs_per_multiprocessor or smem > props.shared_memory_per_multiprocessor:
            raise ValueError(f"the megakernel needs {compiled.n_regs} registers x {threads} threads and {smem} B "
                             f"of shared memory per program: one program per SM does not fit")
        self._checked_occupancy = True

    def _run_experts(self, n, schedule, w_gate_up, w_down, experts_q, shared, swiglu_limit) -> None:
        """One rank: the routed rows gathered into the ring, the expert kernels on every SM, and the map from
        each route to its output row (the weighted sum reads the rows in place: no combine copy)."""
        cap = schedule.capacity
        rows = slice(0, cap)
        # rows past num_rows (dropped routes, src_index -1) gather token 0: no tile reads them
        token = (schedule.src_index.clamp(min=0) // self.shape.top_k).long()
        counts, offsets = schedule.tokens_per_expert, schedule.offsets
        if self.quantized:
            q = experts_q  # never None here: forward quantises before the device work when the caller did not
            torch.index_select(self.sym.local("x_q"), 0, token, out=self.ring_x.view(torch.uint8)[rows])
            torch.index_select(self.sym.local("x_scale"), 0, token, out=self.ring_scale[rows])
            forward = expert_forward_fp8_block if self.precision == "fp8-block" else expert_forward_mxfp8
            forward(self.ring_x[rows], self.ring_scale[rows], counts, offsets, q.w_gate_up, q.w_gate_up_scale,
                    q.w_down, q.w_down_scale, swiglu_limit=swiglu_limit,
                    out=ExpertForwardQuantized(self.h[rows], self.act[rows], self.act_scale[rows], self.y[rows]))
        else:
            torch.index_select(self.sym.local("x"), 0, token, out=self.ring_x[rows])
            expert_forward(self.ring_x[rows], counts, offsets, w_gate_up, w_down, swiglu_limit=swiglu_limit,
                           out=ExpertForward(self.h[rows], self.act[rows], self.y[rows]), tiles=self._direct_tiles)
        if shared is not None and n:
            self._shared_rows.fill_(n)
            expert_forward(self.sym.local("x")[:n], self._shared_rows, self._shared_start, shared[0][None],
                           shared[1][None], swiglu_limit=swiglu_limit,
                           out=ExpertForward(self.shared_h[:n], self.shared_act[:n], self.shared_y[:n]))

    def _weighted_sum(self, out, own_rows, top_experts, router_weights, has_shared: bool) -> None:
        n, D = out.shape
        combine = self.sym.local("combine")
        block_t, block_d, warps = WEIGHTED_SUM_TILE if self.gpu else (16, 64, 4)
        shared_y = self.shared_y if has_shared else out
        mk.weighted_sum_kernel[(-(-n // block_t), -(-D // block_d))](
            self.y, self.y.stride(0), combine, combine.stride(0), own_rows, top_experts.contiguous(),
            router_weights.contiguous(), shared_y, shared_y.stride(0), out, out.stride(0), n, D,
            TOP_K=self.shape.top_k, HAS_SHARED=has_shared, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps,
        )


def _on_gpu(world: EPWorld) -> bool:
    return world.is_cuda and not interpreting()


def fuse_shared(shared: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One (w_gate_up [2*sum Is, D], w_down [D, sum Is]) FFN equal to the sum of the shared experts."""
    if not shared:
        return None
    if len(shared) == 1:
        return shared[0][0].contiguous(), shared[0][1].contiguous()
    gates = [gu[: gu.shape[0] // 2] for gu, _ in shared]
    ups = [gu[gu.shape[0] // 2:] for gu, _ in shared]
    return torch.cat(gates + ups).contiguous(), torch.cat([dn for _, dn in shared], dim=1).contiguous()


_KERNELS: dict[tuple, MegaKernel] = {}


@torch.no_grad()
def megamoe_forward(
    world: EPWorld,
    x: torch.Tensor,
    top_experts: torch.Tensor,
    router_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    swiglu_limit: float | None = None,
    *,
    config: KernelConfig | None = None,
    precision: str = "bf16",
    max_tokens: int | None = None,
    experts_q: QuantizedExperts | None = None,
    check: bool = True,
) -> torch.Tensor:
    """The MoE layer's forward over ``world`` as one megakernel per pass (no autograd yet).

    Arguments as :func:`megamoe.unfused.unfused_moe_forward`; besides:

    Args:
        config: the kernel's knobs (default: ``megamoe plan``'s for this shape and device).
        precision: ``bf16``, ``mxfp8`` or ``fp8-block`` (routed experts; each rank quantises its tokens
            once while staging them, weights as ``experts_q`` says; the shared expert stays BF16).
        max_tokens: the group's largest token count (default: found with an all-reduce MAX, a host sync).
        experts_q: FP8 precisions: ``quantize_experts(w_gate_up, w_down, precision)``, made once per optimizer
            step and passed to every forward until then (ValueError if the weights changed in place since,
            as their version counter tells: writes through ``.data`` are not seen); None quantises the
            weights inside every pass (a pass over all of them).
        check: validate the expert ids and read the kernel's error word after the pass (host syncs).
            With ``max_tokens`` given and ``check=False`` the pass never waits for the GPU.

    Returns bf16 `[N, D]`. Raises ValueError on bad inputs or configs, RuntimeError when a wait timed out.
    The kernel state is cached per (group, shape), one config and precision at a time; on a GPU it replays
    each pass's device work from a CUDA graph once the same weights and token count come back (one graph
    per set of weights: each MoE layer of a model gets its own). For CUDA-graph capture of whole passes use
    :class:`MegaKernel` directly with ``check=False``.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} for the megakernel, got {precision!r}")
    n, d, k, experts, inter = checks.check_bf16_layer(world, x, top_experts, router_weights, w_gate_up, w_down,
                                                      shared, check_ids=check)
    if max_tokens is None:
        max_tokens = world.largest(n)  # NOTE: host sync
    if not isinstance(max_tokens, int) or max_tokens < n:
        raise ValueError(f"max_tokens must be an int >= this rank's tokens ({n}), got {max_tokens!r}")
    fused = fuse_shared([(gu.detach(), dn.detach()) for gu, dn in shared])
    if fused is not None and fused[0].dtype != torch.bfloat16:
        raise ValueError(f"shared expert weights must be bfloat16, got {fused[0].dtype}")
    shape = LayerShape(world.size, max_tokens, d, inter, experts, k, 0 if fused is None else fused[1].shape[1])
    # One MegaKernel per shape: another config or precision replaces it (its ring buffers are freed first).
    key = (id(world.group), world.device, shape)
    kernel = _KERNELS.get(key)
    if kernel is None or kernel.requested != (config, precision):
        _KERNELS.pop(key, None)
        kernel = _KERNELS[key] = MegaKernel(world, shape, config, precision=precision)
    # experts_q stands for the weights (never read then): keep the tensors it was made from, for its check
    weights = [w.detach() if experts_q is not None else w.detach().contiguous() for w in (w_gate_up, w_down)]
    out, _ = kernel.forward(x.detach().contiguous(), top_experts.detach(), router_weights.detach(), *weights,
                            fused, swiglu_limit, experts_q=experts_q, check=check)
    return out
