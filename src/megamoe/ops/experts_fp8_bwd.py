"""The FP8-block (DeepSeek-V3 recipe) expert backward over schedule-grouped rows: launches and the torch twin.

Per routed row r of local expert l, from the rows the backward pulled (BF16, or E4M3 quantised at home) and
the forward's h:

    dy_q = dy quantised 1x128 along D (as pulled, or here)   (the reduction axis of dact)
    g    = dy_q · (w_down[l]ᵀ)_q                              dact on E4M3, w_downᵀ in 128x128 blocks, FP32
    d_h, act_w, d_router = the BF16 dact epilogue on g         SwiGLU backward in FP32 from the saved h
    d_x  = (d_h 1x128 along 2I)_q · (w_gate_up[l]ᵀ)_q        the forward's down kernel on w_gate_upᵀ
    dW_down[l]    = dyᵀ · act_w, dW_gate_up[l] = d_hᵀ · x      both operands quantised 1x128 along the tokens:
                                                                blocks of each expert's rows, zero-padded

The dgrads read the weights transposed (``weights_t``: the per-step pack's, :mod:`megamoe.ops.expert_weights`;
fp8-block's are the forward pack's 128x128 blocks transposed). Master weights and the gradients returned are
BF16, as on the BF16 path. docs/design.md tabulates every tensor's format and why.

Where ``megamoe.planner.wgrads.bf16_wgrads_pay`` (mxfp8; fp8-block at few rows per expert; or forced by
``MEGAMOE_FP8_BF16_WGRADS``) both weight gradients run as the BF16 backward's instead (that module's recipe): no
operand is quantised along the tokens.

MXFP8 (:func:`expert_backward_mxfp8`) is the same with an E8M0 scale per 32 along each GEMM's reduction axis:
the transposed weights are quantised along their own last dim (D for dact, 2I for dx: not the forward's pack,
whose blocks run along the forward's K), and the tiles dequantise on load (Hopper has no block-scaled MMA).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe import runtime
from megamoe.config import SWIGLU, Activation
from megamoe.kernels import (dact_warp_specialized, expert_gemm_bwd, expert_gemm_fp8_bwd, expert_gemm_mxfp8_bwd,
                             wgrad_fp8_warp_specialized)
from megamoe.ops.experts import check_operands
from megamoe.ops import experts_bwd
from megamoe.ops.experts_bwd import (ROUTER_GRAD_ROWS, ExpertGrads, WgradCarry, check_grads, new_grads,
                                     nothing_to_launch)
from megamoe.ops.experts_fp8 import _promoted_matmul, down_fp8, warp_specialized_fp8
from megamoe.ops.comm import QuantRows
from megamoe.ops.expert_bias import BiasGrads, bias_backward
from megamoe.ops.expert_weights import TransposedWeights, transposed_weights
from megamoe.ops.experts_mxfp8 import down_mxfp8
from megamoe.ops.launch import flat_row_stride, launch_row_tasks, scratch_allocator
from megamoe.planner.tiles import WGRAD_FP8_WS_STAGES, TileConfig, mean_rows
from megamoe.planner.tuning import DEFAULT_TUNING, Tuning
from megamoe.ops.bf16_wgrads import TokenRows, bf16_wgrads_of, twin_wgrad_rows, wants_bf16_wgrads
from megamoe.ops.quant import quantize_activations
from megamoe.routing.row_tiles import build_row_tiles
from megamoe.reference import activation_backward
from megamoe.reference.formats import (FP8_BLOCK, MX_BLOCK, fp8_block_dequantize, fp8_block_quantize, mxfp8_dequantize,
                                      mxfp8_quantize)
from megamoe.runtime import interpreting


def wgrad_fp8_ws_constexprs(programs: int, *, stages: int = WGRAD_FP8_WS_STAGES) -> dict:
    """The Gluon FP8 wgrad's constexprs (shared with the sm_90 build check): by default the planner's ring
    (:data:`~megamoe.planner.tiles.WGRAD_FP8_WS_STAGES`, the deepest that fits beside the two output buffers)."""
    return dict(NUM_PROGRAMS=programs, STAGES=stages)


def wgrad_fp8(a_t, a_s, b_t, b_s, out, blocks: TokenBlocks, counts, tile: TileConfig, programs: int,
              fmt: str = "fp8-block", *, warp_specialized: bool = True, carry=None,
              stages: int | None = None) -> None:
    """out[l] = A[rows of l]ᵀ · B[rows of l] from :func:`quantize_tokens`' operands in ``fmt``: on Hopper for
    fp8-block's 128 x 128 tiles the Gluon kernel (``stages``: its ring depth, default
    :func:`wgrad_fp8_ws_constexprs`'), else (and with ``warp_specialized=False``) the Triton one; the same bits. ``carry``: ``(modes, carry_in,
    carry_out)`` of a backward window (``megamoe.kernels.wgrad_carry``)."""
    experts = out.shape[0]
    window = carry if carry is not None else (counts, out, out)  # never read without CARRY
    tma_scales = a_s.stride(0) % 4 == 0 and b_s.stride(0) % 4 == 0  # 16-byte rows for the Gluon kernel's TMA
    if fmt == "fp8-block" and warp_specialized and tma_scales and warp_specialized_fp8(a_t.device, tile):
        with scratch_allocator():
            wgrad_fp8_warp_specialized.wgrad_fp8_ws_kernel[(programs,)](
                a_t, b_t, a_s, b_s, out, blocks.block0, counts, experts, out.shape[1], out.shape[2], a_t.shape[1],
                a_s.stride(0), b_s.stride(0), *window, CARRY=carry is not None, num_warps=4,
                **wgrad_fp8_ws_constexprs(programs, **({} if stages is None else {"stages": stages})))
        return
    descs = (TensorDescriptor.from_tensor(a_t, [tile.block_m, tile.block_k]),
             TensorDescriptor.from_tensor(b_t, [tile.block_n, tile.block_k]))
    tail = (out, blocks.block0, counts, experts, out.shape[1], out.shape[2])
    consts = dict(DOT_FP32=interpreting(), NUM_PROGRAMS=programs, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                  FLATTEN=tile.flatten, CARRY=carry is not None, num_warps=tile.num_warps,
                  num_stages=tile.num_stages)
    with scratch_allocator():
        if fmt == "mxfp8":
            expert_gemm_mxfp8_bwd.wgrad_mxfp8_kernel[(programs,)](
                *descs, a_s, b_s, *tail, a_t.shape[1], a_s.stride(0), b_s.stride(0), *window, BLOCK_K=tile.block_k,
                **consts)
        else:
            expert_gemm_fp8_bwd.wgrad_fp8_kernel[(programs,)](*descs, a_s, b_s, *tail, a_s.stride(0), b_s.stride(0),
                                                              *window, **consts)


@dataclass(frozen=True)
class TokenBlocks:
    """Each expert's rows laid out from a 128-row block boundary, zero-padded (the wgrads' K axis).

    src: int64 `[R_pad]` the source row of each padded row, -1 for a padding (zero) row; block0: int32 `[L]`
    each expert's first block. R_pad (a multiple of 128) bounds the padded rows for any counts of R rows, so
    nothing is read on the host."""

    src: torch.Tensor
    block0: torch.Tensor


def token_blocks(counts: torch.Tensor, offsets: torch.Tensor, rows: int) -> TokenBlocks:
    experts = counts.shape[0]
    counts64, offsets64 = counts.long(), offsets.long()
    blocks = (counts64 + FP8_BLOCK - 1) // FP8_BLOCK
    ends = blocks.cumsum(0)
    block0 = ends - blocks
    padded = FP8_BLOCK * max(1, -(-(rows + experts * (FP8_BLOCK - 1)) // FP8_BLOCK))
    q = torch.arange(padded, device=counts.device)
    expert = torch.searchsorted(ends, q // FP8_BLOCK, right=True)
    e = expert.clamp(max=max(experts - 1, 0))
    p = q - block0[e] * FP8_BLOCK
    valid = (expert < experts) & (p < counts64[e])
    return TokenBlocks(torch.where(valid, offsets64[e] + p, -1), block0.to(torch.int32))


def quantize_tokens(a: torch.Tensor | QuantRows, blocks: TokenBlocks, fmt: str = "fp8-block") -> tuple[
        torch.Tensor, torch.Tensor]:
    """``a [R, C]`` quantised along the tokens of each expert (1x128, or mxfp8's 1x32, blocks of the expert's
    128-row spans; the rows gathered in the quantiser's read): E4M3 ``[C, R_pad]`` (K-major for the wgrad)
    and its scales, fp8-block's ``[R_pad / 128, C]`` (a K step's scales contiguous), mxfp8's
    ``[C, R_pad / 32]`` (the layout of the dequantising tiles it shares with the forward). E4M3 rows
    (:class:`QuantRows`, quantised along C) are dequantised on load and quantised again."""
    data, scale = (a.data, a.scale) if isinstance(a, QuantRows) else (a, None)
    return quantize_activations(data, fmt, axis=0, transpose=True, rows=blocks.src, scale_transpose=fmt == "mxfp8",
                                x_scale=scale)


def _rows_of(rows: torch.Tensor | QuantRows, fmt: str, name: str) -> torch.Tensor:
    """The rows' tensor for the shape checks (BF16, or E4M3 in ``fmt`` with its scales along the rows)."""
    if not isinstance(rows, QuantRows):
        return rows
    if rows.format != fmt:
        raise ValueError(f"{name} are {rows.format} rows; this backward runs {fmt}")
    return rows.data


def expert_backward_fp8_block(dy_rows, row_weights, x_rows, h, counts, offsets, w_gate_up, w_down, *,
                              activation: Activation = SWIGLU, weights_t: TransposedWeights | None = None,
                              num_programs: int | None = None,
                              tuning: Tuning | None = None,
                              warp_specialized: bool = True, carry: WgradCarry | None = None,
                              out: ExpertGrads | None = None, bias: BiasGrads | None = None,
                              bf16_wgrads: bool | None = None, token_rows: TokenRows | None = None) -> ExpertGrads:
    """:func:`megamoe.ops.experts_bwd.expert_backward` in FP8-block (module docstring): the same arguments (BF16 rows,
    h, master weights), ``weights_t`` the dgrads' transposed E4M3 weights (made here when None). ``dy_rows``
    and ``x_rows`` may instead be E4M3 rows quantised along D (:class:`~megamoe.ops.comm.QuantRows` in this
    format: the pulled upstream gradient, the forward ring's x): dact reads dy's as they are, the wgrads
    dequantise both and quantise them again along the tokens. D and I must be multiples of 128. On Hopper the
    dact's, dx's and wgrads' 128 x 128 tiles run in warp-specialised Gluon kernels (`megamoe.kernels.
    dact_warp_specialized`, `forward_fp8_warp_specialized`, `wgrad_fp8_warp_specialized`), the same bits as the
    Triton ones, which ``warp_specialized=False`` runs there too (A/B runs, tests). ``carry``, ``out`` (its
    ``d_x_index`` too) and ``bias`` as :func:`~megamoe.ops.experts_bwd.expert_backward`'s (a backward window's rows
    start each expert's token blocks where the whole rows do: cuts at multiples of 128 rows of an expert).
    ``bf16_wgrads``: the weight gradients as BF16 wgrads (None: ``planner.wgrads.bf16_wgrads_pay`` at the rows' mean per
    expert), of ``token_rows``' BF16 tokens where given (one rank), else of dy_rows and x_rows (E4M3 rows dequantised
    to BF16 first)."""
    return _expert_backward_fp8("fp8-block", dy_rows, row_weights, x_rows, h, counts, offsets, w_gate_up, w_down,
                                activation, weights_t, num_programs, tuning, warp_specialized, carry, out, bias,
                                bf16_wgrads=wants_bf16_wgrads(bf16_wgrads, token_rows, "fp8-block",
                                                              _rows_per_expert(x_rows, w_gate_up)),
                                token_rows=token_rows)


def _rows_per_expert(x_rows, w_gate_up) -> float:
    """The call's mean rows per expert (E4M3 rows or BF16), for :func:`~megamoe.planner.wgrads.bf16_wgrads_pay`."""
    return mean_rows((x_rows.data if isinstance(x_rows, QuantRows) else x_rows).shape[0], w_gate_up.shape[0])


def expert_backward_mxfp8(dy_rows, row_weights, x_rows, h, counts, offsets, w_gate_up, w_down, *,
                          activation: Activation = SWIGLU, weights_t: TransposedWeights | None = None,
                          num_programs: int | None = None,
                          tuning: Tuning | None = None, carry: WgradCarry | None = None,
                          out: ExpertGrads | None = None, bias: BiasGrads | None = None,
                          bf16_wgrads: bool | None = None, token_rows: TokenRows | None = None) -> ExpertGrads:
    """:func:`expert_backward_fp8_block` in MXFP8 (module docstring); ``weights_t`` from
    ``transposed_weights(..., "mxfp8")``. D and I must be multiples of 32."""
    return _expert_backward_fp8("mxfp8", dy_rows, row_weights, x_rows, h, counts, offsets, w_gate_up, w_down,
                                activation, weights_t, num_programs, tuning, False, carry, out, bias,
                                bf16_wgrads=wants_bf16_wgrads(bf16_wgrads, token_rows, "mxfp8",
                                                              _rows_per_expert(x_rows, w_gate_up)),
                                token_rows=token_rows)


def _expert_backward_fp8(fmt, dy_rows, row_weights, x_rows, h, counts, offsets, w_gate_up, w_down, activation,
                         weights_t, num_programs, tuning: Tuning | None, warp_specialized: bool = False,
                         carry: WgradCarry | None = None, out: ExpertGrads | None = None,
                         bias: BiasGrads | None = None, bf16_wgrads: bool = False,
                         token_rows: TokenRows | None = None) -> ExpertGrads:
    """Both formats' launches: they differ in the dact and wgrad kernels, the dx kernel (the forward's down in
    that format) and mxfp8's flattened weight scales. ``tuning``: its dact, dx and wgrad pin
    a kind's tiles (the planner's otherwise; dx runs the forward's down)."""
    x_data, dy_data = _rows_of(x_rows, fmt, "x_rows"), _rows_of(dy_rows, fmt, "dy_rows")
    # E4M3 rows: the checks of BF16 rows of their shape (a broadcast scalar: no memory)
    like_x = x_rows if x_data is x_rows else torch.zeros((), dtype=torch.bfloat16, device=x_data.device).expand(
        x_data.shape)
    experts, i, d = check_operands(like_x, counts, offsets, w_gate_up, w_down)
    if tuple(dy_data.shape) != tuple(x_data.shape):
        raise ValueError(f"dy_rows {tuple(dy_data.shape)} and x_rows {tuple(x_data.shape)} must have one shape")
    block = FP8_BLOCK if fmt == "fp8-block" else MX_BLOCK
    if d % block or i % block:
        raise ValueError(f"{fmt} needs D and I multiples of {block}, got D={d}, I={i}")
    mx = fmt == "mxfp8"
    rows, device = x_data.shape[0], x_data.device
    grads = out or new_grads(rows, w_gate_up, w_down)
    if grads.d_x_index is not None and fmt != "fp8-block":
        raise ValueError(f"out.d_x_index (d_x rows stored into slots): the {fmt} tiles' d_x writes rows in order")
    check_grads(grads, rows, w_gate_up, w_down, carry)
    if nothing_to_launch(grads, experts, rows):
        return grads
    wt = weights_t or transposed_weights(w_gate_up, w_down, fmt)
    programs = runtime.num_programs(device, num_programs)
    counts, offsets = counts.to(torch.int32), offsets.to(torch.int32)
    dy_q, dy_s = (dy_rows.data, dy_rows.scale) if isinstance(dy_rows, QuantRows) else quantize_activations(dy_rows,
                                                                                                          fmt)
    d_h = torch.empty(rows, 2 * i, dtype=torch.bfloat16, device=device)
    act_w = torch.empty(rows, i, dtype=torch.bfloat16, device=device)
    tuning = tuning or DEFAULT_TUNING
    c = tuning.tile("dact", device, fmt=fmt)
    num_n = -(-i // c.block_n)
    partial = torch.zeros(rows, num_n, dtype=torch.float32, device=device)
    # mxfp8's scales are per weight row ([L*I, D/32]); fp8-block's per 128x128 block ([L, I/128, D/128])
    w_dn_t_scale = wt.w_down_t_scale.view(experts * i, d // MX_BLOCK) if mx else wt.w_down_t_scale
    if not mx and warp_specialized and warp_specialized_fp8(device, c):
        tile_map = build_row_tiles(counts, offsets, rows, 128)
        with scratch_allocator():
            dact_warp_specialized.dact_fp8_ws_kernel[(programs,)](
                dy_q, wt.w_down_t.view(experts * i, d), dy_s, w_dn_t_scale, h, row_weights, d_h, act_w, partial,
                dy_q.stride(0), dy_s.stride(0), flat_row_stride(w_dn_t_scale), h.stride(0), d_h.stride(0),
                act_w.stride(0), partial.stride(0), tile_map.tile_expert, tile_map.tile_row0, tile_map.tile_row_end,
                tile_map.tile_run, tile_map.num_tiles, rows, experts * i, d, i, activation.kernel_limit,
                activation.kernel_alpha, num_warps=4,
                **experts_bwd.dact_ws_constexprs(c, programs, act=activation.kernel_id))
    else:
        launch_row_tasks(
            expert_gemm_mxfp8_bwd.dact_mxfp8_kernel if mx else expert_gemm_fp8_bwd.dact_fp8_kernel, c, programs,
            counts, offsets, rows,
            head=(TensorDescriptor.from_tensor(dy_q, [c.block_m, c.block_k]),
                  TensorDescriptor.from_tensor(wt.w_down_t.view(experts * i, d), [c.block_n, c.block_k]),
                  dy_s, w_dn_t_scale, h, row_weights, d_h, act_w, partial, dy_s.stride(0),
                  flat_row_stride(w_dn_t_scale), h.stride(0), d_h.stride(0), act_w.stride(0), partial.stride(0)),
            tail=(d, i, *((experts * i,) if mx else ()), activation.kernel_limit, activation.kernel_alpha),
            ACT=activation.kernel_id,
        )
    expert_gemm_bwd.router_grad_kernel[(-(-rows // ROUTER_GRAD_ROWS),)](
        partial, partial.stride(0), grads.d_router, rows, num_n, BLOCK_M=ROUTER_GRAD_ROWS)
    if bias is not None:  # from the rows as pulled (E4M3: dequantised, the d_out the dgrads read)
        bias_backward(bias, d_h, _dequantized(dy_rows), row_weights, counts, offsets, grads.d_router)
    d_h_q, d_h_s = quantize_activations(d_h, fmt)
    (down_mxfp8 if mx else down_fp8)(d_h_q, d_h_s, counts, offsets, wt.w_gate_up_t, wt.w_gate_up_t_scale,
                                     grads.d_x, num_programs=programs, tuning=dataclasses.replace(tuning, down=tuning.dx),
                                     **({} if mx else {"warp_specialized": warp_specialized,
                                                       "y_index": grads.d_x_index}))
    carries = (None, None) if carry is None else carry.pairs()
    if bf16_wgrads:
        bf16_wgrads_of(dy_rows, act_w, d_h, x_rows, token_rows, grads, counts, offsets, tuning,
                       programs, warp_specialized, carry)
        return grads
    blocks = token_blocks(counts, offsets, rows)
    c = tuning.tile("wgrad", device, fmt=fmt)
    for (a, b, dw), pair in zip(((dy_rows, act_w, grads.d_w_down), (d_h, x_rows, grads.d_w_gate_up)), carries):
        a_t, a_s = quantize_tokens(a, blocks, fmt)
        b_t, b_s = quantize_tokens(b, blocks, fmt)
        wgrad_fp8(a_t, a_s, b_t, b_s, dw, blocks, counts, c, programs, fmt,
                  warp_specialized=warp_specialized and not mx, carry=None if carry is None else (carry.modes, *pair))
    return grads


def expert_backward_mxfp8_reference(
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
    bf16_wgrads: bool | None = None,
    token_rows: TokenRows | None = None,
) -> ExpertGrads:
    """The torch twin of :func:`expert_backward_mxfp8`: ``formats.mxfp8_quantize`` along each GEMM's reduction
    axis, operands dequantised exactly, fp32 matmuls; d_h and act_w rounded to bf16 where the kernels store
    them. FP32 results; rows outside regions NaN. E4M3 rows (QuantRows) enter dequantised (idempotent: MX
    quantisation gives them back). ``bf16_wgrads`` / ``token_rows``: as
    :func:`expert_backward_fp8_block_reference`'s."""

    def mx(t, dim=-1):
        return mxfp8_dequantize(*mxfp8_quantize(t, dim), dim)

    bf16_wgrads = wants_bf16_wgrads(bf16_wgrads, token_rows, "mxfp8", _rows_per_expert(x_rows, w_gate_up))
    wgrad_dy, wgrad_x = twin_wgrad_rows(dy_rows, x_rows, token_rows) if bf16_wgrads else (None, None)
    dy_rows, x_rows = _dequantized(dy_rows), _dequantized(x_rows)
    rows, d = x_rows.shape
    f32 = dict(dtype=torch.float32, device=x_rows.device)
    grads = ExpertGrads(torch.full((rows, d), float("nan"), **f32), torch.full((rows,), float("nan"), **f32),
                        torch.zeros(w_gate_up.shape, **f32), torch.zeros(w_down.shape, **f32))
    for l, (start, count) in enumerate(zip(offsets.tolist(), counts.tolist())):
        if count == 0:
            continue
        sl = slice(start, start + count)
        g = mx(dy_rows[sl]) @ mx(w_down[l].T).T
        d_h, act, d_router = activation_backward(g, h[sl].float(), row_weights[sl], activation)
        d_h = d_h.to(torch.bfloat16)
        act_w = (act * row_weights[sl, None]).to(torch.bfloat16)
        grads.d_router[sl] = d_router
        grads.d_x[sl] = mx(d_h) @ mx(w_gate_up[l].T).T
        if bf16_wgrads:
            grads.d_w_down[l] = wgrad_dy[sl].float().T @ act_w.float()
            grads.d_w_gate_up[l] = d_h.float().T @ wgrad_x[sl].float()
            continue
        pad = -(-count // 128) * 128 - count
        padded = [torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (dy_rows[sl], act_w, d_h, x_rows[sl])]
        grads.d_w_down[l] = mx(padded[0], 0).T @ mx(padded[1], 0)
        grads.d_w_gate_up[l] = mx(padded[2], 0).T @ mx(padded[3], 0)
    return grads


def expert_backward_fp8_block_reference(
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
    bf16_wgrads: bool | None = None,
    token_rows: TokenRows | None = None,
) -> ExpertGrads:
    """The torch twin of :func:`expert_backward_fp8_block`: the same quantisations (``formats``), the products in
    the kernels' promotion order (``_promoted_matmul``), d_h and act_w rounded to bf16 where the kernels store
    them. FP32 results; rows outside regions NaN. E4M3 rows (QuantRows) enter as they are for dact and
    dequantised for the wgrads, as the kernels take them. ``bf16_wgrads`` / ``token_rows`` as the kernels': the
    weight gradients FP32 products of the BF16 rows (``token_rows``' tokens, or the rows as :func:`bf16_rows`)."""
    dy_pulled = dy_rows if isinstance(dy_rows, QuantRows) else None
    bf16_wgrads = wants_bf16_wgrads(bf16_wgrads, token_rows, "fp8-block", _rows_per_expert(x_rows, w_gate_up))
    wgrad_dy, wgrad_x = twin_wgrad_rows(dy_rows, x_rows, token_rows) if bf16_wgrads else (None, None)
    dy_rows, x_rows = _dequantized(dy_rows), _dequantized(x_rows)
    rows, d = x_rows.shape
    f32 = dict(dtype=torch.float32, device=x_rows.device)
    grads = ExpertGrads(torch.full((rows, d), float("nan"), **f32), torch.full((rows,), float("nan"), **f32),
                        torch.zeros(w_gate_up.shape, **f32), torch.zeros(w_down.shape, **f32))
    for l, (start, count) in enumerate(zip(offsets.tolist(), counts.tolist())):
        if count == 0:
            continue
        sl = slice(start, start + count)
        dy_q, dy_s = (dy_pulled.data[sl], dy_pulled.scale[sl]) if dy_pulled else fp8_block_quantize(dy_rows[sl])
        g = _promoted_matmul(dy_q, dy_s, *fp8_block_quantize(w_down[l].T, (FP8_BLOCK, FP8_BLOCK)))
        d_h, act, d_router = activation_backward(g, h[sl].float(), row_weights[sl], activation)
        d_h = d_h.to(torch.bfloat16)
        act_w = (act * row_weights[sl, None]).to(torch.bfloat16)
        grads.d_router[sl] = d_router
        d_h_q, d_h_s = fp8_block_quantize(d_h)
        grads.d_x[sl] = _promoted_matmul(d_h_q, d_h_s, *fp8_block_quantize(w_gate_up[l].T, (FP8_BLOCK, FP8_BLOCK)))
        if bf16_wgrads:
            grads.d_w_down[l] = wgrad_dy[sl].float().T @ act_w.float()
            grads.d_w_gate_up[l] = d_h.float().T @ wgrad_x[sl].float()
        else:
            grads.d_w_down[l] = _token_wgrad(dy_rows[sl], act_w)
            grads.d_w_gate_up[l] = _token_wgrad(d_h, x_rows[sl])
    return grads


def _dequantized(rows: torch.Tensor | QuantRows) -> torch.Tensor:
    """E4M3 rows (QuantRows) dequantised to FP32 as the quantiser's read does; other rows as they are."""
    if not isinstance(rows, QuantRows):
        return rows
    if rows.format == "mxfp8":
        return mxfp8_dequantize(rows.data, rows.scale)
    return fp8_block_dequantize(rows.data, rows.scale)


def _token_wgrad(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``aᵀ · b`` over one expert's rows, both quantised 1x128 along the rows (zero-padded to a block), summed
    per block with its scales (the wgrad kernel's promotion order)."""
    n = a.shape[0]
    pad = -(-n // FP8_BLOCK) * FP8_BLOCK - n
    a_q, a_s = fp8_block_quantize(torch.nn.functional.pad(a, (0, 0, 0, pad)), (FP8_BLOCK, 1))
    b_q, b_s = fp8_block_quantize(torch.nn.functional.pad(b, (0, 0, 0, pad)), (FP8_BLOCK, 1))
    acc = torch.zeros(a.shape[1], b.shape[1], dtype=torch.float32, device=a.device)
    for kb in range(a_q.shape[0] // FP8_BLOCK):
        ks = slice(kb * FP8_BLOCK, (kb + 1) * FP8_BLOCK)
        acc = acc + (a_q[ks].float().T @ b_q[ks].float()) * (a_s[kb][:, None] * b_s[kb][None, :])
    return acc
