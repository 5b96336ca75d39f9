"""What a forward pass leaves for its backward: a layer's own buffers and the context that holds them.

A model runs every layer's forward before any backward, so what a backward
reads must belong to its layer, not to the kernel that layers of one shape
share. :class:`LayerBuffers` are those tensors (the ring's routed rows, the
pre-activation h, the activation, their FP8 scales, the shared expert's h and
activation); :class:`ForwardContext` holds them with the pass's schedule and
row tiles. A context stays valid as long as it is referenced, however many
other forwards run in between: nothing else writes its buffers. The kernel's
own pass buffers (staging, combine slots, expert outputs, counters) are
shared and live only within a pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe.planner import KernelConfig, LayerShape
from megamoe.precision import SCALE_BLOCK
from megamoe.routing.row_tiles import RowTiles
from megamoe.routing.schedule import PullSchedule


def scale_dtype(precision: str) -> torch.dtype | None:
    """The dtype of ``precision``'s activation scales (None: BF16 has none)."""
    return {"bf16": None, "mxfp8": torch.uint8, "fp8-block": torch.float32}[precision]


@dataclass(frozen=True)
class LayerBuffers:
    """One layer's forward results on one rank, as its backward reads them.

    Attributes:
        ring_x: `[ring_rows, D]` routed rows (bf16; E4M3 with mxfp8 / fp8-block).
        h: bf16 `[ring_rows, 2I]` pre-activation (gate | up).
        act: `[ring_rows, I]` SwiGLU(h) (bf16; E4M3 with the FP8 precisions).
        ring_scale, act_scale: the FP8 scales of ring_x and act along D and I (mxfp8 E8M0 1x32, fp8-block fp32
            1x128); None with bf16.
        shared_h, shared_act: the shared expert's `[N, 2Is]`, `[N, Is]` over this rank's tokens (None without).
    """

    ring_x: torch.Tensor
    h: torch.Tensor
    act: torch.Tensor
    ring_scale: torch.Tensor | None
    act_scale: torch.Tensor | None
    shared_h: torch.Tensor | None
    shared_act: torch.Tensor | None

    @classmethod
    def allocate(cls, shape: LayerShape, config: KernelConfig, precision: str,
                 device: torch.device) -> LayerBuffers:
        """Buffers for ``shape`` at ``config``'s ring size (rows the GEMM tiles may read past an expert's region
        start zeroed: their results are masked, but they must be finite numbers)."""
        rows, D, I, Is = config.ring_rows, shape.hidden, shape.intermediate, shape.shared_intermediate
        quantized = precision != "bf16"
        row_dtype = torch.float8_e4m3fn if quantized else torch.bfloat16
        block, scales = SCALE_BLOCK[precision], dict(dtype=scale_dtype(precision), device=device)
        n = max(shape.max_tokens, 1)
        bf16 = dict(dtype=torch.bfloat16, device=device)
        return cls(
            ring_x=torch.zeros(rows, D, dtype=row_dtype, device=device),
            h=torch.empty(rows, 2 * I, **bf16),
            act=torch.zeros(rows, I, dtype=row_dtype, device=device),
            ring_scale=torch.zeros(rows, D // block, **scales) if quantized else None,
            act_scale=torch.zeros(rows, I // block, **scales) if quantized else None,
            shared_h=torch.empty(n, 2 * Is, **bf16) if Is else None,
            shared_act=torch.zeros(n, Is, **bf16) if Is else None,
        )

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """Every buffer, in field order (a replayed graph bakes in their addresses)."""
        return (self.ring_x, self.h, self.act, self.ring_scale, self.act_scale, self.shared_h, self.shared_act)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors() if t is not None)


@dataclass(frozen=True)
class ForwardContext:
    """What a forward pass leaves for the backward (per rank).

    The ring holds the minibatches visited last, which are the first ones
    (minibatches are visited in reverse): minibatch ``j < ring_rows / minibatch``
    has its routed rows, pre-activation and activation at ring rows
    ``j * minibatch ..``. The others must be replayed from the schedule
    (pull x again, recompute h) before their gradients.

    Attributes:
        schedule: the pull schedule of the pass.
        row_tiles: its row tiles by minibatch (cut at minibatch boundaries only when the ring wraps; else
            a minibatch's tiles are those starting in it).
        config: the KernelConfig the pass ran with.
        buffers: the layer's buffers the pass wrote (:class:`LayerBuffers`), the context's alone.
    """

    schedule: PullSchedule
    row_tiles: RowTiles
    config: KernelConfig
    buffers: LayerBuffers

    def resident_minibatches(self) -> int:
        """Minibatches 0 .. this-1 are still in the ring."""
        return self.config.ring_rows // self.config.minibatch
