"""MXFP8 as the BF16 expert kernels on operands rounded to its grid: the forward and the backward.

Hopper has no block-scaled MMA, so the MXFP8 tiles (:mod:`megamoe.ops.experts_mxfp8`, the MXFP8 backward of
:mod:`megamoe.ops.experts_fp8_bwd`) dequantise each loaded E4M3 tile to bf16 (exact) and run bf16 wgmma with FP32
accumulation: their numbers are "BF16 GEMM, FP32 accumulation, on operands rounded to the MXFP8 grid". This module
computes the same numbers with the tuned BF16 expert kernels (:mod:`megamoe.ops.experts`,
:mod:`megamoe.ops.experts_bwd`: warp-specialised Gluon on Hopper), each operand rounded to the grid along its
GEMM's reduction axis once and kept bf16 (``megamoe.ops.quant.mx_round_activations`` / ``mx_round_weights``, bit for
bit ``mxfp8_dequantize(mxfp8_quantize(t))`` cast to bf16, which is what the MXFP8 tiles feed their MMAs). The bits
differ from the MXFP8 tiles' by the order of the FP32 sums only.

    operand                              rounded along                     where
    w_gate_up, w_down (forward)          D, I                              the step's pack (``RoundedWeights``)
    w_down, w_gate_up (dgrads)           D, 2I                             the pack, with ``backward``
    x rows                               D                                 E4M3 rows dequantised (the forward's input;
                                                                           one rank: its BF16 tokens rounded)
    act = SwiGLU(h)                      I                                 the gate/up epilogue (MX_ROUND)
    d_out rows (dact)                    D                                 pulled E4M3 rows dequantised, or rounded
                                                                           (one rank: its staged BF16 tokens)
    d_h (dx)                             2I                                the dact epilogue (``d_h_grid``), or a
                                                                           pass (:data:`GLUON_D_H_GRID` off)
    d_out, act_w, d_h, x (wgrads)        tokens: 32-row blocks of each     here, into each expert's 128-row span
                                         expert's rows, zero-padded        (``token_blocks``), the wgrads' regions;
                                         (none with BF16 wgrads, the       BF16 wgrads: BF16 rows
                                         default: ``bf16_wgrads``)

E4M3 rows (:class:`~megamoe.ops.comm.QuantRows`: the pulled upstream gradient, the forward ring's x) are
dequantised on load (exact: their values are on the grid along D) and, for the wgrads, rounded again along the
tokens, as the MXFP8 backward quantises them. h is the BF16 pre-activation (the SwiGLU backward reads it as
BF16's does). Twins: ``expert_forward_mxfp8_reference``, ``expert_backward_mxfp8_reference``.

:data:`megamoe.ops.experts_mxfp8.AS_BF16` switches the layer to this formulation (on by default: 1.9x the MXFP8
tiles' step on one H200, benchmarks/results/2026-12-06-mxfp8-as-bf16). What it trades: the pack holds a bf16 copy
of the routed weights per GEMM axis (two for the forward, two more with the backward) besides the E4M3 forward
weights, and each activation operand is written once more as bf16 (a rounding pass, or the epilogue's); the GEMMs
then run as BF16's.
"""

from __future__ import annotations

import torch

from megamoe import checks, runtime
from megamoe.config import SWIGLU, Activation
from megamoe.ops.comm import QuantRows
from megamoe.ops.expert_bias import BiasGrads, bias_backward
from megamoe.ops.expert_weights import RoundedWeights, rounded_weights
from megamoe.ops.experts import (ExpertForward, check_operands, expert_forward, gathered_rows,
                                 warp_specialized_forward)
from megamoe.ops.expert_wgrad import wgrad
from megamoe.ops.experts_bwd import (ExpertGrads, WgradCarry, check_grads, dact, dx, grid_in_epilogue, new_grads,
                                     nothing_to_launch)
from megamoe.ops.bf16_wgrads import TokenRows, bf16_wgrads_of, wants_bf16_wgrads
from megamoe.ops.experts_fp8_bwd import TokenBlocks, token_blocks
from megamoe.ops.quant import mx_round_activations
from megamoe.planner.tiles import mean_rows
from megamoe.planner.tuning import DEFAULT_TUNING, Tuning
from megamoe.precision import FP8_BLOCK, MX_BLOCK
from megamoe.reference.formats import mxfp8_dequantize

#: The Gluon dact (Hopper) stores dx's MXFP8-grid copy of d_h in its epilogue (``experts_bwd.dact``'s ``d_h_grid``;
#: off: the rounding pass after it, 0.150 ms of qwen3-30b-a3b's mxfp8 step on one H100, benchmarks/results/
#: 2026-12-07-mxfp8-step-cuts). Its GPU test passes (the rounding pass's bits), but on one H100 it made that dact
#: 2.1x slower (1.389 against 0.659 ms) and the step 0.4-0.5 ms slower in three alternating runs
#: (benchmarks/results/2026-12-07-eager-layer, calls 47-48): off. ``MEGAMOE_GLUON_D_H_GRID`` (0 or 1) sets it.
GLUON_D_H_GRID = runtime.env_switch("MEGAMOE_GLUON_D_H_GRID", False)


def dequantized_rows(rows: torch.Tensor | QuantRows) -> torch.Tensor:
    """bf16 rows on the MXFP8 grid along their last dim: E4M3 rows (``QuantRows`` in mxfp8) dequantised, BF16 rows
    rounded (one ``mx_round_activations`` launch either way)."""
    if isinstance(rows, QuantRows):
        if rows.format != "mxfp8":
            raise ValueError(f"rows are {rows.format} rows; this runs mxfp8")
        return mx_round_activations(rows.data, x_scale=rows.scale)
    return mx_round_activations(rows)


def token_rounded(rows: torch.Tensor | QuantRows, blocks: TokenBlocks) -> torch.Tensor:
    """A wgrad operand: ``rows [R, C]`` (bf16, or E4M3 rows dequantised on load) rounded to the MXFP8 grid along the
    tokens of each expert, in 32-row blocks from its 128-row span's start, as bf16 ``[R_pad, C]`` laid out as
    ``blocks`` (expert l's rows from row ``128 * blocks.block0[l]``, zero rows after them): the values
    ``quantize_tokens(rows, blocks, "mxfp8")`` dequantises to."""
    if isinstance(rows, QuantRows):
        return mx_round_activations(rows.data, 0, rows=blocks.src, x_scale=rows.scale)
    return mx_round_activations(rows, 0, rows=blocks.src)


def expert_forward_mxfp8_bf16(
    x_q: torch.Tensor,
    x_scale: torch.Tensor | None,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    weights: RoundedWeights,
    *,
    activation: Activation = SWIGLU,
    num_programs: int | None = None,
    out: ExpertForward | None = None,
    tuning: Tuning | None = None,
    rows_per_expert: float | None = None,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    x_index: torch.Tensor | None = None,
) -> ExpertForward:
    """The MXFP8 forward (:func:`~megamoe.ops.experts_mxfp8.expert_forward_mxfp8`'s numbers) in the BF16 kernels.

    Args:
        x_q: E4M3 `[S, D]` rows quantised along D, x_scale uint8 E8M0 `[S, D/32]`: dequantised into bf16 rows (one
            launch); or, with x_scale None, bf16 rows rounded to the grid along D (one launch: the same values,
            without an E4M3 copy first). Then read as :func:`~megamoe.ops.experts.expert_forward` reads its rows
            (with ``x_index`` int32 `[R]`, row r's input is row ``x_index[r]``: one rank's tokens; else S = R
            routed rows).
        counts, offsets: int `[L]` each expert's rows and region start.
        weights: the pack's :class:`~megamoe.ops.expert_weights.RoundedWeights` (``gate_up_along_d``,
            ``down_along_i``); D and I multiples of 32.
        activation, num_programs, out, tuning, rows_per_expert, b_gate_up, b_down: as ``expert_forward``'s
            (``out.act`` bf16 holds act on the MX grid along I: the down GEMM's operand).
    """
    if x_q.dtype != (torch.bfloat16 if x_scale is None else torch.float8_e4m3fn):
        raise ValueError(f"x_q must be float8_e4m3fn rows quantised along D with x_scale, or bfloat16 rows without, "
                         f"got {x_q.dtype} rows and x_scale {'None' if x_scale is None else x_scale.dtype}")
    i, d = weights.down_along_i.shape[2], weights.down_along_i.shape[1]
    if d % MX_BLOCK or i % MX_BLOCK:
        raise ValueError(f"mxfp8 needs D and I multiples of {MX_BLOCK}, got D={d}, I={i}")
    if x_q.shape[0] == 0 and x_index is not None:  # no tokens: any row for the index to name (none is kept)
        x = torch.zeros(1, d, dtype=torch.bfloat16, device=x_q.device)
    else:
        x = dequantized_rows(x_q if x_scale is None else QuantRows(x_q, x_scale, "mxfp8"))
    return expert_forward(x, counts, offsets, weights.gate_up_along_d, weights.down_along_i, activation=activation,
                          num_programs=num_programs, out=out, tuning=tuning, rows_per_expert=rows_per_expert,
                          b_gate_up=b_gate_up, b_down=b_down, x_index=x_index, mx_act=True)


def expert_backward_mxfp8_bf16(dy_rows: torch.Tensor | QuantRows, row_weights: torch.Tensor,
                               x_rows: torch.Tensor | QuantRows, h: torch.Tensor, counts: torch.Tensor,
                               offsets: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, *,
                               activation: Activation = SWIGLU, weights: RoundedWeights | None = None,
                               num_programs: int | None = None, tuning: Tuning | None = None,
                               rows_per_expert: float | None = None, warp_specialized: bool = True,
                               carry: WgradCarry | None = None, out: ExpertGrads | None = None,
                               bias: BiasGrads | None = None, bf16_wgrads: bool | None = None,
                               token_rows: TokenRows | None = None,
                               dy_index: torch.Tensor | None = None) -> ExpertGrads:
    """:func:`~megamoe.ops.experts_fp8_bwd.expert_backward_mxfp8`'s numbers in the BF16 backward kernels (the module
    docstring's table): the same arguments, ``weights`` the pack's rounded weights with the dgrads'
    (``rounded_weights(..., backward=True)``; made here when None or without them). ``dy_rows`` and ``x_rows``: bf16
    `[R, D]`, or mxfp8 E4M3 rows (:class:`QuantRows`). D and I multiples of 32. ``tuning``, ``rows_per_expert``,
    ``warp_specialized``, ``carry``, ``out`` (its ``d_x_index`` too) and ``bias`` as
    :func:`~megamoe.ops.experts_bwd.expert_backward`'s; ``bf16_wgrads`` and ``token_rows`` as
    :func:`~megamoe.ops.experts_fp8_bwd.expert_backward_mxfp8`'s (the wgrads on BF16 rows, none rounded).
    ``dy_index`` (int32 `[>= R]`, one rank): ``dy_rows`` is then one rank's `[S, D]` d_out tokens (bf16, or the
    staged mxfp8 E4M3 rows), put on the grid here once (S rows, not R), and row r's is ``dy_rows[dy_index[r]]``: on
    Hopper the Gluon dact's producer gathers them (no pull); elsewhere, with biases or with wgrads that read dy in
    row order, one gather copies them first. The same bits as the routed rows."""
    x_data = x_rows.data if isinstance(x_rows, QuantRows) else x_rows
    bf16 = wants_bf16_wgrads(bf16_wgrads, token_rows, "mxfp8",
                             mean_rows(x_data.shape[0], w_gate_up.shape[0], rows_per_expert))
    dy_data = dy_rows.data if isinstance(dy_rows, QuantRows) else dy_rows
    for name, r in (("x_rows", x_rows), ("dy_rows", dy_rows)):
        if isinstance(r, QuantRows) and r.format != "mxfp8":
            raise ValueError(f"{name} are {r.format} rows; this backward runs mxfp8")
    like_x = x_rows if x_data is x_rows else torch.zeros((), dtype=torch.bfloat16, device=x_data.device).expand(
        x_data.shape)
    experts, i, d = check_operands(like_x, counts, offsets, w_gate_up, w_down)
    if dy_index is not None:
        checks.check_row_index("dy_index", dy_index, x_data.shape[0], x_data.device)
        if dy_data.dim() != 2 or dy_data.shape[1] != d:
            raise ValueError(f"dy_rows read by dy_index must be [S, D={d}] tokens, got {tuple(dy_data.shape)}")
    elif tuple(dy_data.shape) != tuple(x_data.shape):
        raise ValueError(f"dy_rows {tuple(dy_data.shape)} and x_rows {tuple(x_data.shape)} must have one shape")
    if d % MX_BLOCK or i % MX_BLOCK:
        raise ValueError(f"mxfp8 needs D and I multiples of {MX_BLOCK}, got D={d}, I={i}")
    rows, device = x_data.shape[0], x_data.device
    grads = out or new_grads(rows, w_gate_up, w_down)
    check_grads(grads, rows, w_gate_up, w_down, carry)
    if nothing_to_launch(grads, experts, rows):
        return grads
    wt = weights if weights is not None and weights.backward else rounded_weights(w_gate_up, w_down, backward=True)
    tuning = tuning or DEFAULT_TUNING
    per_expert = mean_rows(rows, experts, rows_per_expert)
    cfg = {kind: tuning.tile(kind, device, per_expert) for kind in ("dact", "dx", "wgrad")}
    programs = runtime.num_programs(device, num_programs)
    counts, offsets = counts.to(torch.int32), offsets.to(torch.int32)
    # dact: d_out on the grid along D (the pulled E4M3 rows' own values), w_down along D
    gluon_dact = warp_specialized and warp_specialized_forward(device, cfg["dact"]) and cfg["dact"].block_n == 128
    dy_grid = dequantized_rows(dy_rows)  # with dy_index the tokens: S rows, not R
    if dy_index is not None and (bias is not None or not gluon_dact or not (bf16 and token_rows is not None)):
        dy_grid = dy_rows = gathered_rows(dy_grid, dy_index, rows)  # a reader here takes the rows in order
        dy_index = None
    # dx's d_h on the grid along 2I: stored by the dact's epilogue beside d_h (which the wgrads and biases read)
    # where its tile allows, else rounded in a pass after it
    grid_stored = grid_in_epilogue(cfg["dact"], gluon_dact) and (GLUON_D_H_GRID or not gluon_dact)
    d_h_grid = torch.empty(rows, 2 * i, dtype=torch.bfloat16, device=device) if grid_stored else None
    d_h, act_w = dact(dy_grid, row_weights, h, counts, offsets, wt.down_along_d, grads.d_router,
                      cfg["dact"], programs, activation, gluon_dact, dy_index, d_h_grid=d_h_grid)
    if d_h_grid is None:
        d_h_grid = mx_round_activations(d_h)
    if bias is not None:  # from the rows as pulled (E4M3: dequantised, as the MXFP8 backward sums them)
        dy_sums = mxfp8_dequantize(dy_rows.data, dy_rows.scale) if isinstance(dy_rows, QuantRows) else dy_rows
        bias_backward(bias, d_h, dy_sums, row_weights, counts, offsets, grads.d_router)
    # dx: d_h on the grid along 2I, w_gate_up along 2I
    dx(d_h_grid, wt.gate_up_along_2i, grads, counts, offsets, cfg["dx"], programs, warp_specialized)
    if bf16:  # E4M3 dy's dequantised rows are the dact's (exact); BF16 rows as given
        bf16_wgrads_of(dy_grid if isinstance(dy_rows, QuantRows) else dy_rows, act_w, d_h, x_rows,
                       token_rows, grads, counts, offsets, tuning, programs, warp_specialized, carry, rows_per_expert)
        return grads
    # the wgrads: both operands on the grid along each expert's tokens, in its 128-row span (zero-padded)
    blocks = token_blocks(counts, offsets, rows)
    span0 = blocks.block0 * FP8_BLOCK
    carries = (None, None) if carry is None else carry.pairs()
    for (a, b, dw), pair in zip(((dy_rows, act_w, grads.d_w_down), (d_h, x_rows, grads.d_w_gate_up)), carries):
        wgrad(token_rounded(a, blocks), token_rounded(b, blocks), dw, span0, counts, cfg["wgrad"], programs,
              warp_specialized, carry=None if carry is None else (carry.modes, *pair))
    return grads

