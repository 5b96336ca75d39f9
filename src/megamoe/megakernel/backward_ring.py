"""The backward's ring: the window buffers both backwards stream a pass's routed rows through, and how a
window's rows, pre-activations and weight-gradient carries get there.

A backward visits the schedule's windows (``megamoe.routing.windows``: ``config.bwd_ring_rows`` rows each, cut
at multiples of 128 rows of an expert) one after another. For window w, at ring rows ``0 .. num_rows``:

    dy     each row's upstream gradient (pulled from its home rank, unscaled; FP8: its E4M3 row and scales)
    x      each row's input (BF16: pulled again; FP8: the forward ring's E4M3 rows, pulled past the ring)
    h      the forward ring's pre-activation, recomputed for rows past it (a wrapped forward ring lost them)
    row_w  each row's router weight (read from its home rank)
    d_x, d_router  what the expert backward returns per row (pushed home after the window)

and the weight gradients' FP32 carries, two pairs used in turn (window w reads pair ``w % 2`` and writes pair
``(w + 1) % 2``). The ring belongs to the MegaKernel (shared by the layers of its shape, read within a pass), so
a rank's backward memory is ``O(window_rows · (D + I)) + O(I · D)`` at any EP size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megamoe.config import Activation
from megamoe.megakernel.buffers import scale_dtype
from megamoe.megakernel.saved import SavedForward
from megamoe.ops.comm import QuantRows
from megamoe.ops.expert_weights import QuantizedExperts
from megamoe.ops.experts import ExpertForwardQuantized, gate_up
from megamoe.ops.experts_bwd import ExpertGrads, WgradCarry
from megamoe.ops.experts_fp8 import gate_up_fp8
from megamoe.ops.experts_mxfp8 import gate_up_mxfp8
from megamoe.ops.gather_rows import gather_rows
from megamoe.planner import KernelConfig, LayerShape
from megamoe.precision import SCALE_BLOCK
from megamoe.routing.schedule import PullSchedule
from megamoe.routing.windows import ScheduleWindow, max_windows, schedule_window, window_rows


@dataclass(frozen=True)
class BackwardRing:
    """One rank's backward window buffers (module docstring); rows: ``window_rows(config.bwd_ring_rows)``.

    Attributes:
        dy, x: `[rows, D]` bf16, or :class:`QuantRows` (E4M3 + scales along D) in the FP8 precisions.
        h: bf16 `[rows, 2I]`. act, act_scale: the replay's activation (bf16 `[rows, I]`, or E4M3 and scales).
        row_w, d_router: fp32 `[rows]`. d_x: bf16 `[rows, D]`.
        carries: fp32 ((dW_down `[D, I]`, dW_gate_up `[2I, D]`) x 2), used in turn by the windows.
    """

    ring: int
    dy: torch.Tensor | QuantRows
    x: torch.Tensor | QuantRows
    h: torch.Tensor
    act: torch.Tensor
    act_scale: torch.Tensor | None
    row_w: torch.Tensor
    d_x: torch.Tensor
    d_router: torch.Tensor
    carries: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def allocate(cls, shape: LayerShape, config: KernelConfig, precision: str, device: torch.device) -> BackwardRing:
        """The buffers of ``config.bwd_ring_rows`` (zeroed: a tile may read rows past its expert's, whose results
        it masks; they must be finite numbers)."""
        ring = config.bwd_ring_rows
        rows, D, I = window_rows(ring), shape.hidden, shape.intermediate
        f32, bf16 = dict(dtype=torch.float32, device=device), dict(dtype=torch.bfloat16, device=device)

        def rows_of(width: int) -> torch.Tensor | QuantRows:
            if precision == "bf16":
                return torch.zeros(rows, width, **bf16)
            return QuantRows(torch.zeros(rows, width, dtype=torch.float8_e4m3fn, device=device),
                             torch.zeros(rows, width // SCALE_BLOCK[precision], dtype=scale_dtype(precision),
                                         device=device), precision)

        act = rows_of(I)
        carries = tuple((torch.zeros(D, I, **f32), torch.zeros(2 * I, D, **f32)) for _ in range(2))
        return cls(ring, rows_of(D), rows_of(D), torch.zeros(rows, 2 * I, **bf16),
                   act if precision == "bf16" else act.data, None if precision == "bf16" else act.scale,
                   torch.zeros(rows, **f32), torch.zeros(rows, D, **bf16), torch.zeros(rows, **f32), carries)

    @property
    def rows(self) -> int:
        return self.h.shape[0]

    @property
    def nbytes(self) -> int:
        tensors = [self.h, self.act, self.act_scale, self.row_w, self.d_x, self.d_router,
                   *(t for pair in self.carries for t in pair)]
        for rows in (self.dy, self.x):
            tensors += [rows.data, rows.scale] if isinstance(rows, QuantRows) else [rows]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def windows(self, schedule: PullSchedule):
        """The schedule's windows in order (every rank visits ``max_windows`` of them: the count is static, the
        windows past the last row are empty)."""
        for w in range(max_windows(schedule.capacity, self.ring)):
            yield schedule_window(schedule, w, self.ring)

    def carry(self, window: ScheduleWindow) -> WgradCarry:
        """Window w's weight-gradient carries: pair ``w % 2`` in, pair ``(w + 1) % 2`` out."""
        (down_in, gate_up_in), (down_out, gate_up_out) = (self.carries[window.index % 2],
                                                          self.carries[(window.index + 1) % 2])
        return WgradCarry(window.wgrad_modes, down_in, down_out, gate_up_in, gate_up_out)

    def grads(self, d_w_gate_up: torch.Tensor, d_w_down: torch.Tensor) -> ExpertGrads:
        """Where the expert backward of a window writes: the ring's d_x and d_router, the pass's weight
        gradients."""
        return ExpertGrads(self.d_x, self.d_router, d_w_gate_up, d_w_down)

    def in_forward_ring(self, saved: SavedForward, window: ScheduleWindow) -> bool:
        """True when the window is the first and the forward's ring holds all its rows: then h (and FP8's x) are
        read in place, no copy."""
        return window.index == 0 and self.rows <= saved.h.shape[0]

    def saved_rows(self, saved: SavedForward, window: ScheduleWindow) -> tuple[torch.Tensor, QuantRows | None]:
        """The window's h (and with an FP8 precision its E4M3 x) from the forward's ring: in place for the first
        window when the ring holds it, else gathered into the ring buffers (rows past the forward's ring get
        its last row: :meth:`replay` recomputes them)."""
        fp8 = saved.ring_x is not None
        if self.in_forward_ring(saved, window):
            x = QuantRows(saved.ring_x[: self.rows], saved.ring_scale[: self.rows], self.x.format) if fp8 else None
            return saved.h[: self.rows], x
        index = window.rows.clamp(max=saved.h.shape[0] - 1)
        gather_rows(saved.h, index, window.num_rows, self.h)  # only the window's rows: an empty one copies nothing
        if fp8:
            gather_rows(saved.ring_x.view(torch.uint8), index, window.num_rows, self.x.data.view(torch.uint8))
            gather_rows(saved.ring_scale, index, window.num_rows, self.x.scale)
        return self.h, self.x if fp8 else None

    def past_forward_ring(self, window: ScheduleWindow, forward_ring: int) -> ScheduleWindow:
        """The window with only its rows past the forward's ring (the others' entries -1: a pull skips them)."""
        past = window.rows >= forward_ring
        return replace(window, src_rank=torch.where(past, window.src_rank, -1),
                       src_index=torch.where(past, window.src_index, -1))

    def replay(self, window: ScheduleWindow, forward_ring: int, x: torch.Tensor | QuantRows, w_gate_up: torch.Tensor,
               activation: Activation, experts_q: QuantizedExperts | None, rows_per_expert: float,
               b_gate_up: torch.Tensor | None = None) -> None:
        """h of the window's rows past the forward's ring, recomputed from their x into ``self.h`` (the forward's
        gate/up tiles, with its optional bias ``b_gate_up``: the same bits). Each expert's piece is cut there on the
        device: a window the forward's ring holds launches over empty pieces."""
        lo = (forward_ring - window.start).clamp(min=0)
        first = torch.maximum(window.offsets.long(), lo)
        end = window.offsets.long() + window.tokens_per_expert.long()
        counts = (end - first).clamp(min=0).to(torch.int32)
        first = first.minimum(end).to(torch.int32)
        if isinstance(x, QuantRows):
            q = experts_q
            out = ExpertForwardQuantized(self.h, self.act, self.act_scale, None)
            if x.format == "fp8-block":
                gate_up_fp8(x.data, x.scale, counts, first, q.w_gate_up, q.w_gate_up_scale, out,
                            activation=activation, rows_per_expert=rows_per_expert, bias=b_gate_up)
            else:
                gate_up_mxfp8(x.data, x.scale, counts, first, q.w_gate_up, q.w_gate_up_scale, out,
                              activation=activation, bias=b_gate_up)
            return
        gate_up(x, counts, first, w_gate_up, self.h, self.act, activation=activation,
                rows_per_expert=rows_per_expert, bias=b_gate_up)
