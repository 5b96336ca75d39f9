"""Validation of the layer's tensor arguments, shared by every implementation (the layer's inputs as a whole:
:meth:`megamoe.inputs.MoEInputs.validate`, built from these).

Each check raises ``ValueError`` naming the argument, the expected shape or
dtype and what it got. ``check_expert_ids`` reads the ids on the host (one
sync); hot paths call it only when asked to.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megamoe.config import HIDDEN_MULTIPLE, Activation
from megamoe.precision import FP8_BLOCK, MX_BLOCK

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def check_tokens(x_ND: torch.Tensor, name: str = "x") -> tuple[int, int]:
    """``x_ND`` is a 2-D float tensor whose D is a multiple of 64; returns (N, D)."""
    if not isinstance(x_ND, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x_ND).__name__}")
    if x_ND.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, D], got shape {tuple(x_ND.shape)}")
    if x_ND.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be a float tensor, got {x_ND.dtype}")
    n, d = x_ND.shape
    if d % HIDDEN_MULTIPLE:
        raise ValueError(f"{name}: D must be a multiple of {HIDDEN_MULTIPLE}, got D={d}")
    return n, d


def check_routing(top_experts_Nk: torch.Tensor, router_weights_Nk: torch.Tensor, n: int) -> int:
    """Routing ids (integer [N, k]) and weights (float32 [N, k]); returns k."""
    if not isinstance(top_experts_Nk, torch.Tensor) or top_experts_Nk.dim() != 2:
        raise ValueError(f"top_experts must be a 2-D tensor [N, k], got {describe(top_experts_Nk)}")
    if top_experts_Nk.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"top_experts must be int32 or int64, got {top_experts_Nk.dtype}")
    if top_experts_Nk.shape[0] != n:
        raise ValueError(f"top_experts has {top_experts_Nk.shape[0]} rows but x has N={n}")
    k = top_experts_Nk.shape[1]
    if k < 1:
        raise ValueError("top_experts must have k >= 1 columns")
    if not isinstance(router_weights_Nk, torch.Tensor) or tuple(router_weights_Nk.shape) != (n, k):
        raise ValueError(
            f"router_weights must have shape ({n}, {k}) like top_experts, got {describe(router_weights_Nk)}"
        )
    if router_weights_Nk.dtype != torch.float32:
        raise ValueError(f"router_weights must be float32, got {router_weights_Nk.dtype}")
    return k


def check_expert_ids(top_experts: torch.Tensor, num_experts: int) -> None:
    """Every id is -1 (no route) or in [0, num_experts). Reads the ids on the host."""
    if top_experts.numel() == 0:
        return
    lo, hi = int(top_experts.min()), int(top_experts.max())
    if lo < -1 or hi >= num_experts:
        raise ValueError(
            f"top_experts holds ids in [{lo}, {hi}]; allowed: -1 (no route) or 0..{num_experts - 1}"
        )


def check_expert_weights(w_gate_up_L2ID: torch.Tensor, w_down_LDI: torch.Tensor, d: int) -> tuple[int, int]:
    """Stacked expert weights ``[L, 2I, D]`` and ``[L, D, I]``; returns (L, I)."""
    if not isinstance(w_gate_up_L2ID, torch.Tensor) or w_gate_up_L2ID.dim() != 3:
        raise ValueError(f"w_gate_up must be 3-D [E, 2I, D], got {describe(w_gate_up_L2ID)}")
    experts, two_i, wd = w_gate_up_L2ID.shape
    if two_i % 2 or wd != d:
        raise ValueError(f"w_gate_up must be [E, 2I, D={d}], got shape {tuple(w_gate_up_L2ID.shape)}")
    i = two_i // 2
    if not isinstance(w_down_LDI, torch.Tensor) or tuple(w_down_LDI.shape) != (experts, d, i):
        raise ValueError(f"w_down must have shape ({experts}, {d}, {i}), got {describe(w_down_LDI)}")
    for name, w in (("w_gate_up", w_gate_up_L2ID), ("w_down", w_down_LDI)):
        if w.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be a float tensor, got {w.dtype}")
    return experts, i


def check_expert_biases(b_gate_up_L2I, b_down_LD, w_gate_up_L2ID: torch.Tensor, w_down_LDI: torch.Tensor, *,
                        kernels: bool = False) -> None:
    """The routed experts' optional biases (None: none): ``b_gate_up [L, 2I]`` (gate columns, then up) and
    ``b_down [L, D]``, float tensors on the weights' device; ``kernels``: bfloat16 and contiguous, as the expert
    kernels read them."""
    experts, two_i, d = w_gate_up_L2ID.shape
    for name, b, shape in (("b_gate_up", b_gate_up_L2I, (experts, two_i)), ("b_down", b_down_LD, (experts, d))):
        if b is None:
            continue
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (one row per local expert), got {describe(b)}")
        if b.dtype not in FLOAT_DTYPES or (kernels and b.dtype != torch.bfloat16):
            raise ValueError(f"{name} must be {'bfloat16' if kernels else 'a float tensor'}, got {b.dtype}")
        if b.device != w_gate_up_L2ID.device:
            raise ValueError(f"{name} is on {b.device}, the expert weights on {w_gate_up_L2ID.device}")
        if kernels and not b.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def check_shared(shared: Sequence[tuple[torch.Tensor, torch.Tensor]], d: int) -> None:
    """Each shared expert is ``(w_gate_up [2Is, D], w_down [D, Is])``."""
    for s, pair in enumerate(shared):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"shared[{s}] must be a pair (w_gate_up [2Is, D], w_down [D, Is])")
        gate_up, down = pair
        if not isinstance(gate_up, torch.Tensor) or gate_up.dim() != 2 or gate_up.shape[1] != d or gate_up.shape[0] % 2:
            raise ValueError(f"shared[{s}] w_gate_up must be [2Is, D={d}], got {describe(gate_up)}")
        size = gate_up.shape[0] // 2
        if not isinstance(down, torch.Tensor) or tuple(down.shape) != (d, size):
            raise ValueError(f"shared[{s}] w_down must have shape ({d}, {size}), got {describe(down)}")


def check_tensors(specs, device: torch.device) -> None:
    """Each ``(name, tensor, shape, dtype)`` has that shape and dtype, lives on ``device`` and is contiguous."""
    for name, t, shape, dtype in specs:
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} {tuple(shape)}, got {describe(t)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def check_quantized_experts(fmt: str, x_q, x_scale, counts, offsets, w_gate_up_q, w_gate_up_scale, w_down_q,
                            w_down_scale) -> tuple[int, int, int]:
    """The operands of the FP8 expert forward in ``fmt`` (``mxfp8``: E8M0 scales per 32 along each GEMM's
    reduction axis; ``fp8-block``: fp32 scales, 1x128 on the rows, 128x128 on the weights); returns (L, I, D).
    """
    tensors = (x_q, x_scale, counts, offsets, w_gate_up_q, w_gate_up_scale, w_down_q, w_down_scale)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError("every input must be a torch.Tensor")
    if x_q.dim() != 2 or w_gate_up_q.dim() != 3 or w_down_q.dim() != 3:
        raise ValueError("x_q must be [R, D], w_gate_up_q [L, 2I, D] and w_down_q [L, D, I]")
    experts, two_i, d = w_gate_up_q.shape
    i = two_i // 2
    rows = x_q.shape[0]
    if x_q.shape[1] != d or tuple(w_down_q.shape) != (experts, d, i) or two_i % 2:
        raise ValueError(f"shapes disagree: x_q {tuple(x_q.shape)}, w_gate_up_q {tuple(w_gate_up_q.shape)}, "
                         f"w_down_q {tuple(w_down_q.shape)}")
    b = MX_BLOCK if fmt == "mxfp8" else FP8_BLOCK
    # blocks along both reduction axes; that also makes every fp8 row a multiple of 16 bytes (TMA)
    if d % b or i % b or d == 0 or i == 0:
        raise ValueError(f"{fmt} needs D and I positive multiples of {b}, got D={d}, I={i}")
    if tuple(counts.shape) != (experts,) or tuple(offsets.shape) != (experts,):
        raise ValueError(f"counts and offsets must be [{experts}], got {tuple(counts.shape)}, {tuple(offsets.shape)}")
    for name, t in (("counts", counts), ("offsets", offsets)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64, got {t.dtype}")
        if t.device != x_q.device:
            raise ValueError(f"{name} is on {t.device}, x_q on {x_q.device}")
    fp8 = torch.float8_e4m3fn
    if fmt == "mxfp8":  # E8M0 scales of 32 along D (x, gate/up) and I (down)
        scales = (((rows, d // b), torch.uint8), ((experts, 2 * i, d // b), torch.uint8),
                  ((experts, d, i // b), torch.uint8))
    else:  # fp32 scales of 1x128 rows and 128x128 weight blocks
        scales = (((rows, d // b), torch.float32), ((experts, 2 * i // b, d // b), torch.float32),
                  ((experts, d // b, i // b), torch.float32))
    check_tensors((
        ("x_q", x_q, (rows, d), fp8), ("x_scale", x_scale, *scales[0]),
        ("w_gate_up_q", w_gate_up_q, (experts, 2 * i, d), fp8), ("w_gate_up_scale", w_gate_up_scale, *scales[1]),
        ("w_down_q", w_down_q, (experts, d, i), fp8), ("w_down_scale", w_down_scale, *scales[2]),
    ), x_q.device)
    return experts, i, d


def check_activation(activation: object) -> None:
    """A :class:`megamoe.config.Activation` (a bare number was the old ``swiglu_limit``: say what replaced it)."""
    if not isinstance(activation, Activation):
        hint = (f"; a SwiGLU clamp is Activation('swiglu-clamped', limit={activation!r})"
                if isinstance(activation, (int, float)) and not isinstance(activation, bool) else "")
        raise ValueError(f"activation must be a megamoe.Activation, got {activation!r}{hint}")


def check_finite(x: torch.Tensor, router_weights: torch.Tensor) -> None:
    """ValueError naming the first token whose x row or router weights hold a NaN or an Inf (a host sync).

    Without this check a non-finite input stays in its token's rows, as in the reference: that token's output
    and d_x, and the weight gradients of the experts it reached."""
    bad = ~(x.isfinite().all(dim=1) & router_weights.isfinite().all(dim=1))
    if bool(bad.any()):
        token = int(bad.nonzero()[0, 0])
        where = "x" if not bool(x[token].isfinite().all()) else "router_weights"
        count = int(bad.sum())
        raise ValueError(f"token {token} has a NaN or Inf in {where} ({count} such token{'s' * (count != 1)} in all)")


def check_max_tokens(max_tokens: object, n: int) -> None:
    """ValueError unless ``max_tokens`` (the group's largest token count) is an int >= this rank's ``n``."""
    if not is_int(max_tokens) or max_tokens < n:
        raise ValueError(f"max_tokens must be an int >= this rank's tokens ({n}), got {max_tokens!r}")


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive_int(name: str, value: object) -> None:
    """ValueError unless ``value`` is an int >= 1."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_row_index(name: str, index: object, rows: int, device: torch.device) -> None:
    """ValueError unless ``index`` is a contiguous int32 row index `[>= rows]` on ``device`` (the rows a kernel reads
    or writes by index: one rank's tokens, the routes' slots)."""
    if (not isinstance(index, torch.Tensor) or index.dtype != torch.int32 or index.dim() != 1
            or index.numel() < rows or index.device != device or not index.is_contiguous()):
        raise ValueError(f"{name} must be int32 [>= {rows}] on {device}, contiguous, got {describe(index)}")


def describe(t: object) -> str:
    """What an argument is, for an error message: a tensor's shape, dtype and device, else its type."""
    if isinstance(t, torch.Tensor):
        return f"shape {tuple(t.shape)} {t.dtype} on {t.device}"
    return type(t).__name__
