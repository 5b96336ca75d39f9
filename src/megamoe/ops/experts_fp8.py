"""FP8-block (DeepSeek-V3 recipe) expert forward over schedule-grouped rows: launches and the torch twin.

:func:`expert_forward_fp8_block` takes routed rows quantised 1x128 along D and
expert weights quantised in 128x128 blocks (``megamoe.ops.quant``'s
``quantize_activations(x, "fp8-block")`` / ``quantize_weights(w, "fp8-block")``)
and runs gate/up + SwiGLU (act quantised 1x128 along I in the epilogue) and
down with the persistent FP8 kernels of `megamoe.kernels.expert_gemm_fp8` (on Hopper, 128-row tiles: their
warp-specialised Gluon twin, `megamoe.kernels.forward_fp8_warp_specialized`, the same bits).
Row tiles and the launch come from `megamoe.ops.launch`, the grid size from `megamoe.runtime`.
:func:`expert_forward_fp8_block_reference` is the plain-PyTorch twin.
"""

from __future__ import annotations


import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe import checks
from megamoe import runtime
from megamoe.config import SWIGLU, Activation
from megamoe.ops import experts as expert_ops  # its switches, read at each call (tests set them)
from megamoe.ops.experts import ExpertForwardQuantized, warp_specialized_forward
from megamoe.ops.launch import flat_row_stride, launch_row_tasks, scratch_allocator
from megamoe.planner.tiles import TileConfig, mean_rows
from megamoe.planner.tuning import DEFAULT_TUNING, Tuning
from megamoe.reference.formats import FP8_BLOCK, fp8_block_quantize
from megamoe.kernels import expert_gemm_fp8, forward_fp8_warp_specialized, gluon_ring
from megamoe.routing.row_tiles import build_row_tiles
from megamoe.ops.quant import soft_e4m3_default
from megamoe.reference import activate

FP8 = torch.float8_e4m3fn


def _check_tiles(kind: str, cfg: TileConfig) -> None:
    if cfg.block_k != FP8_BLOCK:
        raise ValueError(f"{kind}: fp8-block tiles need block_k = {FP8_BLOCK}, got {cfg.block_k}")
    if kind == "gate_up" and cfg.block_n != FP8_BLOCK:
        raise ValueError(f"gate_up: fp8-block tiles need block_n = {FP8_BLOCK}, got {cfg.block_n}")
    if kind == "down" and cfg.block_n % FP8_BLOCK and FP8_BLOCK % cfg.block_n:
        raise ValueError(f"down: block_n must divide or be a multiple of {FP8_BLOCK}, got {cfg.block_n}")


def expert_forward_fp8_block(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    w_gate_up_q: torch.Tensor,
    w_gate_up_scale: torch.Tensor,
    w_down_q: torch.Tensor,
    w_down_scale: torch.Tensor,
    *,
    activation: Activation = SWIGLU,
    num_programs: int | None = None,
    tuning: Tuning | None = None,
    store_h: bool = True,
    out: ExpertForwardQuantized | None = None,
    rows_per_expert: float | None = None,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> ExpertForwardQuantized:
    """FP8-block gate/up + SwiGLU (+ act quantisation) and down for every expert region.

    Args:
        x_q: E4M3 `[R, D]` routed rows grouped by local expert; x_scale: fp32 `[R, D/128]` (1x128 along D).
        counts: int `[L]` rows of each expert; offsets: int `[L]` region starts.
        w_gate_up_q: E4M3 `[L, 2I, D]`, w_gate_up_scale fp32 `[L, 2I/128, D/128]` (128x128 blocks).
        w_down_q: E4M3 `[L, D, I]`, w_down_scale fp32 `[L, D/128, I/128]`. D, I multiples of 128.
        activation: clamp of SwiGLU (gate <= limit, |up| <= limit), as in `megamoe.reference.swiglu`.
        num_programs: persistent grid size (default: the SM count).
        tuning: pins the gate/up and down tiles (:class:`~megamoe.planner.tuning.Tuning`); block_k must be 128,
            gate/up block_n 128.
        store_h: also write h (bf16 pre-activation, for the backward); False leaves ``h`` None.
        out: preallocated outputs to fill (rows outside regions are left alone).
        rows_per_expert: the load's mean rows per expert, for the tile plan (default: the rows over the
            experts; a caller whose rows are a worst-case capacity gives the expected mean). The tiles do
            not change the bits.
        b_gate_up: bf16 `[L, 2I]`, b_down: bf16 `[L, D]`: optional expert biases, added in FP32 to gate/up before
            the activation (h includes it) and to y.
    """
    checks.check_expert_biases(b_gate_up, b_down, w_gate_up_q, w_down_q, kernels=True)
    experts, i, d = checks.check_quantized_experts("fp8-block", x_q, x_scale, counts, offsets, w_gate_up_q,
                                                   w_gate_up_scale, w_down_q, w_down_scale)
    out = ExpertForwardQuantized.given_or_empty(out, x_q.shape[0], i, d, FP8_BLOCK, torch.float32, x_q.device, store_h)
    gate_up_fp8(x_q, x_scale, counts, offsets, w_gate_up_q, w_gate_up_scale, out, activation=activation,
                num_programs=num_programs, tuning=tuning, store_h=store_h,
                rows_per_expert=rows_per_expert, bias=b_gate_up)
    down_fp8(out.act_q, out.act_scale, counts, offsets, w_down_q, w_down_scale, out.y,
             num_programs=num_programs, tuning=tuning, rows_per_expert=rows_per_expert, bias=b_down)
    return out


def gate_up_fp8(x_q, x_scale, counts, offsets, w_gate_up_q, w_gate_up_scale, out: ExpertForwardQuantized, *,
                activation: Activation = SWIGLU, num_programs=None, tuning: Tuning | None = None,
                store_h: bool = True,
                rows_per_expert: float | None = None, warp_specialized: bool = True,
                bias: torch.Tensor | None = None) -> None:
    """out.act_q / out.act_scale (and out.h with store_h) of every expert region, gate/up plus the optional ``bias``
    bf16 `[L, 2I]` before the activation: one persistent launch; the
    tiles are ``tuning``'s or planned for ``rows_per_expert`` (default: rows / experts). On Hopper 128 x 128 tiles run
    in the warp-specialised Gluon kernel (:func:`forward_fp8_ws`), elsewhere ``gate_up_fp8_kernel``: the same bits;
    ``warp_specialized=False`` runs ``gate_up_fp8_kernel`` there too (A/B runs, tests)."""
    experts, two_i, d = w_gate_up_q.shape
    i = two_i // 2
    rows = x_q.shape[0]
    c = (tuning or DEFAULT_TUNING).tile("gate_up", x_q.device, mean_rows(rows, experts, rows_per_expert), fmt="fp8-block")
    _check_tiles("gate_up", c)
    if rows == 0 or experts == 0:
        return
    h = out.h if store_h else out.act_scale  # any pointer: never touched without STORE_H
    programs = runtime.num_programs(x_q.device, num_programs)
    if warp_specialized and warp_specialized_fp8(x_q.device, c):
        forward_fp8_ws(x_q, x_scale, counts, offsets, w_gate_up_q, w_gate_up_scale, h, c, programs, act_q=out.act_q,
                       act_scale=out.act_scale, activation=activation, store_h=store_h, bias=bias)
        return
    launch_row_tasks(
        expert_gemm_fp8.gate_up_fp8_kernel, c, programs,
        counts.to(torch.int32), offsets.to(torch.int32), rows,
        head=(TensorDescriptor.from_tensor(x_q, [c.block_m, FP8_BLOCK]),
              TensorDescriptor.from_tensor(w_gate_up_q.view(experts * 2 * i, d), [c.block_n, FP8_BLOCK]),
              x_scale, w_gate_up_scale, h, out.act_q.view(torch.uint8), out.act_scale,
              x_scale.stride(0), flat_row_stride(w_gate_up_scale), h.stride(0), out.act_q.stride(0),
              out.act_scale.stride(0)),
        tail=(i, d, activation.kernel_limit, activation.kernel_alpha),
        ACT=activation.kernel_id, STORE_H=store_h, SOFT_E4M3=soft_e4m3_default(), b_ptr=bias,
    )


def down_fp8(act_q, act_scale, counts, offsets, w_down_q, w_down_scale, y, *, num_programs=None,
             tuning: Tuning | None = None, rows_per_expert: float | None = None,
             warp_specialized: bool = True, bias: torch.Tensor | None = None,
             y_index: torch.Tensor | None = None) -> None:
    """y = dequant(act_q) · dequant(w_down_q)ᵀ (+ the optional ``bias`` bf16 `[L, D]`) on every expert region: one
    persistent launch; the tiles are
    ``tuning``'s or planned for ``rows_per_expert`` (default: rows / experts). On Hopper 128 x 128 tiles run in the
    warp-specialised Gluon kernel, elsewhere (and with ``warp_specialized=False``) ``down_fp8_kernel``: the same
    bits. ``y_index`` (int32 `[>= rows]`): row r lands in ``y[y_index[r]]`` instead (< 0: not stored; the caller
    checks it: the FP8 backward's dx into its rows' slots)."""
    experts, d, i = w_down_q.shape
    rows = act_q.shape[0]
    c = (tuning or DEFAULT_TUNING).tile("down", act_q.device, mean_rows(rows, experts, rows_per_expert), fmt="fp8-block")
    _check_tiles("down", c)
    if rows == 0 or experts == 0:
        return
    programs = runtime.num_programs(act_q.device, num_programs)
    if warp_specialized and warp_specialized_fp8(act_q.device, c):
        forward_fp8_ws(act_q, act_scale, counts, offsets, w_down_q, w_down_scale, y, c, programs, bias=bias,
                       out_index=y_index)
        return
    launch_row_tasks(
        expert_gemm_fp8.down_fp8_kernel, c, programs,
        counts.to(torch.int32), offsets.to(torch.int32), rows,
        head=(TensorDescriptor.from_tensor(act_q, [c.block_m, FP8_BLOCK]),
              TensorDescriptor.from_tensor(w_down_q.view(experts * d, i), [c.block_n, FP8_BLOCK]),
              act_scale, w_down_scale, y, act_scale.stride(0), flat_row_stride(w_down_scale), y.stride(0)),
        tail=(d, i), b_ptr=bias, y_index_ptr=y_index,
    )


def warp_specialized_fp8(device: torch.device, tile: TileConfig) -> bool:
    """True when :func:`gate_up_fp8` / :func:`down_fp8` run the warp-specialised Gluon kernel: Hopper, 128 x 128
    tiles (two 64-row consumer warpgroups, one scale block of columns)."""
    return warp_specialized_forward(device, tile) and tile.block_n == FP8_BLOCK


def forward_fp8_ws_constexprs(tile: TileConfig, programs: int, *, gate_up: bool, act: int = 0,
                              store_h: bool = True) -> dict:
    """The Gluon kernel's constexprs at ``tile`` (shared with the sm_90 build check, so it compiles what runs): the
    plan's ring depth (gate/up 3, down 4: the fastest measured; at least ``gluon_ring.MIN_STAGES``: down holds two
    steps' slots at once) and task order; ``SKIP_EMPTY_HALF``, the switch's (``megamoe.ops.experts``)."""
    return dict(GATE_UP=gate_up, ACT=act, STORE_H=store_h, SOFT_E4M3=soft_e4m3_default(),
                NUM_PROGRAMS=programs, GROUP_M=tile.group_m, STAGES=max(gluon_ring.MIN_STAGES, tile.num_stages),
                SKIP_EMPTY_HALF=expert_ops.SKIP_EMPTY_HALF)


def forward_fp8_ws(a_q, a_scale, counts, offsets, w_q, w_scale, out, tile: TileConfig, programs: int, *,
                   act_q=None, act_scale=None, activation: Activation = SWIGLU, store_h: bool = True,
                   bias: torch.Tensor | None = None, out_index: torch.Tensor | None = None) -> None:
    """An FP8-block forward expert GEMM in the warp-specialised Gluon kernel (Hopper; 128 x 128 tiles of ``tile``'s
    GROUP_M and ring depth): gate/up + SwiGLU + act quantisation when ``act_q`` is given (w `[L, 2I, D]`, out h
    `[R, 2I]`, written with ``store_h``), else down (w `[L, D, I]`, out y `[R, D]`); ``bias`` the optional bf16 expert
    bias (`[L, 2I]` / `[L, D]`); ``out_index`` (down): row r stored at out row ``out_index[r]``. The Triton kernels'
    tasks and bits."""
    gate_up = act_q is not None
    if gate_up and out_index is not None:
        raise ValueError("out_index places down's rows (y); gate/up writes h and act in row order")
    experts, w_n, k = w_q.shape
    rows = a_q.shape[0]
    # the kernel's descriptors and scale loads take rows of unit column stride and the weights as [L * N, K]
    for name, t in (("a_q", a_q), ("a_scale", a_scale), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit column stride, got strides {t.stride()}")
    w_q = w_q.view(experts * w_n, k)  # raises where the weights are not one [L * N, K] block
    tiles = build_row_tiles(counts.to(torch.int32), offsets.to(torch.int32), rows, 128)
    act_q, act_scale = (act_q.view(torch.uint8), act_scale) if gate_up else (out, out)  # down: never touched
    with scratch_allocator():
        forward_fp8_warp_specialized.forward_fp8_ws_kernel[(programs,)](
            a_q, w_q, a_scale, w_scale, out, act_q, act_scale, out if bias is None else bias,
            out if out_index is None else out_index, a_q.stride(0), a_scale.stride(0), flat_row_stride(w_scale),
            out.stride(0), act_q.stride(0), act_scale.stride(0), tiles.tile_expert, tiles.tile_row0,
            tiles.tile_row_end, tiles.tile_run, tiles.num_tiles, rows, experts * w_n, w_n // 2 if gate_up else w_n, k,
            activation.kernel_limit, activation.kernel_alpha, num_warps=4, HAS_BIAS=bias is not None,
            SCATTER=out_index is not None, **forward_fp8_ws_constexprs(tile, programs, gate_up=gate_up,
                                                                       act=activation.kernel_id, store_h=store_h))


def expert_forward_fp8_block_reference(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    w_gate_up_q: torch.Tensor,
    w_gate_up_scale: torch.Tensor,
    w_down_q: torch.Tensor,
    w_down_scale: torch.Tensor,
    *,
    activation: Activation = SWIGLU,
    experts: list[int] | None = None,
) -> ExpertForwardQuantized:
    """The torch twin: fp32 compute on the dequantised inputs (in the kernels' per-128-K-block promotion
    order, see `_promoted_matmul`; it equals `formats.fp8_block_dequantize` of both operands followed
    by an fp32 matmul up to fp32 rounding), act quantised by `formats.fp8_block_quantize`.

    h and y are fp32; rows outside regions are NaN (act_q 0x7F, act_scale NaN). ``experts`` limits
    the work to those local experts (the others' rows stay NaN).
    """
    num, two_i, d = w_gate_up_q.shape
    i = two_i // 2
    rows = x_q.shape[0]
    dev = x_q.device
    nan = dict(dtype=torch.float32, device=dev)
    out = ExpertForwardQuantized(
        h=torch.full((rows, 2 * i), float("nan"), **nan),
        act_q=torch.full((rows, i), 0x7F, dtype=torch.uint8, device=dev).view(FP8),
        act_scale=torch.full((rows, i // FP8_BLOCK), float("nan"), **nan),
        y=torch.full((rows, d), float("nan"), **nan),
    )
    for l, (start, count) in enumerate(zip(offsets.tolist(), counts.tolist())):
        if count == 0 or (experts is not None and l not in experts):
            continue
        sl = slice(start, start + count)
        h = _promoted_matmul(x_q[sl], x_scale[sl], w_gate_up_q[l], w_gate_up_scale[l])
        act_q, act_s = fp8_block_quantize(activate(h, activation))
        out.h[sl], out.act_q[sl], out.act_scale[sl] = h, act_q, act_s
        out.y[sl] = _promoted_matmul(act_q, act_s, w_down_q[l], w_down_scale[l])
    return out


def _promoted_matmul(a_q, a_scale, w_q, w_scale):
    """fp32 ``dequant(a) · dequant(w)ᵀ`` for a 1x128-block ``a [M, K]`` and a 128x128-block ``w [N, K]``,
    summed per 128-K block and promoted as the kernels do: ``acc += (a_q·w_qᵀ)_kb * (a_s[:, kb] ⊗ w_s[:, kb])``.

    E4M3 products are exact in fp32, so this order leaves the kernels' pre-quantisation act equal to the
    twin's up to the rounding of the 128-term block sums; the plain dequantise-then-matmul order moves
    the last bits of most act amaxes (and so most act scales)."""
    b = FP8_BLOCK
    acc = torch.zeros(a_q.shape[0], w_q.shape[0], dtype=torch.float32, device=a_q.device)
    w_s_cols = w_scale.repeat_interleave(b, dim=0)  # [N, K/128]
    for kb in range(a_q.shape[1] // b):
        ks = slice(kb * b, (kb + 1) * b)
        part = a_q[:, ks].float() @ w_q[:, ks].float().T
        acc = acc + part * (a_scale[:, kb, None] * w_s_cols[None, :, kb])
    return acc
