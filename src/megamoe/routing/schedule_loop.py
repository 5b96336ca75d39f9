"""The pull schedule as a literal Python loop over its algorithm: the oracle of the builders.

See :mod:`megamoe.routing.schedule` for the algorithm; this transcription
follows it line by line. Slow (Python over R*N*k routes, times R) and it syncs
the host: for tests only.
"""

from __future__ import annotations

import torch

from megamoe.routing.schedule import PullSchedule, check_schedule_inputs


def build_pull_schedule_loop(
    top_experts_all: torch.Tensor,
    rank: int,
    experts_per_rank: int,
    *,
    align: int = 1,
    check_ids: bool = False,
    own_rows_within: int | None = None,
) -> PullSchedule:
    """``build_pull_schedule`` as a literal Python loop over the algorithm: the oracle.

    Slow (Python over R*N*k routes, times R) and syncs the host: for tests only.
    """
    R, N, k = check_schedule_inputs(top_experts_all, rank, experts_per_rank, align, check_ids, own_rows_within)
    L = experts_per_rank
    ids = top_experts_all.tolist()

    def local_expert(e: int) -> int | None:
        return e - rank * L if rank * L <= e < (rank + 1) * L else None

    M = [[0] * R for _ in range(L)]
    for r in range(R):
        for i in range(N):
            for j in range(k):
                l = local_expert(ids[r][i][j])
                if l is not None:
                    M[l][r] += 1
    T = [sum(M[l]) for l in range(L)]
    S = [0] * L
    for l in range(1, L):
        S[l] = -(-(S[l - 1] + T[l - 1]) // align) * align
    capacity = R * N * k + L * (align - 1)
    src_rank = [-1] * capacity
    src_index = [-1] * capacity
    C = [[0] * R for _ in range(L)]
    for r in range(R):
        for i in range(N):
            for j in range(k):
                l = local_expert(ids[r][i][j])
                if l is None:
                    continue
                o = C[l][r]
                p = sum(min(M[l][q], o) for q in range(R)) + sum(1 for q in range(r) if M[l][q] > o)
                src_rank[S[l] + p] = r
                src_index[S[l] + p] = i * k + j
                C[l][r] += 1
    num_rows = S[L - 1] + T[L - 1]
    own_rows = None
    if own_rows_within is not None:
        own_rows = [-1] * (N * k)
        for t in range(capacity):
            if src_rank[t] == rank and num_rows <= own_rows_within:
                own_rows[src_index[t]] = t

    def as_int32(values: object) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=top_experts_all.device)

    return PullSchedule(
        tokens_per_expert=as_int32(T),
        counts=as_int32(M),
        offsets=as_int32(S),
        src_rank=as_int32(src_rank),
        src_index=as_int32(src_index),
        num_rows=as_int32(num_rows),
        capacity=capacity,
        num_ranks=R,
        experts_per_rank=L,
        top_k=k,
        align=align,
        own_rows=None if own_rows is None else as_int32(own_rows),
    )
