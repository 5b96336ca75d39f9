"""The FP8 backwards' weight gradients as BF16 wgrads of BF16 rows (torchao's "rowwise, high-precision grad weight"
recipe); where they pay: :func:`megamoe.planner.wgrads.bf16_wgrads_pay`.

The FP8 backwards (:mod:`megamoe.ops.experts_fp8_bwd`'s fp8-block and MXFP8 tiles, MXFP8 as the BF16 kernels in
:mod:`megamoe.ops.experts_mxfp8_bf16`) quantise (or round) four operands along each expert's tokens for their
wgrads. Where ``bf16_wgrads_pay`` (mxfp8; fp8-block at few rows per expert; ``MEGAMOE_FP8_BF16_WGRADS`` forces
either way) they run the BF16 backward's wgrads instead (:func:`bf16_wgrads_of`): dy and x as
pulled, dequantised to BF16 once (:func:`bf16_rows`), or one rank's staged BF16 tokens read by index
(:class:`TokenRows`); act_w and d_h as the dact stores them. Nothing is quantised along the tokens, and the gradients
are BF16 products of the rows: closer to the FP32 product, not the FP8 wgrads' bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe import checks
from megamoe.ops import experts_bwd
from megamoe.ops.comm import QuantRows
from megamoe.ops.experts_bwd import ExpertGrads, WgradCarry
from megamoe.ops.quant import mx_round_activations
from megamoe.planner.tiles import mean_rows
from megamoe.planner.tuning import Tuning
from megamoe.planner.wgrads import bf16_wgrads_pay
from megamoe.reference.formats import fp8_block_dequantize

@dataclass(frozen=True)
class TokenRows:
    """One rank's BF16 tokens for the BF16 wgrads: ``d_out`` and ``x`` `[S, D]`, routed row r of the backward reading
    token ``index[r]`` (int32 `[>= R]`): the staged upstream gradient and input, read in place of the E4M3 rows (on
    Hopper gathered on load)."""

    d_out: torch.Tensor
    x: torch.Tensor
    index: torch.Tensor


def wants_bf16_wgrads(bf16_wgrads: bool | None, token_rows: TokenRows | None, fmt: str,
                      rows_per_expert: float) -> bool:
    """An FP8 backward's ``bf16_wgrads`` argument resolved (None: :func:`bf16_wgrads_pay` at its ``fmt`` and mean
    rows per expert); ``token_rows`` without them refused."""
    bf16 = bf16_wgrads_pay(fmt, rows_per_expert) if bf16_wgrads is None else bf16_wgrads
    if token_rows is not None and not bf16:
        raise ValueError("token_rows are the BF16 wgrads' rows: pass bf16_wgrads=True "
                         "(or set MEGAMOE_FP8_BF16_WGRADS=1)")
    return bf16


def bf16_rows(rows: torch.Tensor | QuantRows) -> torch.Tensor:
    """The rows as BF16: E4M3 rows (QuantRows) dequantised (``formats``' dequantise; mxfp8's exactly, by one
    ``mx_round_activations`` launch) and rounded to BF16 once; BF16 rows as they are."""
    if not isinstance(rows, QuantRows):
        return rows
    if rows.format == "mxfp8":
        return mx_round_activations(rows.data, x_scale=rows.scale)
    return fp8_block_dequantize(rows.data, rows.scale).to(torch.bfloat16)


def bf16_wgrads_of(dy: torch.Tensor | QuantRows, act_w: torch.Tensor, d_h: torch.Tensor, x: torch.Tensor | QuantRows,
                   token_rows: TokenRows | None, grads: ExpertGrads, counts, offsets, tuning: Tuning, programs: int,
                   warp_specialized: bool, carry: WgradCarry | None, rows_per_expert: float | None = None) -> None:
    """Both weight gradients as the BF16 backward's wgrads (``experts_bwd.wgrads``) of BF16 rows: ``token_rows``' d_out
    and x read by token where given, else ``dy`` and ``x`` (`[R, D]`, the rows in order; E4M3 rows dequantised by
    :func:`bf16_rows` here, only then); act_w and d_h as the dact stored them. int32 counts and offsets;
    ``rows_per_expert`` for the tile plan (default: the rows' mean)."""
    rows, device = d_h.shape[0], d_h.device
    tile = tuning.tile("wgrad", device, mean_rows(rows, counts.shape[0], rows_per_expert))
    index = None
    if token_rows is not None:
        checks.check_row_index("token_rows.index", token_rows.index, rows, device)
        dy, x, index = token_rows.d_out, token_rows.x, token_rows.index
    else:
        dy, x = bf16_rows(dy), bf16_rows(x)
    experts_bwd.wgrads(dy, act_w, d_h, x, grads, offsets, counts, tile, programs, warp_specialized, carry, index,
                       index)


def twin_wgrad_rows(dy_rows, x_rows, token_rows: TokenRows | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twins' BF16 wgrad rows, dy and x in routed order, as the kernels read them: ``token_rows``' tokens,
    or the rows as :func:`bf16_rows` gives them."""
    if token_rows is None:
        return bf16_rows(dy_rows), bf16_rows(x_rows)
    routed = (x_rows.data if isinstance(x_rows, QuantRows) else x_rows).shape[0]
    tokens = token_rows.index[:routed].long().clamp(min=0)
    return token_rows.d_out[tokens], token_rows.x[tokens]
