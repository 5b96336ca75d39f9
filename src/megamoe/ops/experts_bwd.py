"""BF16 expert FFN backward over schedule-grouped rows: the launches and their torch twin.

:func:`expert_backward` is the backward of :func:`megamoe.ops.experts.expert_forward` (dact + SwiGLU', the
router gradient, dx and both weight gradients; `megamoe.kernels.expert_gemm_bwd` and, on Hopper, the Gluon dact;
the weight gradients' launch, its deal and plan, in :mod:`megamoe.ops.expert_wgrad`);
:func:`expert_backward_reference` its plain-PyTorch twin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe import checks, runtime
from megamoe.config import SWIGLU, Activation
from megamoe.kernels import dact_warp_specialized, dx_warp_specialized, expert_gemm_bwd, gluon_ring
from megamoe.ops.expert_bias import BiasGrads, bias_backward
from megamoe.ops import experts as expert_ops  # its switches, read at each call (tests set them)
from megamoe.ops.expert_wgrad import gathering_wgrad_tile, warp_specialized_wgrad, wgrad
from megamoe.ops.experts import check_operands, gathered_rows, gathers_on_load, warp_specialized_forward
from megamoe.ops.launch import descriptor, launch_row_tasks, scratch_allocator
from megamoe.planner.tiles import TileConfig, mean_rows, ping_pong_tile
from megamoe.planner.tuning import DEFAULT_TUNING, Tuning
from megamoe.precision import MX_BLOCK
from megamoe.reference import activate
from megamoe.routing.row_tiles import build_row_tiles


#: Rows per program of the router-gradient sum (a few loads per row: any size does).
ROUTER_GRAD_ROWS = 128

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
    dx(d_h, w_gate_up, grads, counts, offsets, cfg["dx"], programs, warp_specialized)
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
    ``d_h_grid`` (bf16 `[R, 2I]`, contiguous; :func:`grid_in_epilogue` tiles): the epilogue also stores d_h rounded
    to the MXFP8 grid along 2I there, the values ``mx_round_activations(d_h)`` gives."""
    experts, d, i = w_down.shape
    rows, device = h.shape[0], h.device
    d_h = torch.empty(rows, 2 * i, dtype=torch.bfloat16, device=device)
    if d_h_grid is not None:
        checks.check_tensors((("d_h_grid", d_h_grid, (rows, 2 * i), torch.bfloat16),), device)
        if not (d_h_grid.is_contiguous() and i % MX_BLOCK == 0 and grid_in_epilogue(tile, gluon)):
            raise ValueError(f"d_h_grid needs contiguous rows, I a multiple of {MX_BLOCK} and a grid_in_epilogue tile, "
                             f"got strides {d_h_grid.stride()}, I={i}, block_n {tile.block_n}")
    grid_args = {} if d_h_grid is None else {"d_h_grid_ptr": d_h_grid, "D_H_GRID": True}
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
                tile_map.tile_expert if dy_index is None else dy_index, d_h if d_h_grid is None else d_h_grid,
                num_warps=4, A_GATHER=dy_index is not None, D_H_GRID=d_h_grid is not None,
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
    return d_h, act_w


def grid_in_epilogue(tile: TileConfig, gluon: bool) -> bool:
    """Whether :func:`dact`'s epilogue can store d_h on the MXFP8 grid (``d_h_grid``): its column quarters are whole
    32-blocks of 2I (the Gluon kernel's 32 columns; Triton tiles a multiple of 128 wide)."""
    return gluon or tile.block_n % (4 * MX_BLOCK) == 0


def dx(d_h: torch.Tensor, w_gate_up: torch.Tensor, grads: ExpertGrads, counts: torch.Tensor, offsets: torch.Tensor,
       tile: TileConfig, programs: int, gluon: bool = True) -> None:
    """The dx launch of :func:`expert_backward`: ``grads.d_x`` rows (or their slots, ``grads.d_x_index``) =
    ``d_h · w_gate_up[l]`` (K = 2I) over ``d_h``'s rows (at least one); int32 counts and offsets. ``gluon``: on
    Hopper 128-row tiles with K at most ``PING_PONG_MAX_K["dx"]`` run in the Gluon ping-pong
    (``dx_warp_specialized``) where ``MEGAMOE_PING_PONG_DX`` is 1, other 128-row tiles in its cooperative form where
    ``MEGAMOE_GLUON_DX`` is 1, else ``dx_kernel``: the same bits."""
    experts, two_i, d = w_gate_up.shape
    c = tile
    scatter = grads.d_x_index is not None
    # the switches first: warp_specialized_forward asks the device's capability, a host call on every dx
    hopper = gluon and (expert_ops.PING_PONG_DX or expert_ops.GLUON_DX) and warp_specialized_forward(d_h.device, tile)
    ping_pong = ping_pong_tile("dx", tile, two_i) if hopper and expert_ops.PING_PONG_DX else None
    if ping_pong is not None or (hopper and expert_ops.GLUON_DX):
        rows = d_h.shape[0]
        tile_map = build_row_tiles(counts, offsets, rows, 128)
        with scratch_allocator():
            dx_warp_specialized.dx_ws_kernel[(programs,)](
                d_h, w_gate_up.view(experts * two_i, d), grads.d_x,
                grads.d_x_index if scatter else tile_map.tile_expert, d_h.stride(0), grads.d_x.stride(0),
                tile_map.tile_expert, tile_map.tile_row0, tile_map.tile_row_end, tile_map.tile_run,
                tile_map.num_tiles, rows, experts * two_i, two_i, d, num_warps=4, SCATTER=scatter,
                **dx_ws_constexprs(ping_pong or tile, programs, ping_pong=ping_pong is not None))
        return
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


def dx_ws_constexprs(tile: TileConfig, programs: int, *, ping_pong: bool = True) -> dict:
    """The Gluon dx's constexprs at ``tile`` (shared with the sm_90 build check): in ping-pong (``ping_pong``, at
    ``planner.tiles.ping_pong_tile``'s 128 columns) or cooperative (at the tile's BLOCK_N), its BLOCK_K, task order
    and ring depth (at least ``gluon_ring.MIN_STAGES``); ``SKIP_EMPTY_HALF``, the switch's."""
    return dict(NUM_PROGRAMS=programs, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
                STAGES=max(gluon_ring.MIN_STAGES, tile.num_stages), SKIP_EMPTY_HALF=expert_ops.SKIP_EMPTY_HALF,
                PING_PONG=ping_pong, BLOCK_N=128 if ping_pong else tile.block_n)


def dact_ws_constexprs(tile: TileConfig, programs: int, *, act: int = 0) -> dict:
    """The Gluon dacts' constexprs at ``tile`` (BF16's and FP8-block's; shared with the sm_90 build check): the
    plan's BLOCK_K (FP8-block's is its scale block, 128), ring depth (at least ``gluon_ring.MIN_STAGES``: a wgmma
    group, or FP8's second K step, stays in flight) and task order; ``SKIP_EMPTY_HALF``, the switch's."""
    return dict(ACT=act, NUM_PROGRAMS=programs, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
                STAGES=max(gluon_ring.MIN_STAGES, tile.num_stages), SKIP_EMPTY_HALF=expert_ops.SKIP_EMPTY_HALF)


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
