"""Routed-expert weights quantised once, for the FP8 megakernel.

Quantising the weights costs a pass over all of them (kimi-k2 at EP 2: 17 GB of
BF16 read, 8.5 GB of E4M3 written per rank, several milliseconds), while they
change only at an optimizer step. ``quantize_experts`` runs that pass once;
every forward until the next step takes the result (``experts_q=``). The pack
remembers which tensors it came from and at which version, so a forward given
weights that were modified in place since (an optimizer step) refuses the stale
pack instead of computing with old weights. Writes through ``w.data`` bypass the
version counter and are not seen: quantise again after them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe.formats import FORMATS
from megamoe.kernels.quant import quantize_weights


def _stamp(w: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """What identifies a weight tensor's current values: storage address, in-place version, shape."""
    return w.data_ptr(), w._version, tuple(w.shape)


@dataclass(frozen=True)
class QuantizedExperts:
    """E4M3 routed-expert weights and their scales, as the megakernel reads them.

    Attributes:
        precision: ``mxfp8`` (E8M0 scales per 32 along each GEMM's reduction axis) or ``fp8-block`` (fp32
            scales per 128x128 block).
        w_gate_up, w_gate_up_scale: E4M3 `[L, 2I, D]` and its scales.
        w_down, w_down_scale: E4M3 `[L, D, I]` and its scales.
        source: the stamps of the BF16 weights they were made from (see ``check_source``).
    """

    precision: str
    w_gate_up: torch.Tensor
    w_gate_up_scale: torch.Tensor
    w_down: torch.Tensor
    w_down_scale: torch.Tensor
    source: tuple

    def check_source(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, precision: str) -> None:
        """ValueError unless this pack was made from these very tensors, unchanged since, in ``precision``."""
        if self.precision != precision:
            raise ValueError(f"experts_q holds {self.precision} weights but the pass runs {precision}")
        if self.source != (_stamp(w_gate_up), _stamp(w_down)):
            raise ValueError("experts_q was not made from these w_gate_up / w_down, or they changed since "
                             "(an optimizer step): quantize_experts them again")


def quantize_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor, precision: str) -> QuantizedExperts:
    """Quantise the routed experts' weights (`[L, 2I, D]`, `[L, D, I]`, BF16) for ``precision``: one launch
    per tensor, bit for bit what the megakernel would quantise in its pass. The pack holds half the BF16
    weights' bytes (plus ~1-3 % of scales) until it is dropped; quantising again before dropping the old
    pack needs room for both."""
    if precision not in FORMATS:
        raise ValueError(f"precision must be one of {FORMATS}, got {precision!r}")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be a bfloat16 [L, rows, cols] tensor, got "
                             f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
    with torch.no_grad():
        gate_up, gate_up_scale = quantize_weights(w_gate_up.detach(), precision)
        down, down_scale = quantize_weights(w_down.detach(), precision)
    return QuantizedExperts(precision, gate_up, gate_up_scale, down, down_scale,
                            (_stamp(w_gate_up), _stamp(w_down)))
