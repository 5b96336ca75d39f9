"""The backward's windows: a pull schedule's rows cut into ring-sized pieces on the device, with no host sync.

The backward streams the schedule's rows through a ring of ``ring`` rows (plus :data:`WINDOW_ALIGN`), one window
at a time: window w is schedule rows ``[cut[w], cut[w + 1])`` at ring rows ``0 ..``. A cut is ``w * ring``
moved down to the nearest multiple of ``WINDOW_ALIGN`` rows from the start of the expert region it falls in, so
an expert split by a cut is split at a multiple of 128 of its own rows: the weight gradients' K steps (32, 64 or
128 rows) and FP8's 128-row token blocks fall where they fall without a cut, and an FP32 carry continues the
reduction across the cut (the same bits at any ring size). ``w * ring - WINDOW_ALIGN < cut[w] <= w * ring``, so
a window holds fewer than ``ring + WINDOW_ALIGN`` rows, and ``cdiv(capacity, ring)`` windows cover any routing.

An expert's weight gradients, per window (:attr:`ScheduleWindow.wgrad_modes`, bits):

    CARRY_IN   its rows began in an earlier window: start from the FP32 carry
    STORE      its rows end in this window (or it has none, in window 0): write the BF16 gradient
    CARRY_OUT  its rows go on past this window: write the FP32 carry instead

and nothing for an expert with no rows in the window. :func:`window_cuts_reference` and
:func:`schedule_window_reference` are the plain-Python twins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from megamoe import checks
from megamoe.kernels import wgrad_carry
from megamoe.kernels.window_table import window_table_kernel
from megamoe.routing.schedule import PullSchedule

#: Rows an expert region is cut at, counted from its start: a multiple of every wgrad K step (32, 64, 128) and of
#: the FP8 token blocks (128, MXFP8's 32 inside them).
WINDOW_ALIGN = 128
#: ScheduleWindow.wgrad_modes bits (the weight-gradient kernels' own).
CARRY_IN, STORE, CARRY_OUT = (int(bit.value) for bit in (wgrad_carry.CARRY_IN, wgrad_carry.STORE, wgrad_carry.CARRY_OUT))
#: Ring rows per program of the window table kernel.
WINDOW_TABLE_BLOCK = 1024


def window_rows(ring: int) -> int:
    """Ring rows a window may need: ``ring + WINDOW_ALIGN`` (a cut moves down by less than WINDOW_ALIGN)."""
    return ring + WINDOW_ALIGN


def max_windows(capacity: int, ring: int) -> int:
    """Windows that cover any routing of ``capacity`` rows: ``cdiv(capacity, ring)`` (at least 1)."""
    check_ring(ring)
    return max(1, -(-capacity // ring))


def check_ring(ring: object) -> None:
    """ValueError unless ``ring`` is a positive multiple of WINDOW_ALIGN."""
    if not checks.is_int(ring) or ring < WINDOW_ALIGN or ring % WINDOW_ALIGN:
        raise ValueError(f"a backward ring must be a positive multiple of {WINDOW_ALIGN} rows, got {ring!r}")


@dataclass(frozen=True)
class ScheduleWindow:
    """Window ``index`` of a pull schedule: its rows ``[start, start + num_rows)`` at ring rows ``0 ..``.

    The comm launches take it as they take a :class:`PullSchedule` (rows ``t < num_rows`` of ``src_rank`` /
    ``src_index``), and the expert kernels its ``tokens_per_expert`` / ``offsets``.

    Attributes:
        index: w (host).
        start: int64 0-d, the window's first schedule row (``cut[w]``).
        num_rows: int32 0-d, its rows (``cut[w + 1] - cut[w]``).
        src_rank, src_index: int32 `[capacity]`, the schedule's entries of ring row q (``start + q``), -1 at and
            past ``num_rows``.
        rows: int64 `[capacity]`, the schedule row of ring row q, clamped into the schedule (gathers read it
            only below ``num_rows``).
        tokens_per_expert, offsets: int32 `[L]`, each expert's rows in the window and where they start in the
            ring (``offsets`` clamped into ``[0, num_rows]``).
        wgrad_modes: int32 `[L]`, the module docstring's bits.
        capacity: the ring's rows (``window_rows(ring)``). num_ranks, experts_per_rank, top_k, max_tokens:
            the schedule's.
    """

    index: int
    start: torch.Tensor
    num_rows: torch.Tensor
    src_rank: torch.Tensor
    src_index: torch.Tensor
    rows: torch.Tensor
    tokens_per_expert: torch.Tensor
    offsets: torch.Tensor
    wgrad_modes: torch.Tensor
    capacity: int
    num_ranks: int
    experts_per_rank: int
    top_k: int
    max_tokens: int


def window_cuts(schedule: PullSchedule, ring: int, windows: int | None = None) -> torch.Tensor:
    """int64 `[windows + 1]` (default :func:`max_windows`): ``cut[w]``, the first schedule row of window w
    (``cut[windows] = num_rows``; windows past the last row are empty)."""
    windows = max_windows(schedule.capacity, ring) if windows is None else windows
    device = schedule.offsets.device
    start = schedule.offsets.long()
    end = start + schedule.tokens_per_expert.long()
    nominal = torch.arange(windows + 1, device=device, dtype=torch.int64) * ring
    # the region holding row b: the last one starting at or before it (empty regions before it share its start)
    region = (torch.searchsorted(start, nominal, right=True) - 1).clamp(min=0)
    first, last = start[region], end[region]
    inside = (nominal >= first) & (nominal < last)
    cut = torch.where(inside, first + (nominal - first) // WINDOW_ALIGN * WINDOW_ALIGN, nominal)
    num_rows = schedule.num_rows.long()
    cut = torch.minimum(cut, num_rows)
    # the first and last cuts by where, not item assignment (a Python scalar written into a device tensor syncs)
    index = torch.arange(windows + 1, device=device)
    return torch.where(index == 0, 0, torch.where(index == windows, num_rows, cut))


def schedule_window(schedule: PullSchedule, index: int, ring: int, *, backend: str | None = None) -> ScheduleWindow:
    """Window ``index`` of ``schedule`` through a ring of ``ring`` rows (cut as :func:`window_cuts` cuts).

    ``backend``: ``"triton"`` (one launch, `megamoe.kernels.window_table`) or ``"torch"`` (~55 small torch
    ops); None picks triton on a GPU and torch on the CPU. Both give the same window."""
    if backend is None:
        backend = "triton" if schedule.offsets.is_cuda else "torch"
    if backend == "triton":
        return _window_by_kernel(schedule, index, ring)
    if backend != "torch":
        raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")
    return _window_by_torch(schedule, window_cuts(schedule, ring), index, ring)


def _window_by_kernel(schedule: PullSchedule, index: int, ring: int) -> ScheduleWindow:
    device, experts = schedule.offsets.device, schedule.tokens_per_expert.numel()
    capacity = window_rows(ring)
    ints = dict(dtype=torch.int32, device=device)
    start = torch.empty((), dtype=torch.int64, device=device)
    num_rows = torch.empty((), **ints)
    src_rank, src_index = torch.empty(capacity, **ints), torch.empty(capacity, **ints)
    rows = torch.empty(capacity, dtype=torch.int64, device=device)
    counts, offsets, modes = (torch.empty(experts, **ints) for _ in range(3))
    grid = (triton.cdiv(capacity, WINDOW_TABLE_BLOCK),)
    window_table_kernel[grid](
        schedule.offsets, schedule.tokens_per_expert, schedule.num_rows, schedule.src_rank, schedule.src_index,
        max(schedule.capacity - 1, 0), index, max_windows(schedule.capacity, ring), ring, experts, capacity,
        start, num_rows, src_rank, src_index, rows, counts, offsets, modes,
        EXPERTS=triton.next_power_of_2(max(experts, 1)), BLOCK=WINDOW_TABLE_BLOCK, ALIGN=WINDOW_ALIGN)
    return ScheduleWindow(index, start, num_rows, src_rank, src_index, rows, counts, offsets, modes, capacity,
                          schedule.num_ranks, schedule.experts_per_rank, schedule.top_k, schedule.max_tokens)


def _window_by_torch(schedule: PullSchedule, cuts: torch.Tensor, index: int, ring: int) -> ScheduleWindow:
    device = schedule.offsets.device
    capacity = window_rows(ring)
    c0, c1 = cuts[index], cuts[index + 1]
    rows_in = c1 - c0
    q = torch.arange(capacity, device=device, dtype=torch.int64)
    rows = (c0 + q).clamp(max=max(schedule.capacity - 1, 0))
    inside = q < rows_in
    src_rank = torch.where(inside, schedule.src_rank[rows], -1)
    src_index = torch.where(inside, schedule.src_index[rows], -1)
    start = schedule.offsets.long()
    end = start + schedule.tokens_per_expert.long()
    first = (start - c0).clamp(0, None).minimum(rows_in)
    last = (end - c0).clamp(0, None).minimum(rows_in)
    modes = torch.where((start < c0) & (end > c0), CARRY_IN, 0)
    continues = (start < c1) & (end > c1)
    ends_here = (end > c0) & (end <= c1) & (end > start)
    if index == 0:
        ends_here = ends_here | (end == start)  # experts with no rows get zeros once
    modes = modes | torch.where(continues, CARRY_OUT, torch.where(ends_here, STORE, 0))
    return ScheduleWindow(index, c0, rows_in.to(torch.int32), src_rank, src_index, rows,
                          (last - first).to(torch.int32), first.to(torch.int32), modes.to(torch.int32), capacity,
                          schedule.num_ranks, schedule.experts_per_rank, schedule.top_k, schedule.max_tokens)


def window_cuts_reference(offsets: list[int], counts: list[int], num_rows: int, ring: int, windows: int) -> list[int]:
    """:func:`window_cuts` in plain Python (the tests' oracle)."""
    cuts = []
    for w in range(windows + 1):
        b, cut = w * ring, w * ring
        for start, count in zip(offsets, counts):
            if start <= b < start + count:
                cut = start + (b - start) // WINDOW_ALIGN * WINDOW_ALIGN
        cuts.append(min(cut, num_rows))
    cuts[0], cuts[-1] = 0, num_rows
    return cuts


def schedule_window_reference(offsets: list[int], counts: list[int], c0: int, c1: int,
                              first_window: bool) -> list[tuple[int, int, int]]:
    """Per expert ``(ring offset, rows, wgrad mode)`` of the window ``[c0, c1)``, in plain Python."""
    out = []
    for start, count in zip(offsets, counts):
        end = start + count
        lo, hi = min(max(start - c0, 0), c1 - c0), min(max(end - c0, 0), c1 - c0)
        mode = CARRY_IN if start < c0 < end else 0
        if start < c1 < end:
            mode |= CARRY_OUT
        elif (c0 < end <= c1 and count) or (first_window and count == 0):
            mode |= STORE
        out.append((lo, hi - lo, mode))
    return out
