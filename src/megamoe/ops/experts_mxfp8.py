"""MXFP8 (OCP MX) expert forward over schedule-grouped rows: launches and the torch twin.

:func:`expert_forward_mxfp8` takes routed rows quantised along D (``quantize_activations(x, "mxfp8")``)
and expert weights quantised along their reduction axis (``quantize_weights(w_gate_up, "mxfp8")`` along
D, ``quantize_weights(w_down, "mxfp8")`` along I) and runs gate/up + SwiGLU (act quantised to MXFP8
along I in the epilogue) and down with the persistent kernels of `megamoe.kernels.expert_gemm_mxfp8`:
Hopper has no block-scaled MMA, so they dequantise each loaded tile to bf16 (exact) and run bf16 wgmma
(see that module, and why its per-32 rescale was retired).

Row tiles and the launch come from `megamoe.ops.launch`, the grid size from `megamoe.runtime`.
:func:`expert_forward_mxfp8_reference` is the plain-PyTorch twin (fp32 on the dequantised operands).

:data:`AS_BF16` switches the layer's MXFP8 experts (the one-rank forward, the composed backward) to the other
formulation of the same numbers: the BF16 expert kernels on operands rounded to the MXFP8 grid
(`megamoe.ops.experts_mxfp8_bf16`).
"""

from __future__ import annotations


import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe import checks
from megamoe import runtime
from megamoe.config import SWIGLU, Activation
from megamoe.ops.experts import ExpertForwardQuantized
from megamoe.ops.launch import flat_row_stride, launch_row_tasks
from megamoe.planner.tiles import TileConfig
from megamoe.planner.tuning import DEFAULT_TUNING, Tuning
from megamoe.reference.formats import MX_BLOCK, mxfp8_dequantize, mxfp8_quantize
from megamoe.kernels import expert_gemm_mxfp8
from megamoe.ops.quant import soft_e4m3_default
from megamoe.reference import activate

FP8 = torch.float8_e4m3fn

#: The layer's MXFP8 experts run as the BF16 expert kernels on operands rounded to the MXFP8 grid and kept bf16
#: (`megamoe.ops.experts_mxfp8_bf16`: every operand on the grid, FP32 accumulation, the numbers of these tiles up to
#: the order of the sums) when True: the one-rank forward and the composed backward at any EP size (the forward
#: megakernel at EP >= 2 keeps these tiles: its rows travel as E4M3). The step's pack then also holds the weights
#: rounded, bf16, along each GEMM's reduction axis. On by default: on one H200 (qwen3-30b-a3b, 8192 tokens, EP 1)
#: the step took 7.27 ms against these tiles' 13.81, its gradients as far from the oracle as theirs
#: (benchmarks/results/2026-12-06-mxfp8-as-bf16). ``MEGAMOE_MXFP8_AS_BF16=0`` keeps these tiles (less memory: no
#: bf16 copies of the weights).
AS_BF16 = runtime.env_switch("MEGAMOE_MXFP8_AS_BF16", True)


def runs_as_bf16(precision: str) -> bool:
    """Whether the layer's routed experts in ``precision`` run as BF16 kernels on MX-rounded operands
    (:data:`AS_BF16`, mxfp8 only)."""
    return precision == "mxfp8" and AS_BF16


def _check_tiles(kind: str, cfg: TileConfig) -> None:
    if cfg.block_k < MX_BLOCK:
        raise ValueError(f"{kind}: block_k must be a multiple of {MX_BLOCK}, got {cfg.block_k}")
    if kind == "gate_up" and cfg.block_n < 2 * MX_BLOCK:
        raise ValueError(f"gate_up: block_n must be >= {2 * MX_BLOCK} (two chunks of 32-blocks), got {cfg.block_n}")


def expert_forward_mxfp8(
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
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> ExpertForwardQuantized:
    """MXFP8 gate/up + SwiGLU (+ act quantisation along I) and down for every expert region.

    Args:
        x_q: E4M3 `[R, D]` routed rows grouped by local expert; x_scale: uint8 E8M0 `[R, D/32]`.
        counts: int `[L]` rows of each expert; offsets: int `[L]` region starts.
        w_gate_up_q: E4M3 `[L, 2I, D]`, w_gate_up_scale uint8 `[L, 2I, D/32]` (32-blocks along D).
        w_down_q: E4M3 `[L, D, I]`, w_down_scale uint8 `[L, D, I/32]` (32-blocks along I).
            D and I multiples of 32.
        activation: clamp of SwiGLU (gate <= limit, |up| <= limit), as in `megamoe.reference.swiglu`.
        num_programs: persistent grid size (default: the SM count).
        tuning: pins the gate/up and down tiles (:class:`~megamoe.planner.tuning.Tuning`); block_k a multiple of 32,
            gate/up block_n >= 64.
        store_h: also write h (bf16 pre-activation, for the backward); False leaves ``h`` None.
        out: preallocated outputs to fill (rows outside regions are left alone).
        b_gate_up: bf16 `[L, 2I]`, b_down: bf16 `[L, D]`: optional expert biases, added in FP32 to gate/up before
            the activation (h includes it) and to y.
    """
    experts, i, d = checks.check_quantized_experts("mxfp8", x_q, x_scale, counts, offsets, w_gate_up_q,
                                                   w_gate_up_scale, w_down_q, w_down_scale)
    checks.check_expert_biases(b_gate_up, b_down, w_gate_up_q, w_down_q, kernels=True)
    out = ExpertForwardQuantized.given_or_empty(out, x_q.shape[0], i, d, MX_BLOCK, torch.uint8, x_q.device, store_h)
    gate_up_mxfp8(x_q, x_scale, counts, offsets, w_gate_up_q, w_gate_up_scale, out,
                  activation=activation, num_programs=num_programs, tuning=tuning, store_h=store_h,
                  bias=b_gate_up)
    down_mxfp8(out.act_q, out.act_scale, counts, offsets, w_down_q, w_down_scale, out.y,
               num_programs=num_programs, tuning=tuning, bias=b_down)
    return out


def gate_up_mxfp8(x_q, x_scale, counts, offsets, w_gate_up_q, w_gate_up_scale, out: ExpertForwardQuantized, *,
                  activation: Activation = SWIGLU, num_programs=None, tuning: Tuning | None = None,
                  store_h: bool = True, bias: torch.Tensor | None = None) -> None:
    """out.act_q / out.act_scale (and out.h with store_h) of every expert region, gate/up plus the optional
    ``bias`` bf16 `[L, 2I]` before the activation: one persistent launch."""
    experts, two_i, d = w_gate_up_q.shape
    i = two_i // 2
    rows = x_q.shape[0]
    c = (tuning or DEFAULT_TUNING).tile("gate_up", x_q.device, fmt="mxfp8")
    _check_tiles("gate_up", c)
    if rows == 0 or experts == 0:
        return
    h = out.h if store_h else out.y  # any pointer: never touched without STORE_H
    launch_row_tasks(
        expert_gemm_mxfp8.gate_up_mxfp8_kernel, c, runtime.num_programs(x_q.device, num_programs),
        counts.to(torch.int32), offsets.to(torch.int32), rows,
        head=(TensorDescriptor.from_tensor(x_q, [c.block_m, c.block_k]),
              TensorDescriptor.from_tensor(w_gate_up_q.view(experts * 2 * i, d), [c.block_n, c.block_k]),
              x_scale, w_gate_up_scale, h, out.act_q.view(torch.uint8), out.act_scale,
              x_scale.stride(0), flat_row_stride(w_gate_up_scale), h.stride(0), out.act_q.stride(0),
              out.act_scale.stride(0)),
        tail=(i, experts * 2 * i, d, activation.kernel_limit, activation.kernel_alpha),
        ACT=activation.kernel_id, STORE_H=store_h, SOFT_E4M3=soft_e4m3_default(), b_ptr=bias,
    )


def down_mxfp8(act_q, act_scale, counts, offsets, w_down_q, w_down_scale, y, *, num_programs=None,
               tuning: Tuning | None = None, bias: torch.Tensor | None = None) -> None:
    """y = dequant(act_q) · dequant(w_down_q)ᵀ (+ the optional ``bias`` bf16 `[L, D]`) on every expert region: one
    persistent launch."""
    experts, d, i = w_down_q.shape
    rows = act_q.shape[0]
    c = (tuning or DEFAULT_TUNING).tile("down", act_q.device, fmt="mxfp8")
    _check_tiles("down", c)
    if rows == 0 or experts == 0:
        return
    launch_row_tasks(
        expert_gemm_mxfp8.down_mxfp8_kernel, c, runtime.num_programs(act_q.device, num_programs),
        counts.to(torch.int32), offsets.to(torch.int32), rows,
        head=(TensorDescriptor.from_tensor(act_q, [c.block_m, c.block_k]),
              TensorDescriptor.from_tensor(w_down_q.view(experts * d, i), [c.block_n, c.block_k]),
              act_scale, w_down_scale, y, act_scale.stride(0), flat_row_stride(w_down_scale), y.stride(0)),
        tail=(d, experts * d, i),
        b_ptr=bias,
    )


def expert_forward_mxfp8_reference(
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
    """The torch twin: operands dequantised by `formats.mxfp8_dequantize` (exact, fp32), fp32 matmuls,
    SwiGLU in the kernels' form, act quantised along I by `formats.mxfp8_quantize`.

    h and y are fp32; rows outside regions are NaN (act_q 0x7F, act_scale 255). ``experts`` limits
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
        act_scale=torch.full((rows, i // MX_BLOCK), 255, dtype=torch.uint8, device=dev),
        y=torch.full((rows, d), float("nan"), **nan),
    )
    for l, (start, count) in enumerate(zip(offsets.tolist(), counts.tolist())):
        if count == 0 or (experts is not None and l not in experts):
            continue
        sl = slice(start, start + count)
        x = mxfp8_dequantize(x_q[sl], x_scale[sl])
        h = x @ mxfp8_dequantize(w_gate_up_q[l], w_gate_up_scale[l]).T
        act_q, act_s = mxfp8_quantize(activate(h, activation))
        out.h[sl], out.act_q[sl], out.act_scale[sl] = h, act_q, act_s
        out.y[sl] = mxfp8_dequantize(act_q, act_s) @ mxfp8_dequantize(w_down_q[l], w_down_scale[l]).T
    return out
