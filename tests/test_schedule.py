"""The pull schedule: both builders (Triton kernels, torch ops) == the loop twin, invariants, edge cases, errors.

The Triton builder runs under the interpreter here (conftest sets TRITON_INTERPRET without a GPU)."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe.routing.schedule import (PullSchedule, ScheduleBlocking, build_pull_schedule,
                                      build_pull_schedule_distributed, gather_routing)
from megamoe.routing.schedule_loop import build_pull_schedule_loop
from megamoe.parallel.world import launch

TENSOR_FIELDS = ("tokens_per_expert", "counts", "offsets", "src_rank", "src_index", "num_rows")
INT_FIELDS = ("capacity", "num_ranks", "experts_per_rank", "top_k", "align")


def routing(seed, tokens_per_rank, k, num_experts, *, p_none=0.2, dtype=torch.int64):
    """Random ids `[R, max(N_r), k]`: ranks with fewer tokens are -1 padded, some routes are -1.

    Ids are drawn with replacement, so a token may route to one expert twice.
    """
    gen = torch.Generator().manual_seed(seed)
    R, n_max = len(tokens_per_rank), max(tokens_per_rank)
    ids = torch.randint(0, num_experts, (R, n_max, k), generator=gen)
    ids[torch.rand(R, n_max, k, generator=gen) < p_none] = -1
    for r, n in enumerate(tokens_per_rank):
        ids[r, n:] = -1
    return ids.to(dtype)


def assert_same(a: PullSchedule, b: PullSchedule) -> None:
    for name in TENSOR_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), f"{name}: {x} != {y}"
    assert (a.own_rows is None) == (b.own_rows is None)
    if a.own_rows is not None:
        assert a.own_rows.dtype == b.own_rows.dtype and torch.equal(a.own_rows, b.own_rows), "own_rows"
    for name in INT_FIELDS:
        assert getattr(a, name) == getattr(b, name), name


def check_invariants(s: PullSchedule, top: torch.Tensor, rank: int) -> None:
    """Checks the schedule against the routing directly, without either builder."""
    R, N, k = top.shape
    L, align = s.experts_per_rank, s.align
    ids = top.tolist()
    routes = [[] for _ in range(L)]  # (r, i*k + j) in (r, i, j) order
    for r in range(R):
        for i in range(N):
            for j in range(k):
                if rank * L <= ids[r][i][j] < (rank + 1) * L:
                    routes[ids[r][i][j] - rank * L].append((r, i * k + j))
    M = [[sum(1 for q, _ in routes[l] if q == r) for r in range(R)] for l in range(L)]
    T = [len(routes[l]) for l in range(L)]
    assert s.counts.tolist() == M
    assert s.tokens_per_expert.tolist() == T == s.counts.sum(1).tolist()
    # offsets are the aligned prefix sums of tokens_per_expert
    starts, acc = [], 0
    for t in T:
        starts.append(acc)
        acc += -(-t // align) * align
    assert s.offsets.tolist() == starts
    assert all(o % align == 0 for o in starts)
    assert int(s.num_rows) == starts[-1] + T[-1]
    assert s.capacity == R * N * k + L * (align - 1)
    assert s.max_tokens == N
    src_rank, src_index = s.src_rank.tolist(), s.src_index.tolist()
    assert len(src_rank) == len(src_index) == s.capacity
    in_region = [False] * s.capacity
    for l in range(L):
        rows = range(starts[l], starts[l] + T[l])
        got = [(src_rank[t], src_index[t]) for t in rows]
        # every routed (rank, i*k+j) of expert l appears exactly once
        assert sorted(got) == sorted(routes[l]) and len(set(got)) == len(got)
        # round-robin: level o lists the ranks with M[l, r] > o in increasing r, before level o+1
        levels = [r for o in range(max(M[l], default=0)) for r in range(R) if M[l][r] > o]
        assert [r for r, _ in got] == levels
        # each source rank's routes keep their (i, j) order
        for r in range(R):
            assert [x for q, x in got if q == r] == [x for q, x in routes[l] if q == r]
        for t in rows:
            in_region[t] = True
    # alignment padding and rows past num_rows are -1 in both arrays
    for t in range(s.capacity):
        if not in_region[t]:
            assert src_rank[t] == -1 and src_index[t] == -1, t


BACKENDS = ("triton", "torch")


def check_own_rows(s: PullSchedule, top: torch.Tensor, rank: int, within: int) -> None:
    """own_rows against the routing: each of ``rank``'s routes to its own experts maps to the row holding it
    when the schedule fits in ``within`` rows; everything else is -1."""
    R, N, k = top.shape
    L = s.experts_per_rank
    fits = int(s.num_rows) <= within
    rows = {(r, q): t for t, (r, q) in enumerate(zip(s.src_rank.tolist(), s.src_index.tolist())) if r >= 0}
    ids = top[rank].reshape(-1).tolist()
    want = [rows[(rank, q)] if fits and rank * L <= e < (rank + 1) * L else -1 for q, e in enumerate(ids)]
    assert s.own_rows.dtype == torch.int32 and s.own_rows.tolist() == want


def check_all(top, rank, L, align=1, blocking=None):
    """Both builders (the kernels with ``blocking``) equal the loop twin; the invariants hold, own_rows with the
    schedule fitting and not. Returns the Triton builder's schedule."""
    loop = build_pull_schedule_loop(top, rank, L, align=align)
    check_invariants(loop, top, rank)
    for within in (None, loop.capacity, int(loop.num_rows) - 1):
        want = loop if within is None else build_pull_schedule_loop(top, rank, L, align=align, own_rows_within=within)
        if within is not None:
            check_own_rows(want, top, rank, within)
        for backend in BACKENDS:
            got = build_pull_schedule(top, rank, L, align=align, check_ids=True, backend=backend,
                                      own_rows_within=within, blocking=blocking)
            assert_same(got, want)
    return build_pull_schedule(top, rank, L, align=align, backend="triton", blocking=blocking)


# name: (tokens per rank, k, L, align, p_none, rank)
CASES = {
    "one-rank": ((7,), 2, 4, 1, 0.2, 0),
    "one-rank-align128": ((7,), 2, 4, 128, 0.2, 0),
    "two-ranks-uneven": ((5, 9), 3, 2, 1, 0.2, 1),
    "three-ranks-align3": ((4, 0, 6), 2, 3, 3, 0.1, 2),
    "four-ranks-k8": ((6, 2, 6, 3), 8, 2, 1, 0.3, 1),
    "five-ranks-prime-L": ((3, 7, 1, 5, 4), 4, 5, 128, 0.2, 3),
    "eight-ranks-k1": ((9, 1, 4, 0, 7, 3, 8, 2), 1, 2, 1, 0.0, 5),
    "eight-ranks-align128": ((5, 6, 2, 7, 3, 4, 1, 6), 6, 3, 128, 0.25, 7),
    "many-no-routes": ((8, 8, 8), 4, 2, 4, 0.9, 0),
    # several blocks of route_block routes per rank (and sub-blocks), experts in more than one slice of 64
    "three-ranks-many-blocks": ((700, 300, 650), 4, 70, 8, 0.1, 1),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_loop_on_random_routings(case):
    tokens, k, L, align, p_none, rank = CASES[case]
    for seed in range(3):
        check_all(routing(seed, tokens, k, L * len(tokens), p_none=p_none), rank, L, align)


@pytest.mark.parametrize("blocking", [ScheduleBlocking(128, 32, 1), ScheduleBlocking(256, 64, 4)], ids=str)
def test_kernel_blocking_does_not_change_the_schedule(blocking):
    """Smaller route blocks (up to 22 per rank) summed a few earlier blocks at a time: the same schedule."""
    tokens, k, L, align, p_none, rank = CASES["three-ranks-many-blocks"]
    check_all(routing(7, tokens, k, L * len(tokens), p_none=p_none), rank, L, align, blocking=blocking)


def test_schedule_blocking_refuses_what_the_kernels_cannot_place():
    with pytest.raises(ValueError, match="power of two"):
        ScheduleBlocking(route_block=384)
    with pytest.raises(ValueError, match="at most route_block"):
        ScheduleBlocking(route_block=64, sub_block=128)


@settings(max_examples=15, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    k=st.integers(1, 8),
    L=st.integers(1, 4),
    align=st.sampled_from([1, 2, 5, 128]),
    p_none=st.sampled_from([0.0, 0.3, 0.8]),
    rank_seed=st.integers(0, 2**16),
)
def test_matches_loop_hypothesis(tokens, k, L, align, p_none, rank_seed):
    R = len(tokens)
    top = routing(rank_seed, tokens, k, L * R, p_none=p_none)
    check_all(top, rank_seed % R, L, align)


def test_zero_tokens():
    # N = 0 on every rank: only alignment padding, all -1.
    top = torch.empty(3, 0, 4, dtype=torch.int64)
    s = check_all(top, 1, 4, align=8)
    assert s.capacity == 4 * 7 and int(s.num_rows) == 0
    assert s.offsets.tolist() == [0, 0, 0, 0] and (s.src_rank == -1).all()


def test_one_token():
    top = torch.tensor([[[0, 3]], [[2, 2]]])  # rank 1 routes its token to expert 2 twice
    s = check_all(top, 1, 2)
    # local expert 0 (id 2): rank 1 routes 0 and 1; local expert 1 (id 3): rank 0 route 1
    assert s.src_rank.tolist() == [1, 1, 0, -1] and s.src_index.tolist() == [0, 1, 1, -1]


def test_all_tokens_to_one_expert():
    top = torch.full((4, 6, 1), 5)
    s = check_all(top, 2, 2, align=4)  # expert 5 = local expert 1 of rank 2
    assert s.tokens_per_expert.tolist() == [0, 24] and s.offsets.tolist() == [0, 0]
    assert s.src_rank.tolist() == [0, 1, 2, 3] * 6 + [-1] * 6


def test_expert_with_no_tokens():
    top = routing(3, (10, 10), 3, 6, p_none=0.0)
    top[top == 1] = 0  # local expert 1 of rank 0 gets nothing
    s = check_all(top, 0, 3, align=4)
    assert s.tokens_per_expert[1] == 0 and s.offsets[1] == s.offsets[2]
    assert s.expert_rows(1)[0].numel() == 0


def test_all_tokens_from_one_source_rank():
    top = routing(4, (0, 12, 0, 0), 2, 8, p_none=0.0)
    s = check_all(top, 0, 2)
    used = s.src_rank[s.src_rank >= 0]
    assert used.numel() > 0 and (used == 1).all()


def test_duplicate_expert_within_a_token():
    top = torch.tensor([[[1, 1, 1], [0, 1, 0]], [[1, -1, 1], [-1, -1, -1]]])
    s = check_all(top, 0, 2)
    assert s.counts.tolist() == [[2, 0], [4, 2]]
    # expert 1: level 0 (r0, r1), level 1 (r0, r1), then rank 0's last two routes
    assert s.expert_rows(1)[0].tolist() == [0, 1, 0, 1, 0, 0]
    assert s.expert_rows(1)[1].tolist() == [0, 0, 1, 2, 2, 4]


def test_every_token_to_every_expert():
    # k = E, each token visiting each expert once
    R, N, L = 3, 4, 2
    top = torch.arange(R * L).expand(R, N, R * L).contiguous()
    for rank in range(R):
        s = check_all(top, rank, L, align=3)
        assert s.counts.tolist() == [[N] * R] * L


@pytest.mark.parametrize("backend", BACKENDS)
def test_larger_routing_invariants(backend):
    top = routing(11, (700, 650, 512, 700), 8, 32, p_none=0.1)
    s = build_pull_schedule(top, 2, 8, align=16, backend=backend)
    check_invariants(s, top, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_and_dtype_independent(backend):
    top = routing(5, (300, 200, 257), 6, 12, p_none=0.1)
    a = build_pull_schedule(top, 1, 4, align=8, backend=backend)
    assert_same(a, build_pull_schedule(top, 1, 4, align=8, backend=backend))
    assert_same(a, build_pull_schedule(top.int(), 1, 4, align=8, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_static_shapes_and_dtypes(backend):
    # shapes depend only on (R, N, k, L, align), never on the routing
    for seed in range(3):
        s = build_pull_schedule(routing(seed, (5, 3), 2, 4), 0, 2, align=4, backend=backend)
        assert s.capacity == 2 * 5 * 2 + 2 * 3 and s.src_rank.shape == (s.capacity,)
        assert s.num_rows.dim() == 0
        for name in TENSOR_FIELDS:
            assert getattr(s, name).dtype == torch.int32, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_unchecked_out_of_range_ids_are_ignored(backend):
    top = torch.tensor([[[0, 7, -5], [1, 3, 2]]])
    s = build_pull_schedule(top, 0, 2, backend=backend)
    assert_same(s, build_pull_schedule_loop(top, 0, 2))
    assert s.tokens_per_expert.tolist() == [1, 1]


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((torch.zeros(4, 2, dtype=torch.int64), 0, 2), {}, "3-D"),
        (([[[0]]], 0, 2), {}, "3-D"),
        ((torch.zeros(1, 4, 2), 0, 2), {}, "int32 or int64"),
        ((torch.zeros(1, 4, 2, dtype=torch.int16), 0, 2), {}, "int32 or int64"),
        ((torch.zeros(1, 4, 0, dtype=torch.int64), 0, 2), {}, "k >= 1"),
        ((torch.zeros(0, 4, 2, dtype=torch.int64), 0, 2), {}, "R >= 1"),
        ((torch.zeros(2, 4, 2, dtype=torch.int64), 2, 2), {}, r"rank must be in \[0, R=2\), got 2"),
        ((torch.zeros(2, 4, 2, dtype=torch.int64), -1, 2), {}, "rank must be"),
        ((torch.zeros(2, 4, 2, dtype=torch.int64), 0, 0), {}, "experts_per_rank must be a positive int, got 0"),
        ((torch.zeros(2, 4, 2, dtype=torch.int64), 0, 2), {"align": 0}, "align must be a positive int, got 0"),
        ((torch.full((2, 4, 2), 4), 0, 2), {"check_ids": True}, r"ids in \[4, 4\]; allowed: -1 \(no route\) or 0..3"),
        ((torch.full((2, 4, 2), -2), 0, 2), {"check_ids": True}, r"ids in \[-2, -2\]"),
        ((torch.zeros(2, 4, 2, dtype=torch.int64), 0, 2), {"own_rows_within": 1.5}, "own_rows_within must be an int"),
    ],
)
@pytest.mark.parametrize("builder", [build_pull_schedule, build_pull_schedule_loop])
def test_bad_inputs(builder, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        builder(*args, **kwargs)


def test_schedule_checks_shapes_on_construction():
    s = build_pull_schedule(routing(0, (4, 4), 2, 4), 0, 2, align=2)
    fields = {name: getattr(s, name) for name in TENSOR_FIELDS + INT_FIELDS}
    PullSchedule(**fields)
    for name, value, match in [
        ("counts", s.counts[:, :1], r"counts must have shape \(2, 2\)"),
        ("src_index", s.src_index[:-1], "src_index must have shape"),
        ("offsets", s.offsets.long(), "offsets must be torch.int32"),
        ("num_rows", s.num_rows.view(1), "num_rows must have shape"),
        ("capacity", s.capacity + 1, "capacity must be R\\*N\\*k"),
        ("align", 0, "align must be a positive int"),
        ("own_rows", s.src_index[:5], r"own_rows must have shape \(8,\)"),
        ("own_rows", torch.zeros(8, dtype=torch.int64), "own_rows must be torch.int32"),
    ]:
        with pytest.raises(ValueError, match=match):
            PullSchedule(**{**fields, name: value})
    with pytest.raises(ValueError, match=r"local expert l must be in \[0, 2\)"):
        s.expert_rows(2)


def test_gather_routing_rejects_bad_ids_before_any_collective():
    with pytest.raises(ValueError, match="2-D"):
        gather_routing(torch.zeros(1, 2, 3, dtype=torch.int64), None, max_tokens=4)
    with pytest.raises(ValueError, match="int32 or int64"):
        gather_routing(torch.zeros(2, 3), None, max_tokens=4)
    with pytest.raises(ValueError, match="N=5 tokens, more than max_tokens=4"):
        gather_routing(torch.zeros(5, 3, dtype=torch.int64), None, max_tokens=4)


def _distributed_worker(ep_world, tokens, k, L, align):
    rank, world = ep_world.rank, ep_world.size
    full = routing(7, tokens, k, L * world)  # every process draws the same routing
    mine = full[rank, : tokens[rank]]
    assert torch.equal(gather_routing(mine, None), full)
    got = build_pull_schedule_distributed(mine, None, L, align=align)
    assert_same(got, build_pull_schedule(full, rank, L, align=align))
    wider = torch.cat([full, torch.full((world, 3, k), -1)], dim=1)
    got = build_pull_schedule_distributed(mine.int(), None, L, max_tokens=max(tokens) + 3, align=align)
    assert_same(got, build_pull_schedule(wider, rank, L, align=align))
    with pytest.raises(ValueError, match="more than max_tokens"):
        gather_routing(mine, None, max_tokens=min(tokens) - 1)


def test_distributed_matches_concatenated_routing():
    launch(_distributed_worker, 2, (3, 6), 2, 3, 4)


def test_bad_backend():
    with pytest.raises(ValueError, match="backend must be 'triton', 'torch' or None, got 'cuda'"):
        build_pull_schedule(torch.zeros(2, 4, 2, dtype=torch.int64), 0, 2, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_matches_cpu_and_captures_in_a_graph(backend):
    top = routing(1, (50, 40, 64), 4, 12).cuda()
    s = build_pull_schedule(top, 1, 4, align=8, backend=backend)
    assert_same(s, build_pull_schedule_loop(top, 1, 4, align=8))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        build_pull_schedule(top, 1, 4, align=8, backend=backend)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = build_pull_schedule(top, 1, 4, align=8, backend=backend)
    other = routing(2, (50, 40, 64), 4, 12).cuda()
    top.copy_(other)
    graph.replay()
    torch.cuda.synchronize()
    assert_same(captured, build_pull_schedule_loop(other, 1, 4, align=8))


@pytest.mark.gpu
@pytest.mark.parametrize("ranks, experts_per_rank", [(2, 192), (1, 384), (8, 48)])
def test_cuda_builders_agree_at_model_scale(ranks, experts_per_rank):
    # kimi-k2's 384 experts at 8192 tokens x 8 routes per rank; rank 0 of R, one rank skewed to one expert
    top = routing(7, (8192,) * ranks, 8, ranks * experts_per_rank, p_none=0.0).cuda()
    top[-1, :4096] = 0
    for align in (1, 128):
        triton_built = build_pull_schedule(top, 0, experts_per_rank, align=align, backend="triton")
        assert_same(triton_built, build_pull_schedule(top, 0, experts_per_rank, align=align, backend="torch"))
