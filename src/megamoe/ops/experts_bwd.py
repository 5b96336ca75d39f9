"""BF16 expert FFN backward over schedule-grouped rows: the launches and their torch twin.

:func:`expert_backward` is the backward of :func:`megamoe.ops.experts.expert_forward` (dact + SwiGLU', the
router gradient, dx and both weight gradients; `megamoe.kernels.expert_gemm_bwd`, and on Hopper the
warp-specialised wgrad of `megamoe.kernels.wgrad_warp_specialized`); :func:`expert_backward_reference` its
plain-PyTorch twin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton

from megamoe import checks, runtime
from megamoe.config import SWIGLU, Activation
from megamoe.kernels import dact_warp_specialized, expert_gemm_bwd, gluon_ring, wgrad_warp_specialized
from megamoe.kernels.wgrad_blocks import HALF_M, SPLIT_N
from megamoe.kernels.wgrad_deal import wgrad_deal_kernel
from megamoe.ops.expert_bias import BiasGrads, bias_backward
from megamoe.ops import experts as expert_ops  # its switches, read at each call (tests set them)
from megamoe.ops.experts import check_operands, gathered_rows, gathers_on_load, warp_specialized_forward
from megamoe.ops.launch import descriptor, launch_row_tasks, scratch_allocator
from megamoe.ops.quant import mx_round_activations
from megamoe.planner.tiles import WGRAD_MMA_IN_FLIGHT_STAGES, TileConfig, carry_tile, mean_rows, wgrad_ws_stages
from megamoe.planner.tuning import DEFAULT_TUNING, Tuning
from megamoe.precision import MX_BLOCK
from megamoe.reference import activate
from megamoe.routing.row_tiles import build_row_tiles
from megamoe.runtime import compiled_gpu, interpreting


#: Rows per program of the router-gradient sum (a few loads per row: any size does).
ROUTER_GRAD_ROWS = 128
#: The Gluon dact (Hopper) stores dx's MXFP8-grid copy of d_h in its epilogue (``dact``'s ``d_h_grid``; off: the
#: rounding pass after it, 0.150 ms of qwen3-30b-a3b's mxfp8 step on one H100, benchmarks/results/
#: 2026-12-07-mxfp8-step-cuts). Built for sm_90 without spills and the Triton epilogue's bits on the CPU; off until
#: its GPU test (tests/test_experts_mxfp8_bf16.py, ``-m gpu``) has run. ``MEGAMOE_GLUON_D_H_GRID`` (0 or 1) sets it.
GLUON_D_H_GRID = runtime.env_switch("MEGAMOE_GLUON_D_H_GRID", False)

@dataclass(frozen=True)
class WgradCarry:
    """One backward window's share of the weight gradients' reductions (``megamoe.routing.windows``): ``modes``
    int32 `[L]` (``megamoe.kernels.wgrad_carry``'s bits) and the FP32 carries of the expert that straddles a
    window boundary, read (``*_in``) and written (``*_out``): dW_down's `[D, I]`, dW_gate_up's `[2I, D]`."""

    modes: torch.Tensor
    down_in: torch.Tensor
    down_out: torch.Tensor
    gate_up_in: torch.Tensor
    gate_up_out: torch.Tensor

    def pairs(self) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """((dW_down in, out), (dW_gate_up in, out)): the order the backwards launch their wgrads in."""
        return (self.down_in, self.down_out), (self.gate_up_in, self.gate_up_out)


@dataclass
class ExpertGrads:
    """Gradients of the expert FFNs: `d_x [R, D]` and `d_router [R]` per routed row (rows outside
    regions undefined), `d_w_gate_up [L, 2I, D]` and `d_w_down [L, D, I]` (every expert written).

    With ``d_x_index`` (int32 `[>= R]`, BF16 only) row r's d_x lands in ``d_x[d_x_index[r]]`` instead (rows whose
    index is < 0 not stored; ``d_x`` then any `[S, D]`, rows no index names untouched): on one rank the routes'
    slots themselves, so no push copies the rows there."""

    d_x: torch.Tensor
    d_router: torch.Tensor
    d_w_gate_up: torch.Tensor
    d_w_down: torch.Tensor
    d_x_index: torch.Tensor | None = None


def expert_backward(
    dy_rows: torch.Tensor,
    row_weights: torch.Tensor,
    x_rows: torch.Tensor,
    h: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    activation: Activation = SWIGLU,
    num_programs: int | None = None,
    tuning: Tuning | None = None,
    rows_per_expert: float | None = None,
    warp_specialized: bool = True,
    carry: WgradCarry | None = None,
    out: ExpertGrads | None = None,
    bias: BiasGrads | None = None,
    x_index: torch.Tensor | None = None,
    dy_index: torch.Tensor | None = None,
) -> ExpertGrads:
    """Backward of :func:`megamoe.ops.experts.expert_forward` for routed rows (BF16; see
    `megamoe.kernels.expert_gemm_bwd`).

    Args:
        dy_rows: bf16 `[R, D]` upstream gradient of each row's token, not scaled by its router weight.
        row_weights: float32 `[R]` router weight of each row's route.
        x_rows: bf16 `[R, D]` the forward's input rows; h: bf16 `[R, 2I]` its saved pre-activation.
        counts, offsets, w_gate_up, w_down: as in :func:`megamoe.ops.experts.expert_forward`.
        rows_per_expert: the load's mean rows per expert, for the tile plan (default: the rows over the
            experts; a caller whose rows are a worst-case capacity gives the expected mean).
        warp_specialized: on Hopper, the dact's 128 x 128 tiles and the wgrads' 128-row blocks run in
            warp-specialised Gluon kernels (`megamoe.kernels.dact_warp_specialized`, `wgrad_warp_specialized`;
            dact -9 to -16 %, benchmarks/results/2026-12-04-fp8-dact-warp-specialized); False runs the Triton
            kernels there too (A/B runs, tests). The same bits either way.
        carry: the rows are one window of the backward's ring: the weight gradients start from and leave FP32
            carries as its modes say (:class:`WgradCarry`); None: every expert's gradient from its rows here.
        bias: the expert biases' gradients (:class:`~megamoe.ops.expert_bias.BiasGrads`): the rows' sums are added
            to its FP32 accumulators, the down bias's term to ``d_router``; None: no biases.
        out: where to write (``d_x`` and ``d_router`` of ``rows`` rows, the weight gradients of every expert);
            None allocates them.
        x_index: int32 `[>= R]`: ``x_rows`` is then `[S, D]` and row r's input is ``x_rows[x_index[r]]`` (each in
            ``[0, S)`` inside the regions): one rank's tokens read in place of their routed copies. On Hopper the
            gate/up wgrad's producer gathers them (``wgrad``'s ``b_index``), elsewhere one gather copies them first:
            the same bits.
        dy_index: the same for ``dy_rows`` (`[S, D]`, one rank's d_out): the dact's and the down wgrad's producers
            gather them on Hopper (elsewhere, and with biases, whose sums read the rows, one gather copies them).
    """
    experts, i, d = check_operands(x_rows, counts, offsets, w_gate_up, w_down)
    rows = h.shape[0]
    device = x_rows.device
    for name, index in (("x_index", x_index), ("dy_index", dy_index)):
        if index is not None:
            checks.check_row_index(name, index, rows, device)
    # contiguous: the wgrad kernel addresses x_rows and dy_rows by row length
    checks.check_tensors((("x_rows", x_rows, (x_rows.shape[0] if x_index is not None else rows, d), torch.bfloat16),
                          ("dy_rows", dy_rows, (dy_rows.shape[0] if dy_index is not None else rows, d),
                           torch.bfloat16),
                          ("row_weights", row_weights, (rows,), torch.float32),
                          ("h", h, (rows, 2 * i), torch.bfloat16)), device)
    tuning = tuning or DEFAULT_TUNING
    per_expert = mean_rows(rows, experts, rows_per_expert)
    cfg = {kind: tuning.tile(kind, device, per_expert) for kind in ("dact", "dx", "wgrad")}
    grads = out or new_grads(rows, w_gate_up, w_down)
    check_grads(grads, rows, w_gate_up, w_down, carry)
    if nothing_to_launch(grads, experts, rows):
        return grads
    programs = runtime.num_programs(device, num_programs)
    counts, offsets = counts.to(torch.int32), offsets.to(torch.int32)
    gluon_dact = warp_specialized and warp_specialized_forward(device, cfg["dact"]) and cfg["dact"].block_n == 128
    gluon_wgrad = warp_specialized and warp_specialized_wgrad(device, cfg["wgrad"])
    gathers = gathers_on_load(gluon_dact and gluon_wgrad, expert_ops.GATHER_BACKWARD, dy_rows)
    if dy_index is not None and (bias is not None or not gathers):
        dy_rows, dy_index = gathered_rows(dy_rows, dy_index, rows), None  # a kernel here reads rows in order
    d_h, act_w = dact(dy_rows, row_weights, h, counts, offsets, w_down, grads.d_router, cfg["dact"], programs,
                      activation, gluon_dact, dy_index)
    bias_backward(bias, d_h, dy_rows, row_weights, counts, offsets, grads.d_router)
    dx(d_h, w_gate_up, grads, counts, offsets, cfg["dx"], programs)
    wgrads(dy_rows, act_w, d_h, x_rows, grads, offsets, counts, cfg["wgrad"], programs, warp_specialized, carry,
           dy_index, x_index, gathers)
    return grads


def wgrads(dy_rows: torch.Tensor, act_w: torch.Tensor, d_h: torch.Tensor, x_rows: torch.Tensor, grads: ExpertGrads,
           offsets: torch.Tensor, counts: torch.Tensor, tile: TileConfig, programs: int, warp_specialized: bool,
           carry: WgradCarry | None, dy_index: torch.Tensor | None = None, x_index: torch.Tensor | None = None,
           gathers: bool = True) -> None:
    """Both weight gradients of :func:`expert_backward` (BF16 rows, int32 offsets and counts): ``dW_down = dyᵀ ·
    act_w``, then ``dW_gate_up = d_hᵀ · x``, each from the window's ``carry`` where given; ``dy_index`` / ``x_index``
    read those rows by token (:func:`wgrad`), at :func:`gathering_wgrad_tile` where ``gathers`` (the pass's kernels
    gather on load)."""
    carries = (None, None) if carry is None else carry.pairs()
    for (a, b, a_index, b_index, dw), pair in zip(((dy_rows, act_w, dy_index, None, grads.d_w_down),
                                                   (d_h, x_rows, None, x_index, grads.d_w_gate_up)), carries):
        t = gathering_wgrad_tile(tile) if gathers and (a_index is not None or b_index is not None) else tile
        wgrad(a, b, dw, offsets, counts, t, programs, warp_specialized,
              carry=None if carry is None else (carry.modes, *pair), a_index=a_index, b_index=b_index)


def dact(dy_rows: torch.Tensor, row_weights: torch.Tensor, h: torch.Tensor, counts: torch.Tensor,
         offsets: torch.Tensor, w_down: torch.Tensor, d_router: torch.Tensor, tile: TileConfig, programs: int,
         activation: Activation, gluon: bool, dy_index: torch.Tensor | None = None,
         d_h_grid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The dact launch of :func:`expert_backward` over ``h``'s rows (at least one): ``g = dy · w_down[l]`` and the
    SwiGLU backward in its epilogue; returns bf16 ``d_h [R, 2I]`` and ``act_w [R, I]`` and writes the rows' router
    gradients into ``d_router`` (the n-tiles' partials added in n order). ``gluon``: the warp-specialised kernel
    (Hopper, 128 x 128 tiles; ``dy_index`` gathers d_out rows by token there only); int32 counts and offsets.
    ``d_h_grid`` (bf16 `[R, 2I]`, contiguous): also d_h rounded to the MXFP8 grid along 2I, the values
    ``mx_round_activations(d_h)`` gives: stored by the epilogue where its column quarters are whole 32-blocks
    (Triton tiles 128 wide or more; the Gluon kernel with :data:`GLUON_D_H_GRID`), else by that pass after it."""
    experts, d, i = w_down.shape
    rows, device = h.shape[0], h.device
    d_h = torch.empty(rows, 2 * i, dtype=torch.bfloat16, device=device)
    if d_h_grid is not None:
        checks.check_tensors((("d_h_grid", d_h_grid, (rows, 2 * i), torch.bfloat16),), device)
        if not d_h_grid.is_contiguous() or i % MX_BLOCK:
            raise ValueError(f"d_h_grid must be contiguous and I a multiple of {MX_BLOCK}, got strides "
                             f"{d_h_grid.stride()}, I={i}")
    fuse_grid = d_h_grid is not None and (GLUON_D_H_GRID if gluon else tile.block_n % (4 * MX_BLOCK) == 0)
    grid_args = {"d_h_grid_ptr": d_h_grid, "D_H_GRID": True} if fuse_grid else {}
    act_w = torch.empty(rows, i, dtype=torch.bfloat16, device=device)
    c = tile
    num_n = -(-i // c.block_n)
    partial = torch.zeros(rows, num_n, dtype=torch.float32, device=device)
    if gluon:
        tile_map = build_row_tiles(counts, offsets, rows, 128)
        with scratch_allocator():
            dact_warp_specialized.dact_ws_kernel[(programs,)](
                dy_rows, w_down.view(experts * d, i), h, row_weights, d_h, act_w, partial, dy_rows.stride(0),
                h.stride(0), d_h.stride(0), act_w.stride(0), partial.stride(0), tile_map.tile_expert,
                tile_map.tile_row0,
                tile_map.tile_row_end, tile_map.tile_run, tile_map.num_tiles, rows, experts * d, d, i,
                activation.kernel_limit, activation.kernel_alpha,
                tile_map.tile_expert if dy_index is None else dy_index, d_h_grid if fuse_grid else d_h, num_warps=4,
                A_GATHER=dy_index is not None, D_H_GRID=fuse_grid,
                **dact_ws_constexprs(c, programs, act=activation.kernel_id))
    else:
        launch_row_tasks(
            expert_gemm_bwd.dact_swiglu_bwd_kernel, c, programs, counts, offsets, rows,
            head=(descriptor(dy_rows, [c.block_m, c.block_k]),
                  descriptor(w_down.view(experts * d, i), [c.block_k, c.block_n]),
                  h, row_weights, d_h, act_w, partial,
                  h.stride(0), d_h.stride(0), act_w.stride(0), partial.stride(0)),
            tail=(d, i, activation.kernel_limit, activation.kernel_alpha),
            ACT=activation.kernel_id, **grid_args,
        )
    # the n-tiles' partials added in n order (the backward megakernel adds them the same way)
    expert_gemm_bwd.router_grad_kernel[(-(-rows // ROUTER_GRAD_ROWS),)](
        partial, partial.stride(0), d_router, rows, num_n, BLOCK_M=ROUTER_GRAD_ROWS)
    if d_h_grid is not None and not fuse_grid:
        mx_round_activations(d_h, out=d_h_grid)
    return d_h, act_w


def dx(d_h: torch.Tensor, w_gate_up: torch.Tensor, grads: ExpertGrads, counts: torch.Tensor, offsets: torch.Tensor,
       tile: TileConfig, programs: int) -> None:
    """The dx launch of :func:`expert_backward`: ``grads.d_x`` rows (or their slots, ``grads.d_x_index``) =
    ``d_h · w_gate_up[l]`` (K = 2I) over ``d_h``'s rows (at least one); int32 counts and offsets."""
    experts, two_i, d = w_gate_up.shape
    c = tile
    scatter = grads.d_x_index is not None
    launch_row_tasks(
        expert_gemm_bwd.dx_kernel, c, programs, counts, offsets, d_h.shape[0],
        head=(descriptor(d_h, [c.block_m, c.block_k]),
              descriptor(w_gate_up.view(experts * two_i, d), [c.block_k, c.block_n]),
              grads.d_x, grads.d_x.stride(0), grads.d_x_index if scatter else grads.d_x),
        tail=(d, two_i // 2), SCATTER=scatter,
    )


def new_grads(rows: int, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> ExpertGrads:
    """Fresh :class:`ExpertGrads` for ``rows`` rows (``d_router`` zeroed: rows outside regions read 0)."""
    device, bf16 = w_gate_up.device, torch.bfloat16
    return ExpertGrads(d_x=torch.empty(rows, w_down.shape[1], dtype=bf16, device=device),
                       d_router=torch.zeros(rows, dtype=torch.float32, device=device),
                       d_w_gate_up=torch.empty(w_gate_up.shape, dtype=bf16, device=device),
                       d_w_down=torch.empty(w_down.shape, dtype=bf16, device=device))


def check_grads(grads: ExpertGrads, rows: int, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                carry: WgradCarry | None) -> None:
    """ValueError unless ``grads`` (a caller's ``out``) and ``carry`` fit ``rows`` rows of these experts."""
    experts, two_i, d = w_gate_up.shape
    index = grads.d_x_index
    if index is None:
        d_x = [("out.d_x", grads.d_x, (rows, d), torch.bfloat16)]
    else:  # the slots the rows land in: any number of them
        checks.check_row_index("out.d_x_index", index, rows, w_gate_up.device)
        d_x = [("out.d_x", grads.d_x, (grads.d_x.shape[0], d), torch.bfloat16)]
    want = [*d_x, ("out.d_router", grads.d_router, (rows,), torch.float32),
            ("out.d_w_gate_up", grads.d_w_gate_up, tuple(w_gate_up.shape), torch.bfloat16),
            ("out.d_w_down", grads.d_w_down, tuple(w_down.shape), torch.bfloat16)]
    if carry is not None:
        want += [("carry.modes", carry.modes, (experts,), torch.int32),
                 ("carry.down_in", carry.down_in, (d, two_i // 2), torch.float32),
                 ("carry.down_out", carry.down_out, (d, two_i // 2), torch.float32),
                 ("carry.gate_up_in", carry.gate_up_in, (two_i, d), torch.float32),
                 ("carry.gate_up_out", carry.gate_up_out, (two_i, d), torch.float32)]
    checks.check_tensors(tuple(want), w_gate_up.device)


def nothing_to_launch(grads: ExpertGrads, experts: int, rows: int) -> bool:
    """True where an expert backward has nothing to launch: no experts, or no rows (their weight gradients then
    zero)."""
    if experts and not rows:
        grads.d_w_gate_up.zero_()
        grads.d_w_down.zero_()
    return not experts or not rows


def dact_ws_constexprs(tile: TileConfig, programs: int, *, act: int = 0) -> dict:
    """The Gluon dacts' constexprs at ``tile`` (BF16's and FP8-block's; shared with the sm_90 build check): the
    plan's BLOCK_K (FP8-block's is its scale block, 128), ring depth (at least ``gluon_ring.MIN_STAGES``: a wgmma
    group, or FP8's second K step, stays in flight) and task order."""
    return dict(ACT=act, NUM_PROGRAMS=programs, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
                STAGES=max(gluon_ring.MIN_STAGES, tile.num_stages))


def warp_specialized_wgrad(device: torch.device, tile: TileConfig) -> bool:
    """True when :func:`wgrad` runs the warp-specialised Gluon kernel: compiled on Hopper, 128-row blocks (its two
    64-row consumer warpgroups)."""
    return compiled_gpu(device) and torch.cuda.get_device_capability(device)[0] == 9 and tile.block_m == 128


def gathering_wgrad_tile(tile: TileConfig) -> TileConfig:
    """A wgrad gathering rows by token (d_out for the down wgrad; x for gate/up's, gathered as A too) steps K 64
    rows at a time (at least): half the producer's index loads and cp.async rounds per row of a 32-row step. One
    H100, sonic-7b's down wgrad: 0.396 ms at BK 64 against 0.557 at the pass's 32 (the copy + wgrad 0.703;
    benchmarks/results/2026-12-06-h100-wgrad-gather). The rows are reduced in the same order, so the bits are the
    32-row step's."""
    return tile if tile.block_k >= 64 else replace(tile, block_k=64)


#: The Gluon wgrad stores each half block in four 64-column quarters through two 64 x 64 buffers a consumer
#: (``wgrad_blocks.store_half_split``), its ring deeper by the shared memory that frees (8 slots instead of 6 at
#: BK 32, 4 instead of 3 at BK 64). One H100, the backward's wgrads against whole-half stores, each in its own
#: process: qwen3-235b-a22b 4.60 against 4.89 ms, deepseek-v3 14.12 / 14.30 against 14.33 / 14.49 (zipf 18.46
#: against 18.62), qwen3-30b-a3b and sonic-120b ties, gpt-oss-120b 3.85-3.86 against 3.83 (the same bits, GPU-tested;
#: benchmarks/results/2026-12-07-wgrad-split-store, calls 14, 18, 19). ``MEGAMOE_WGRAD_SPLIT_STORE`` (0 or 1) sets it.
WGRAD_SPLIT_STORE = runtime.env_switch("MEGAMOE_WGRAD_SPLIT_STORE", True)


def wgrad_ws_constexprs(tile: TileConfig, programs: int, dynamic: bool = False, split: bool | None = None,
                        planned: bool = False) -> dict:
    """The Gluon wgrad's constexprs at ``tile``'s block: its ring as deep as shared memory allows
    (:func:`~megamoe.planner.tiles.wgrad_ws_stages`), one wgmma left in flight from
    :data:`~megamoe.planner.tiles.WGRAD_MMA_IN_FLIGHT_STAGES` on (the measurements are there). ``split``: the
    split store (None: :data:`WGRAD_SPLIT_STORE`) where the block is 256 wide; the dynamic deal stores whole halves.
    ``dynamic`` / ``planned``: the blocks dealt from a counter / by the plan (:data:`WGRAD_DYNAMIC`,
    :data:`WGRAD_PLAN_SKEW`), not both."""
    if dynamic and planned:
        raise ValueError("the Gluon wgrad deals its blocks from a counter or by a plan, not both")
    split = (WGRAD_SPLIT_STORE if split is None else split) and not dynamic and tile.block_n == 4 * SPLIT_N.value
    stages = wgrad_ws_stages(tile.block_n, tile.block_k, split)
    return dict(NUM_PROGRAMS=programs, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, STAGES=stages,
                MMA_IN_FLIGHT=stages >= WGRAD_MMA_IN_FLIGHT_STAGES, SPLIT_STORE=split, DYNAMIC=dynamic,
                PLANNED=planned)


#: The Gluon wgrad takes its blocks from a counter as programs come free, heavy experts first from one end and light
#: ones from the other (``wgrad_dynamic.dealt_block``), instead of each expert's blocks round robin. Under
#: zipf routing the static deal piles the hot expert's long blocks onto programs that hold their share of the rest,
#: and runs write-bound light experts and compute-bound heavy ones one after another (the wgrads 1.30x / 1.38x
#: uniform routing's at deepseek-v3 / qwen3-30b-a3b on one H100, benchmarks/results/2026-12-07-defaults-step). The
#: same bits (GPU-tested). Off: on one H100 it took qwen3-30b-a3b's zipf wgrads from 3.24 to 2.54 ms but cost every
#: block a fixed ~1.5 us (deepseek-v3's uniform wgrads 14.67 -> 18.56 ms; benchmarks/results/2026-12-06-dynamic-wgrad),
#: the producer's chained round trips between blocks; with them hidden under a block held ahead the cost fell to
#: +2.0 ms / +2 % but the zipf gain went (benchmarks/results/2026-12-06-deal-rebuilt, call 9); taken before a
#: block's last loads it kept the zipf gain (2.55 ms) but uniform loads paid more again (deepseek-v3 14.52 -> 17.51
#: ms, qwen3-30b-a3b +7 %; call 11). ``MEGAMOE_WGRAD_DYNAMIC`` (0 or 1) sets it.
WGRAD_DYNAMIC = runtime.env_switch("MEGAMOE_WGRAD_DYNAMIC", False)

#: The Gluon wgrad deals the counter's order (experts heaviest first) by a fixed plan (``wgrad_planned``) where the
#: heaviest expert a launch computes has at least this many times their mean rows, else round robin: on one H100 the
#: plan ran zipf wgrads 0.75-0.91x the static deal's and uniform ones 1.07-1.09x, tying near 3.4x the mean
#: (benchmarks/results/2026-12-07-wgrad-planned, calls 25-27; docs/performance.md). The deal kernel tests it on the
#: device; the launch not picked does nothing (the plan's exits before its partitions: its no-op had cost even loads'
#: wgrads 0.5-1.7 %, benchmarks/results/2026-12-07-two-ended-tiles); either deal gives the same bits.
#: ``MEGAMOE_WGRAD_PLAN_SKEW`` (>= 0; 0: the plan alone, ``inf``: the static deal alone); with
#: ``MEGAMOE_WGRAD_DYNAMIC`` the counter deals.
WGRAD_PLAN_SKEW = runtime.env_ratio("MEGAMOE_WGRAD_PLAN_SKEW", 5.0)
runtime.retired_knob("MEGAMOE_WGRAD_PLANNED", "MEGAMOE_WGRAD_PLAN_SKEW=0 deals by the plan always, inf never "
                                              "(the default, 5, where the routing is skewed)")

DEAL_CHUNK = 32  # experts wgrad_deal_kernel compares each expert with at a time


def wgrad_blocks_per_expert(out_m: int, out_n: int, block_n: int) -> int:
    """The Gluon wgrad's blocks of one expert's `[out_m, out_n]` gradient (two 64-row halves by ``block_n``)."""
    return -(-out_m // (2 * HALF_M.value)) * -(-out_n // block_n)


def wgrad_deal(counts: torch.Tensor, offsets: torch.Tensor, modes: torch.Tensor | None,
               per_expert: int, skew: float = 0.0) -> torch.Tensor:
    """The dynamic and the planned deals' int32 `[2 + 4 L]` (``wgrad_ws_kernel``'s ``deal``): the block counter (0;
    the plan leaves it unread), the blocks to deal (every expert's, or with a window's ``modes`` those of the
    experts it computes; none where the heaviest of those has fewer than ``skew`` times their mean rows: the plan
    then deals nothing and the static deal's launch everything, :data:`WGRAD_PLAN_SKEW`), then the experts by their
    rows, heaviest first (the ones the window skips last, never dealt; ties in expert order), each as
    ``(expert, row0, row_end, 0)`` (``wgrad_dynamic.DEAL_FIELDS``). One launch of ``wgrad_deal_kernel`` (int32
    counts, offsets and modes; device work only)."""
    experts = counts.numel()
    deal = torch.empty(2 + 4 * experts, dtype=torch.int32, device=counts.device)
    wgrad_deal_kernel[(1,)](counts, offsets, counts if modes is None else modes, deal, experts, per_expert, skew,
                            HAS_MODES=modes is not None, EXPERTS=triton.next_power_of_2(max(experts, 1)),
                            CHUNK=DEAL_CHUNK, num_warps=4)
    return deal


def wgrad(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor,
          tile: TileConfig, programs: int, warp_specialized: bool = True,
          carry: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
          a_index: torch.Tensor | None = None, b_index: torch.Tensor | None = None) -> None:
    """``out[l] = a[rows of l]ᵀ · b[rows of l]`` for every expert l (a `[R, M]`, b `[R, N]`, out `[L, M, N]`,
    contiguous bf16; int32 offsets and counts): the expert weight gradient, rows reduced in order. ``carry``:
    ``(modes, carry_in, carry_out)`` of a backward window (``megamoe.kernels.wgrad_carry``). ``a_index`` /
    ``b_index``: int32 `[>= R]`, a is `[S, M]` / b `[S, N]` and row r's is ``a[a_index[r]]`` / ``b[b_index[r]]``
    (R: the rows of the other operand, or of ``offsets``' regions).

    On Hopper the warp-specialised Gluon kernel (`megamoe.kernels.wgrad_warp_specialized`; the indexed operand's
    rows gathered by its producer, b's as its A with the blocks stored transposed; two launches, the plan's and the
    static deal's, one of them a no-op: :data:`WGRAD_PLAN_SKEW`), elsewhere, under the
    interpreter and with ``warp_specialized=False`` ``wgrad_kernel`` (the indexed rows copied first): the same
    sums in the same order, the same bits (a GPU test holds them to it)."""
    experts, out_m, out_n = out.shape
    if a_index is not None and b_index is not None:
        raise ValueError("wgrad gathers one operand's rows, not both")
    if not experts:  # no gradient to write (and the deals' first entry would lie past an empty deal)
        return
    window = carry if carry is not None else (counts, out, out)  # never read without CARRY
    gluon = warp_specialized and warp_specialized_wgrad(a.device, tile)
    if not gathers_on_load(gluon, expert_ops.GATHER_BACKWARD, a if a_index is not None else b):  # the rows copied first
        if a_index is not None:
            a, a_index = gathered_rows(a, a_index, b.shape[0]), None
        if b_index is not None:
            b, b_index = gathered_rows(b, b_index, a.shape[0]), None
    with scratch_allocator():
        if gluon:
            # b gathered (x): as A, the blocks stored transposed (each x row then read once per 256 of out_m, not
            # per 128; the gatherer fetches A's 64-wide halves)
            out_t = b_index is not None
            if out_t:
                a, b, a_index, out_m, out_n = b, a, b_index, out_n, out_m
            args = (a, b, out, offsets, counts, experts, out_m, out_n, *window, counts if a_index is None else a_index)
            flags = dict(CARRY=carry is not None, A_GATHER=a_index is not None, OUT_T=out_t, num_warps=4)
            deal = None
            if WGRAD_DYNAMIC or WGRAD_PLAN_SKEW != math.inf:
                deal = wgrad_deal(counts, offsets, None if carry is None else carry[0],
                                  wgrad_blocks_per_expert(out_m, out_n, tile.block_n),
                                  0.0 if WGRAD_DYNAMIC else WGRAD_PLAN_SKEW)
                dealt_consts = wgrad_ws_constexprs(tile, programs, WGRAD_DYNAMIC, planned=not WGRAD_DYNAMIC)
                wgrad_warp_specialized.wgrad_ws_kernel[(programs,)](*args, deal_ptr=deal, **dealt_consts, **flags)
            if not WGRAD_DYNAMIC and WGRAD_PLAN_SKEW != 0:  # the static deal, a no-op where the plan dealt
                wgrad_warp_specialized.wgrad_ws_kernel[(programs,)](
                    *args, skip_ptr=None if deal is None else deal[1:], **wgrad_ws_constexprs(tile, programs), **flags)
            return
        tile = tile if carry is None else carry_tile(tile)
        expert_gemm_bwd.wgrad_kernel[(programs,)](
            a, b, out, offsets, counts, experts, out_m, out_n, *window, DOT_FP32=interpreting(),
            NUM_PROGRAMS=programs, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            FLATTEN=tile.flatten, CARRY=carry is not None, num_warps=tile.num_warps, num_stages=tile.num_stages)


def expert_backward_reference(
    dy_rows: torch.Tensor,
    row_weights: torch.Tensor,
    x_rows: torch.Tensor,
    h: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    activation: Activation = SWIGLU,
) -> ExpertGrads:
    """The torch twin of :func:`expert_backward` in FP32, from the same saved ``h``.

    Autograd runs from h (as the kernels do: the clamp masks see the saved
    BF16 pre-activation), then d_x = d_h · w_gate_up and dW_gate_up = d_hᵀ · x.
    Rows outside expert regions are NaN.
    """
    rows, d = x_rows.shape
    nan = dict(dtype=torch.float32, device=x_rows.device)
    grads = ExpertGrads(torch.full((rows, d), float("nan"), **nan), torch.full((rows,), float("nan"), **nan),
                        torch.zeros(w_gate_up.shape, **nan), torch.zeros(w_down.shape, **nan))
    for l, (start, count) in enumerate(zip(offsets.tolist(), counts.tolist())):
        sl = slice(start, start + count)
        h_l, w_down_l, w = (t.float().requires_grad_() for t in (h[sl], w_down[l], row_weights[sl]))
        y = activate(h_l, activation) @ w_down_l.T
        d_h, grads.d_w_down[l], grads.d_router[sl] = torch.autograd.grad(
            (y * w[:, None] * dy_rows[sl].float()).sum(), [h_l, w_down_l, w])
        grads.d_x[sl] = d_h @ w_gate_up[l].float()
        grads.d_w_gate_up[l] = d_h.T @ x_rows[sl].float()
    return grads
