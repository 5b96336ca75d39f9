"""Push dispatch: the signalling experiment's twin of the pull dispatch (pull won: docs/design.md).

The owner of a token stores its rows into the receivers' symmetric ``routed``
buffers, where the receivers' pull schedules would have placed them; with
``signal`` the kernel itself makes the data usable (a completion flag per peer,
waited for with a bounded budget).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megamoe.checks import describe, is_int
from megamoe.kernels import comm as comm_kernels
from megamoe.ops.comm.launches import NO_LIMIT
from megamoe.ops.comm.tile import CommTuning, copy_tile
from megamoe.ops.comm.workspace import WAIT_DISPATCH, CommWorkspace, check_num_sms
from megamoe.routing.schedule import PullSchedule
from megamoe.runtime import resolve_wait_budget


@dataclass(frozen=True)
class PushSchedule:
    """The push twin of a pull schedule, held by the rank that owns the tokens.

    Entry ``e`` sends this rank's route ``route[e] = i*k + j`` (token row
    ``route[e] // k`` of ``x``) to row ``dst_row[e]`` of rank ``dst_rank[e]``'s
    ``routed`` buffer, where that rank's pull schedule has ``(src_rank,
    src_index) = (this rank, route[e])``. Entries are sorted by ``(dst_row,
    dst_rank)``, so the entries feeding rows ``< M`` of every receiver are a
    prefix (:meth:`below`). Padding entries are -1 in all three.

    Attributes:
        route, dst_rank, dst_row: int32 `[N*k]`.
        num_entries: 0-d int32 on device, entries in use.
        top_k: k.
    """

    route: torch.Tensor
    dst_rank: torch.Tensor
    dst_row: torch.Tensor
    num_entries: torch.Tensor
    top_k: int

    def below(self, rows: int) -> PushSchedule:
        """The entries that fill rows ``< rows`` of every receiver (a prefix; no host sync)."""
        if not is_int(rows) or rows < 0:
            raise ValueError(f"rows must be a non-negative int, got {rows!r}")
        count = ((self.dst_row >= 0) & (self.dst_row < rows)).sum().to(torch.int32)
        return replace(self, num_entries=count)


def build_push_schedule(ws: CommWorkspace, schedule: PullSchedule) -> PushSchedule:
    """Every rank tells each source rank where its routes land (collective; syncs the host).

    Needs ``shape.push_dispatch``. For each of its rows t the receiver writes
    ``t`` and its rank into the source rank's ``push_dst_row`` /
    ``push_dst_rank`` at the route's slot ``src_index[t]``.
    """
    ws.check_launch(schedule, 1)
    ws.need_push()
    if schedule.capacity > ws.shape.capacity:
        raise ValueError(
            f"schedule capacity {schedule.capacity} exceeds the routed buffer's {ws.shape.capacity} "
            f"(build it with align <= CommShape.align = {ws.shape.align})"
        )
    me, R, k = ws.world.rank, ws.world.size, ws.shape.top_k
    ws.sync()
    ws.local("push_dst_rank").fill_(-1)
    ws.local("push_dst_row").fill_(-1)
    ws.sync()
    valid = schedule.src_rank >= 0
    rows = torch.arange(schedule.capacity, dtype=torch.int32, device=ws.world.device)[valid]
    src_rank, src_index = schedule.src_rank[valid], schedule.src_index[valid].long()
    for r in range(R):
        mine = src_rank == r
        ws.peer("push_dst_row", r)[src_index[mine]] = rows[mine]
        ws.peer("push_dst_rank", r)[src_index[mine]] = me
    ws.sync()
    dst_rank, dst_row = ws.local("push_dst_rank").clone(), ws.local("push_dst_row").clone()
    used = dst_row >= 0
    key = torch.where(used, dst_row.long() * R + dst_rank.long(), torch.iinfo(torch.int64).max)
    order = torch.sort(key, stable=True).indices
    route = torch.where(used[order], order, -1).to(torch.int32)
    return PushSchedule(
        route=route,
        dst_rank=dst_rank[order],
        dst_row=dst_row[order],
        num_entries=used.sum().to(torch.int32),
        top_k=k,
    )


def push_dispatch(
    ws: CommWorkspace,
    push_schedule: PushSchedule,
    *,
    num_sms: int,
    signal: bool = False,
    sync: bool = True,
    wait_budget: int | None = None,
    check: bool = True,
    tuning: CommTuning | None = None,
) -> torch.Tensor:
    """Forward dispatch, push (the experiment's twin of :func:`dispatch_pull`).

    Stores this rank's bf16 x rows into the receivers' symmetric ``routed``
    buffers: ``routed_{dst_rank[e]}[dst_row[e]] = x[route[e] // k]``. Use
    ``push_schedule.below(M)`` to send the first minibatch only.

    With ``signal`` the kernel also makes the data usable by itself: the last
    program of each rank writes a release flag into every rank
    (``dispatch_ready``) and waits, at most ``wait_budget`` polls, for the flag
    of every rank; then this rank's ``routed`` is complete. ``check`` reads
    the error word afterwards (a host sync) and raises RuntimeError naming the
    late peer; with ``check=False`` call ``ws.check_errors()`` later. Every
    rank must make the same sequence of signalling calls. The receiver's
    ``routed`` must be free before anyone pushes (``sync`` or a barrier).

    Returns this rank's ``routed`` `[capacity, D]`.
    """
    check_num_sms(num_sms)
    ws.check_usable()
    ws.need_push()
    if not isinstance(push_schedule, PushSchedule):
        raise ValueError(f"push_schedule must be a PushSchedule, got {type(push_schedule).__name__}")
    nk = ws.shape.max_tokens * ws.shape.top_k
    for name in ("route", "dst_rank", "dst_row"):
        t = getattr(push_schedule, name)
        if t.shape != (nk,) or t.dtype != torch.int32 or t.device != ws.world.device:
            raise ValueError(f"PushSchedule.{name} must be int32 [{nk}] on {ws.world.device}, got {describe(t)}")
    budget = resolve_wait_budget(wait_budget)
    tuning = tuning or CommTuning()
    x, routed = ws.local("x"), ws.local("routed")
    chunks, cp, w, rows_per_tile, align = copy_tile(ws.shape.hidden, x.element_size(), tuning)
    flag_ptrs, flags = ws.flag_ptrs(WAIT_DISPATCH)
    epoch = arrive_target = 0
    if signal:
        ws._epochs[WAIT_DISPATCH] += 1
        epoch = ws._epochs[WAIT_DISPATCH]
        ws._arrivals += num_sms
        arrive_target = ws._arrivals
    if sync:
        ws.sync()

    comm_kernels.push_kernel[(num_sms,)](
        push_schedule.num_entries, NO_LIMIT, ws.claims, x, x.stride(0), push_schedule.route,
        push_schedule.dst_rank, push_schedule.dst_row, ws.peer_ptrs("routed"), routed, routed.stride(0),
        flag_ptrs, flags, ws.local("counters"), arrive_target, epoch, ws.world.rank, ws.world.size, budget,
        ws.local("error"),
        SRC_ROW_DIV=ws.shape.top_k, IDENTITY_SRC=False, CHUNKS=chunks, CP=cp, W=w, ROWS=rows_per_tile, ALIGN=align,
        SIGNAL=signal, WAIT_ID=WAIT_DISPATCH, num_warps=tuning.num_warps,
    )
    if signal and check:
        ws.device_sync()
        ws.check_errors()
    if sync:
        ws.sync()
    return routed

