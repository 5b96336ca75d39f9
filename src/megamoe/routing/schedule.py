"""The pull schedule: which token rows a rank fetches, grouped by local expert.

docs/design.md, the schedule. Every rank all-gathers the routing ids of its expert-parallel
group (`[R, N, k]`) and builds, on device and without a host sync, the table
``Phi = (src_rank, src_index)`` of the rows its L local experts need. Rows land
grouped by local expert (GEMM-ready); inside one expert's region consecutive
rows interleave the source ranks round-robin, so a pull dispatch keeps every
link busy. The table is built once and read four times: pull dispatch, push
combine, and their mirrors in the backward.

Entry points:

    build_pull_schedule              on the input's device, no host sync: two Triton kernels
                                     (a GPU) or vectorised torch ops (the CPU)
    build_pull_schedule_loop         plain-Python transcription (megamoe.routing.schedule_loop): the oracle
    gather_routing                   pad [N, k] ids to max_tokens, all-gather to [R, max_tokens, k]
    build_pull_schedule_distributed  gather_routing + build_pull_schedule for this rank

The algorithm, which both builders follow exactly (l = e - rank*L):

    M[l, r]  routes to local expert l from source rank r;  T[l] = sum_r M[l, r]
    S[0] = 0,  S[l] = align_up(S[l-1] + T[l-1], align)
    for (r, i, j) in lexicographic order with e = top_experts_all[r, i, j] on this rank:
        o = C[l, r]                                  # occurrence index so far
        p = sum_r' min(M[l, r'], o) + |{r' < r : M[l, r'] > o}|
        src_rank[S[l] + p] = r;  src_index[S[l] + p] = i*k + j;  C[l, r] += 1

So within region l the routes are ordered by (o, r): occurrence level first,
then source rank, and each rank's routes keep their (i, j) order.

The kernels (`megamoe.kernels.schedule`) follow it literally: program (r, b)
counts its block of rank r's routes per expert (M by integer atomics), then
places them, o from the earlier blocks' counts and a running count. The
torch ops get there with no loop over routes and no data-dependent shapes
(Q = R*N*k routes):

1. Stable sort of the local expert id (other ranks' routes get the dump id L):
   the flat order is r-major, so routes come out grouped by (l, r) in (i, j)
   order. A searchsorted of the sorted group id l*R + r against 0..L*R gives
   the group starts and M (no atomics); o = position - group start.
2. p without a `[Q, R]` gather: with M[l] sorted ascending and
   s = |{r' : M[l, r'] <= o}| (one searchsorted), sum_r' min(M[l, r'], o) =
   (sum of the s smallest M[l]) + o*(R - s), and the ranks with M > o are
   exactly those at sorted positions >= s, so the second term is a table
   B[l, s, r] of L*(R+1)*R entries.
3. Scatter (r, i*k + j) to row S[l] + p of -1-filled arrays; routes of other
   ranks go to one extra dump row that is sliced off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton

from megamoe import checks
from megamoe.kernels import schedule as schedule_kernels

#: src_rank / src_index / offsets are int32: capacity must stay below this.
MAX_CAPACITY = 2**31 - 1


@dataclass(frozen=True)
class ScheduleBlocking:
    """Blocking of the schedule kernels (``megamoe.kernels.schedule``): every value builds the same schedule.

    Attributes:
        route_block: routes per program of both kernels.
        sub_block: routes the placing program takes at a time (it compares every pair of them).
        prefix_blocks: earlier blocks' histograms a placing program sums per step.
        num_warps: warps of both kernels.

    The defaults, by `benchmarks/schedule_bench.py` on an H200 (benchmarks/results/2026-11-30-pass-prologue, µs per
    build, EP 2, 8192 tokens): 512 x 64 kimi-k2 27.7, qwen3.5-397b 36.6, deepseek-v4-pro 25.5; 1024 x 128 43-55;
    32-route sub-blocks, 256-route blocks or 8 warps slower. It lives beside its builder, not in
    ``megamoe.planner``: routing sits below the planner (the planner imports ``routing.windows``).
    """

    route_block: int = 512
    sub_block: int = 64
    prefix_blocks: int = 16
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("route_block", "sub_block", "prefix_blocks", "num_warps"):
            value = getattr(self, name)
            if not checks.is_int(value) or value < 1 or value & (value - 1):
                raise ValueError(f"ScheduleBlocking.{name} must be a power of two, got {value!r}")
        if self.sub_block > self.route_block:
            raise ValueError(f"ScheduleBlocking.sub_block ({self.sub_block}) must be at most route_block "
                             f"({self.route_block}): a block is placed in whole sub-blocks")


@dataclass(frozen=True)
class PullSchedule:
    """Rows this rank pulls for its L local experts (global ids ``rank*L + l``).

    Row ``t`` of the expert-grouped buffer is route ``j = src_index[t] % k`` of
    token ``i = src_index[t] // k`` on rank ``src_rank[t]``. The rows of local
    expert ``l`` are ``[offsets[l], offsets[l] + tokens_per_expert[l])``; inside
    that region row ``offsets[l] + p`` is the route with the p-th smallest key
    ``(o, r)``, where o counts rank r's earlier routes (in (i, j) order) to l:
    level o = 0, 1, ... lists the ranks with ``counts[l, r] > o`` in increasing r.
    Every tensor lives on the routing's device; building them never syncs the host.

    Attributes:
        tokens_per_expert: int32 `[L]`; ``T[l] = counts[l].sum()``.
        counts: int32 `[L, R]`; ``M[l, r]`` routes to local expert l from rank r.
        offsets: int32 `[L]`; ``S[0] = 0``,
            ``S[l] = align_up(S[l-1] + T[l-1], align)``.
        src_rank: int32 `[capacity]`; source rank of row t, in ``[0, R)``;
            -1 for alignment padding rows and for rows ``>= num_rows``.
        src_index: int32 `[capacity]`; ``i*k + j`` on rank ``src_rank[t]``, in
            ``[0, N*k)``; -1 exactly where src_rank is -1.
        num_rows: 0-d int32 tensor on device; ``offsets[L-1] + T[L-1]``, the rows
            in use (padding between regions included). Reading it syncs the host.
        capacity: ``R*N*k + L*(align-1)``, the static worst case, so every shape
            is known without reading device data.
        num_ranks: R.
        experts_per_rank: L.
        top_k: k.
        align: every region starts at a multiple of it.
        own_rows: int32 `[N*k]` or None (built only when asked, ``own_rows_within``): for each of this rank's
            routes ``i*k + j``, the row t holding it when it is routed to one of this rank's experts and the
            schedule fits (``num_rows <= own_rows_within``), else -1. The megakernel's weighted sum reads a
            rank's own outputs in place through it.
    """

    tokens_per_expert: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    src_rank: torch.Tensor
    src_index: torch.Tensor
    num_rows: torch.Tensor
    capacity: int
    num_ranks: int
    experts_per_rank: int
    top_k: int
    align: int
    own_rows: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """Every tensor of the schedule (what a CUDA graph reading it bakes in)."""
        return (self.tokens_per_expert, self.counts, self.offsets, self.src_rank, self.src_index, self.num_rows,
                self.own_rows)

    def __post_init__(self) -> None:
        for name in ("num_ranks", "experts_per_rank", "top_k", "align"):
            checks.check_positive_int(f"PullSchedule.{name}", getattr(self, name))
        R, L, k, pad = self.num_ranks, self.experts_per_rank, self.top_k, self.align - 1
        cap = self.capacity
        if not checks.is_int(cap) or cap < L * pad or (cap - L * pad) % (R * k):
            raise ValueError(
                f"PullSchedule.capacity must be R*N*k + L*(align-1) = {R}*N*{k} + {L * pad}, got {cap!r}"
            )
        shapes = {
            "tokens_per_expert": (L,),
            "counts": (L, R),
            "offsets": (L,),
            "src_rank": (cap,),
            "src_index": (cap,),
            "num_rows": (),
        }
        if self.own_rows is not None:
            shapes["own_rows"] = ((cap - L * pad) // R,)
        device = self.src_rank.device if isinstance(self.src_rank, torch.Tensor) else None
        for name, shape in shapes.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                raise ValueError(f"PullSchedule.{name} must have shape {shape}, got {checks.describe(t)}")
            allowed = (torch.int32, torch.int64) if name == "num_rows" else (torch.int32,)
            if t.dtype not in allowed:
                raise ValueError(f"PullSchedule.{name} must be {' or '.join(map(str, allowed))}, got {t.dtype}")
            if t.device != device:
                raise ValueError(f"PullSchedule.{name} is on {t.device}, src_rank on {device}")

    @property
    def max_tokens(self) -> int:
        """N, the (padded) tokens per rank the schedule was sized for."""
        return (self.capacity - self.experts_per_rank * (self.align - 1)) // (self.num_ranks * self.top_k)

    def expert_rows(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(src_rank, src_index)`` of local expert l's rows. Syncs the host: tests, debugging."""
        if not checks.is_int(l) or not 0 <= l < self.experts_per_rank:
            raise ValueError(f"local expert l must be in [0, {self.experts_per_rank}), got {l!r}")
        start, count = int(self.offsets[l]), int(self.tokens_per_expert[l])
        return self.src_rank[start : start + count], self.src_index[start : start + count]


def row_tokens(src_index: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each row's token ``src_index // k`` (one rank's rows: their tokens are its own), int32; rows without a route
    (-1) get token 0, which no tile reads."""
    return torch.div(src_index.clamp(min=0), top_k, rounding_mode="floor").to(torch.int32)


def build_pull_schedule(
    top_experts_all: torch.Tensor,
    rank: int,
    experts_per_rank: int,
    *,
    align: int = 1,
    check_ids: bool = False,
    backend: str | None = None,
    own_rows_within: int | None = None,
    blocking: ScheduleBlocking | None = None,
) -> PullSchedule:
    """The pull schedule of ``rank``, on ``top_experts_all``'s device.

    Args:
        top_experts_all: int32/int64 `[R, N, k]`, every rank's global expert ids
            in rank order; -1 = no route (also pads ranks with fewer tokens).
            Expert e lives on rank ``e // L``.
        rank: this rank, in ``[0, R)``.
        experts_per_rank: L >= 1.
        align: region starts are multiples of it (>= 1), e.g. a GEMM tile.
        check_ids: also check every id is -1 or in ``[0, R*L)``; this reads the
            ids on the host (one sync). Unchecked ids outside that range are
            treated as no route.
        backend: ``"triton"`` (two kernel launches, `megamoe.kernels.schedule`)
            or ``"torch"`` (~35 vectorised torch ops, below); None picks triton
            on a GPU (host time ~0.1 ms instead of ~2 ms) and torch on the CPU
            (the interpreter runs the kernels' programs one by one). Both
            give the same tensors.
        own_rows_within: also build ``own_rows`` (None: not built); its entries are all -1 unless
            ``num_rows`` is at most this (an int; negative: always -1).
        blocking: the kernels' blocking (None: ``ScheduleBlocking()``); the torch ops ignore it.

    No host sync, no loop over routes, static shapes, deterministic; meant to
    be capturable in a CUDA graph.
    """
    R, N, k = check_schedule_inputs(top_experts_all, rank, experts_per_rank, align, check_ids, own_rows_within)
    if backend is None:
        backend = "triton" if top_experts_all.is_cuda else "torch"
    if backend == "triton":
        return _build_by_kernels(top_experts_all, rank, experts_per_rank, align, own_rows_within,
                                 blocking or ScheduleBlocking())
    if backend != "torch":
        raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")
    return _build_by_torch_ops(top_experts_all, rank, experts_per_rank, align, own_rows_within)


def _build_by_kernels(top_experts_all: torch.Tensor, rank: int, L: int, align: int, own_rows_within: int | None,
                      blocking: ScheduleBlocking) -> PullSchedule:
    R, N, k = top_experts_all.shape
    device, nk = top_experts_all.device, N * k
    capacity = R * nk + L * (align - 1)
    ids = top_experts_all.contiguous()

    def ints(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.int32, device=device)

    zeroed = torch.zeros(L * R + 1, dtype=torch.int32, device=device)  # counts (atomic sums), arrivals: one fill
    counts, arrived = zeroed[:-1].view(L, R), zeroed[-1]
    tokens, offsets, num_rows = ints(L), ints(L), ints()
    src_rank, src_index = ints(capacity), ints(capacity)
    block = blocking.route_block
    blocks = max(1, -(-nk // block))
    hist = ints(R, blocks, L)  # each block's routes to each local expert
    own_rows = None if own_rows_within is None else ints(nk)
    bins = triton.next_power_of_2(L)
    route_args = (nk, rank * L, L, R, blocks)
    schedule_kernels.route_histogram_kernel[(R * blocks,)](
        ids, hist, counts, tokens, offsets, num_rows, arrived, src_rank, src_index, *route_args, capacity,
        align, BLOCK=block, BINS=bins, BLOCK_L=min(64, triton.next_power_of_2(L)), num_warps=blocking.num_warps)
    schedule_kernels.place_routes_kernel[(R * blocks,)](
        # without own_rows (OWN off) the kernel never writes its pointer: src_rank only fills the argument
        ids, hist, counts, offsets, src_rank, src_index, num_rows, src_rank if own_rows is None else own_rows,
        *route_args, rank, -1 if own_rows_within is None else own_rows_within, BLOCK=block,
        SUB=blocking.sub_block, BINS=bins, RANKS=triton.next_power_of_2(R),
        BLOCK_B=max(1, min(blocking.prefix_blocks, triton.next_power_of_2(blocks))), OWN=own_rows is not None,
        num_warps=blocking.num_warps)
    return PullSchedule(tokens, counts, offsets, src_rank, src_index, num_rows, capacity, R, L, k, align, own_rows)


def _build_by_torch_ops(top_experts_all: torch.Tensor, rank: int, L: int, align: int,
                        own_rows_within: int | None) -> PullSchedule:
    """The builder as torch ops; temporary memory about a dozen `[R*N*k]` int64s (the module docstring)."""
    R, N, k = top_experts_all.shape
    device = top_experts_all.device
    nk, Q = N * k, R * N * k
    capacity = Q + L * (align - 1)

    # 1. Group routes by (l, r), keeping (i, j) order: a stable sort of l suffices (flat order is r-major).
    local = top_experts_all.reshape(-1).long() - rank * L
    mine = (local >= 0) & (local < L)
    key_dtype = torch.int16 if L < 2**15 else torch.int32  # narrower keys: fewer radix-sort passes
    l_sorted, perm = torch.sort(torch.where(mine, local, L).to(key_dtype), stable=True)
    l_sorted = l_sorted.long()
    r_sorted = perm // max(nk, 1)
    is_mine = l_sorted < L
    lc = l_sorted.clamp(max=L - 1)  # dump routes borrow expert L-1's tables; their rows are discarded
    group = torch.where(is_mine, l_sorted * R + r_sorted, L * R)
    bounds = torch.searchsorted(group, torch.arange(L * R + 1, device=device))  # start of group g
    counts_LR = (bounds[1:] - bounds[:-1]).view(L, R)
    o = torch.arange(Q, device=device) - bounds[group]

    tokens_L = counts_LR.sum(1)
    padded_L = (tokens_L + (align - 1)) // align * align
    offsets_L = padded_L.cumsum(0) - padded_L

    # 2. p = sum_r' min(M[l, r'], o) + |{r' < r : M[l, r'] > o}| via per-expert sorted counts.
    m_sorted, order = torch.sort(counts_LR, dim=1, stable=True)
    arange_r = torch.arange(R, device=device)
    sorted_pos = torch.empty_like(order).scatter_(1, order, arange_r.expand(L, R))
    prefix = torch.zeros(L, R + 1, dtype=torch.int64, device=device)
    prefix[:, 1:] = m_sorted.cumsum(1)  # prefix[l, s] = sum of the s smallest M[l, :]
    # active[l, s, r]: rank r still has routes once the s smallest counts are used up (M[l, r] > o).
    active = (sorted_pos[:, None, :] >= torch.arange(R + 1, device=device)[None, :, None]).long()
    before = active.cumsum(2) - active  # before[l, s, r] = active ranks r' < r
    stride = Q + 1  # > any count or o: shifting row l by l*stride makes one sorted 1-D sequence
    shift = torch.arange(L, device=device)[:, None] * stride
    s = torch.searchsorted((m_sorted + shift).view(-1), o + lc * stride, right=True) - lc * R
    p = prefix[lc, s] + o * (R - s) + before[lc, s, r_sorted]

    # 3. Scatter into -1-filled rows; other ranks' routes land in the dump row `capacity`.
    row = torch.where(is_mine, offsets_L[lc] + p, capacity)
    src_rank = torch.full((capacity + 1,), -1, dtype=torch.int32, device=device)
    src_index = torch.full((capacity + 1,), -1, dtype=torch.int32, device=device)
    src_rank.scatter_(0, row, r_sorted.int())
    src_index.scatter_(0, row, (perm - r_sorted * nk).int())
    num_rows = (offsets_L[-1] + tokens_L[-1]).int()
    own_rows = None
    if own_rows_within is not None:  # this rank's routes to its own experts; the others land in dump slot nk
        stays = (src_rank[:capacity] == rank) & (num_rows <= own_rows_within)
        at = torch.where(stays, src_index[:capacity], nk).long()
        own_rows = torch.full((nk + 1,), -1, dtype=torch.int32, device=device)
        own_rows.scatter_(0, at, torch.where(stays, torch.arange(capacity, device=device, dtype=torch.int32), -1))
        own_rows = own_rows[:nk]
    return PullSchedule(
        tokens_per_expert=tokens_L.int(),
        counts=counts_LR.int(),
        offsets=offsets_L.int(),
        src_rank=src_rank[:capacity],
        src_index=src_index[:capacity],
        num_rows=num_rows,
        capacity=capacity,
        num_ranks=R,
        experts_per_rank=L,
        top_k=k,
        align=align,
        own_rows=own_rows,
    )


def gather_routing(
    top_experts_Nk: torch.Tensor, group: dist.ProcessGroup | None, *, max_tokens: int | None = None
) -> torch.Tensor:
    """Every rank's routing ids, `[R, max_tokens, k]`, on ``top_experts_Nk``'s device.

    Pads this rank's int `[N, k]` ids with -1 up to ``max_tokens`` and all-gathers
    them in ``group`` (None = the default group); every rank must call it with the
    same k, dtype and ``max_tokens``. With ``max_tokens=None`` it is the group's
    largest N, found by an all_reduce MAX: a host sync; pass it to avoid that.
    """
    if not isinstance(top_experts_Nk, torch.Tensor) or top_experts_Nk.dim() != 2:
        raise ValueError(f"top_experts must be a 2-D tensor [N, k], got {checks.describe(top_experts_Nk)}")
    if top_experts_Nk.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"top_experts must be int32 or int64, got {top_experts_Nk.dtype}")
    n, k = top_experts_Nk.shape
    if k < 1:
        raise ValueError("top_experts must have k >= 1 columns")
    if max_tokens is None:
        # NOTE: host sync, the one place this path reads device data.
        largest = torch.tensor([n], dtype=torch.int64, device=top_experts_Nk.device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        max_tokens = int(largest.item())
    if not checks.is_int(max_tokens) or max_tokens < 0:
        raise ValueError(f"max_tokens must be a non-negative int, got {max_tokens!r}")
    if n > max_tokens:
        raise ValueError(f"this rank has N={n} tokens, more than max_tokens={max_tokens}")
    padded = torch.full((max_tokens, k), -1, dtype=top_experts_Nk.dtype, device=top_experts_Nk.device)
    padded[:n] = top_experts_Nk
    world = dist.get_world_size(group)
    gathered = padded.new_empty((world * max_tokens, k))
    dist.all_gather_into_tensor(gathered, padded, group=group)
    return gathered.view(world, max_tokens, k)


def build_pull_schedule_distributed(
    top_experts_Nk: torch.Tensor,
    group: dist.ProcessGroup | None,
    experts_per_rank: int,
    *,
    max_tokens: int | None = None,
    align: int = 1,
    check_ids: bool = False,
) -> PullSchedule:
    """``gather_routing`` then ``build_pull_schedule`` for ``dist.get_rank(group)``.

    No host sync when ``max_tokens`` is given and ``check_ids`` is False.
    """
    top_experts_all = gather_routing(top_experts_Nk, group, max_tokens=max_tokens)
    return build_pull_schedule(
        top_experts_all, dist.get_rank(group), experts_per_rank, align=align, check_ids=check_ids
    )


def check_schedule_inputs(
    top_experts_all: torch.Tensor, rank: int, experts_per_rank: int, align: int, check_ids: bool,
    own_rows_within: int | None = None,
) -> tuple[int, int, int]:
    """Validates the builders' arguments; returns (R, N, k). Reads the host only with check_ids."""
    if not isinstance(top_experts_all, torch.Tensor) or top_experts_all.dim() != 3:
        raise ValueError(f"top_experts_all must be a 3-D tensor [R, N, k], got {checks.describe(top_experts_all)}")
    if top_experts_all.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"top_experts_all must be int32 or int64, got {top_experts_all.dtype}")
    R, N, k = top_experts_all.shape
    if R < 1 or k < 1:
        raise ValueError(f"top_experts_all [R, N, k] needs R >= 1 and k >= 1, got shape {(R, N, k)}")
    checks.check_positive_int("experts_per_rank", experts_per_rank)
    checks.check_positive_int("align", align)
    if not checks.is_int(rank) or not 0 <= rank < R:
        raise ValueError(f"rank must be in [0, R={R}), got {rank!r}")
    capacity = R * N * k + experts_per_rank * (align - 1)
    if capacity > MAX_CAPACITY:
        raise ValueError(
            f"capacity R*N*k + L*(align-1) = {capacity} exceeds the int32 row index limit {MAX_CAPACITY}"
        )
    if own_rows_within is not None and not checks.is_int(own_rows_within):
        raise ValueError(f"own_rows_within must be an int or None, got {own_rows_within!r}")
    if check_ids:
        checks.check_expert_ids(top_experts_all, R * experts_per_rank)
    return R, N, k
