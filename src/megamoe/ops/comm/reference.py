"""Pure-PyTorch twins of the communication launches: plain indexing over the per-rank tensors (the tests'
oracle)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megamoe.routing.schedule import PullSchedule


def dispatch_reference(x_ranks: Sequence[torch.Tensor], schedule: PullSchedule, *, rows: int | None = None) -> torch.Tensor:
    """``routed[t] = x_ranks[src_rank[t]][src_index[t] // k]`` for rows t (< ``rows``); other rows 0."""
    k, cap = schedule.top_k, schedule.capacity
    device = x_ranks[0].device
    src_rank, src_index = schedule.src_rank.to(device).long(), schedule.src_index.to(device).long()
    if rows is not None:
        src_rank = torch.where(torch.arange(cap, device=device) < rows, src_rank, -1)
    out = torch.zeros(cap, x_ranks[0].shape[1], dtype=x_ranks[0].dtype, device=device)
    for r, x in enumerate(x_ranks):
        mine = src_rank == r
        out[mine] = x[src_index[mine] // k]
    return out


def combine_reference(
    rows_ranks: Sequence[torch.Tensor], schedules: Sequence[PullSchedule], rank: int, slots: torch.Tensor
) -> torch.Tensor:
    """Rank ``rank``'s slots after every rank q pushed ``rows_ranks[q][t]`` to ``slots[src_index[t]]``
    for its rows t with ``src_rank[t] == rank``; ``slots`` (`[N*k, D]`) gives the untouched slots."""
    out = slots.clone()
    for rows, sched in zip(rows_ranks, schedules):
        src_rank, src_index = sched.src_rank.to(out.device).long(), sched.src_index.to(out.device).long()
        mine = src_rank == rank
        out[src_index[mine]] = rows.to(out.device)[mine]
    return out
