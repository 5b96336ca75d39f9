"""The expert biases' backward over schedule-grouped rows: the launches of ``megamoe.kernels.expert_bias`` and their
torch twin.

The forward adds ``b_gate_up [L, 2I]`` to h before the activation and ``b_down [L, D]`` to each expert output row
(in the expert kernels' epilogues, on the experts' rank). Their gradients need nothing the expert backward does not
already hold for a window of routed rows:

    d_b_gate_up[l] += sum over l's rows of d_h[r]                      (d_h includes the router weight)
    d_b_down[l]    += sum over l's rows of w[r] * d_out[r]            (d_out unscaled, as pulled)
    d_router[r]    += <d_out[r], b_down[l]>                           (y = act · W_downᵀ + b_down)

each a segment sum in one fixed order into FP32 accumulators the caller keeps across a backward's windows (the
weight gradients' carries play that part for the weights), rounded once at the end: bitwise deterministic, and
the same bits whatever the window size (``megamoe.kernels.expert_bias``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe.kernels import expert_bias

#: Rows per block of the segment sums: divides 128, the backward windows' cut (the same blocks at any window size).
BIAS_ROWS = 32
#: Columns per program of the segment sums and per step of the row dots.
BIAS_COLS = 128


@dataclass(frozen=True)
class BiasGrads:
    """The expert biases' share of a backward over routed rows.

    Attributes:
        b_down: bf16 `[L, D]` the forward's down bias (its router-gradient term), or None.
        d_b_gate_up: fp32 `[L, 2I]` accumulator the rows' d_h sums are added to (None without a gate/up bias).
        d_b_down: fp32 `[L, D]` accumulator the rows' ``w · d_out`` sums are added to (None without a down bias).
    """

    b_down: torch.Tensor | None
    d_b_gate_up: torch.Tensor | None
    d_b_down: torch.Tensor | None

    @classmethod
    def zeros(cls, b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None) -> BiasGrads | None:
        """Zeroed accumulators for these biases (None when there are none)."""
        if b_gate_up is None and b_down is None:
            return None
        acc = lambda b: None if b is None else torch.zeros(b.shape, dtype=torch.float32, device=b.device)  # noqa: E731
        return cls(b_down, acc(b_gate_up), acc(b_down))

    def rounded(self, like_gate_up: torch.Tensor | None, like_down: torch.Tensor | None):
        """(d_b_gate_up, d_b_down) in the biases' dtypes (None where there is no bias)."""
        return tuple(None if acc is None else acc.to(like.dtype)
                     for acc, like in ((self.d_b_gate_up, like_gate_up), (self.d_b_down, like_down)))


def bias_backward(bias: BiasGrads | None, d_h: torch.Tensor, dy_rows: torch.Tensor, row_weights: torch.Tensor,
                  counts: torch.Tensor, offsets: torch.Tensor, d_router: torch.Tensor) -> None:
    """Add the rows' bias gradients to ``bias``'s accumulators and the down bias's term to ``d_router`` (module
    docstring). ``d_h`` `[R, 2I]` and ``dy_rows`` `[R, D]` any float dtype with unit column stride (an FP8 backward
    passes its d_out rows dequantised), ``row_weights`` fp32 `[R]`, ``d_router`` fp32 `[R]`, int32 ``counts`` and
    ``offsets`` `[L]`. Nothing to do when ``bias`` is None."""
    if bias is None or d_h.shape[0] == 0:
        return
    experts = counts.shape[0]
    for acc, rows, weights in ((bias.d_b_gate_up, d_h, None), (bias.d_b_down, dy_rows, row_weights)):
        if acc is None:
            continue
        cols = rows.shape[1]
        expert_bias.segment_sum_kernel[(experts, -(-cols // BIAS_COLS))](
            rows, rows.stride(0), weights, counts, offsets, acc, acc.stride(0), cols,
            BLOCK_R=BIAS_ROWS, BLOCK_C=BIAS_COLS)
    if bias.b_down is not None:
        programs = 1 if dy_rows.device.type == "cpu" else 8  # row blocks per expert in flight
        expert_bias.row_dot_kernel[(experts, programs)](
            dy_rows, dy_rows.stride(0), bias.b_down, bias.b_down.stride(0), counts, offsets, d_router,
            dy_rows.shape[1], BLOCK_R=BIAS_ROWS, BLOCK_C=BIAS_COLS)


def bias_backward_reference(bias: BiasGrads | None, d_h: torch.Tensor, dy_rows: torch.Tensor,
                            row_weights: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor,
                            d_router: torch.Tensor) -> None:
    """The torch twin of :func:`bias_backward` (FP32 sums per expert, in place)."""
    if bias is None:
        return
    for l, (start, count) in enumerate(zip(offsets.tolist(), counts.tolist())):
        rows = slice(start, start + count)
        if bias.d_b_gate_up is not None:
            bias.d_b_gate_up[l] += d_h[rows].float().sum(0)
        if bias.d_b_down is not None:
            bias.d_b_down[l] += (dy_rows[rows].float() * row_weights[rows, None]).sum(0)
        if bias.b_down is not None:
            d_router[rows] += dy_rows[rows].float() @ bias.b_down[l].float()
