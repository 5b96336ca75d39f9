"""The backward's windows (megamoe.routing.windows) against their plain-Python twins, and their invariants: the
windows tile the schedule's rows in order, each fits its ring, an expert is cut only at multiples of 128 of its
own rows, and the weight-gradient modes start every expert once, carry it across each cut and store it once."""

import random

import pytest
import torch

from megamoe.routing.schedule import build_pull_schedule
from megamoe.routing.windows import (CARRY_IN, CARRY_OUT, STORE, WINDOW_ALIGN, check_ring, max_windows,
                                     schedule_window, schedule_window_reference, window_cuts,
                                     window_cuts_reference, window_rows)


def _schedule(counts_per_expert, ranks=2, k=2, rank=0, seed=0):
    """A pull schedule of ``rank`` whose local experts get about ``counts_per_expert`` rows (ids built to match)."""
    g = random.Random(seed)
    L = len(counts_per_expert)
    routes = [e for e, c in enumerate(counts_per_expert) for _ in range(c)]
    g.shuffle(routes)
    n = -(-max(len(routes), 1) // (ranks * k))
    ids = torch.full((ranks, n, k), -1, dtype=torch.int32)
    flat = ids.view(-1)
    flat[: len(routes)] = torch.tensor(routes, dtype=torch.int32) + rank * L
    return build_pull_schedule(ids, rank, L)


CASES = [
    ("balanced", [40, 35, 50, 45], 128),
    ("one expert larger than the ring", [0, 700, 3, 0], 128),
    ("an expert spanning many windows", [5, 1000, 20], 256),
    ("every row to one expert", [0, 0, 513, 0], 128),
    ("empty", [0, 0, 0], 128),
    ("ring larger than the rows", [10, 20], 1024),
    ("cut inside and at region edges", [128, 256, 127, 129, 1], 128),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name, counts, ring", CASES)
def test_windows_tile_the_rows_and_cut_experts_at_multiples_of_128(name, counts, ring, backend):
    """Both builders (the kernel under the interpreter here) against the plain-Python twins."""
    s = _schedule(counts)
    offsets, tokens = s.offsets.tolist(), s.tokens_per_expert.tolist()
    num_rows = int(s.num_rows)
    windows = max_windows(s.capacity, ring)
    cuts = window_cuts(s, ring)
    assert cuts.tolist() == window_cuts_reference(offsets, tokens, num_rows, ring, windows), name
    c = cuts.tolist()
    assert c[0] == 0 and c[-1] == num_rows and all(a <= b for a, b in zip(c, c[1:]))
    for lo, hi in zip(c, c[1:]):
        assert hi - lo < window_rows(ring) - 0  # fits the ring's rows
        for start, count in zip(offsets, tokens):
            if start < hi < start + count:  # a cut inside a region: at a multiple of 128 of its rows
                assert (hi - start) % WINDOW_ALIGN == 0, (name, hi, start)
    starts, stores, rows = {}, {}, {}
    for w in range(windows):
        win = schedule_window(s, w, ring, backend=backend)
        assert torch.equal(win.rows[: win.capacity], (c[w] + torch.arange(win.capacity)).clamp(max=max(s.capacity - 1, 0)))
        assert win.capacity == window_rows(ring) and int(win.start) == c[w] and int(win.num_rows) == c[w + 1] - c[w]
        want = schedule_window_reference(offsets, tokens, c[w], c[w + 1], w == 0)
        got = list(zip(win.offsets.tolist(), win.tokens_per_expert.tolist(), win.wgrad_modes.tolist()))
        assert got == want, (name, w)
        q = int(win.num_rows)
        assert torch.equal(win.src_rank[:q], s.src_rank[c[w]: c[w + 1]])
        assert torch.equal(win.src_index[:q], s.src_index[c[w]: c[w + 1]])
        assert bool((win.src_rank[q:] == -1).all()) and bool((win.src_index[q:] == -1).all())
        for l, (off, count, mode) in enumerate(got):
            rows[l] = rows.get(l, 0) + count
            if mode & CARRY_IN:
                assert l in starts, (name, w, l)  # its rows began in an earlier window
            elif count or mode & STORE:
                assert l not in starts, (name, w, l)  # the first window with its rows starts it from zeros
                starts[l] = w
            if mode & STORE:
                stores[l] = stores.get(l, 0) + 1
            assert not (mode & STORE and mode & CARRY_OUT)
    assert rows == {l: t for l, t in enumerate(tokens)}  # every row in exactly one window
    assert stores == {l: 1 for l in range(len(tokens))}, (name, stores)  # every expert's gradient written once


def test_a_ring_is_a_positive_multiple_of_128():
    check_ring(256)
    for bad in (0, 64, 200, -128, 128.0, True):
        with pytest.raises(ValueError, match="multiple of 128"):
            check_ring(bad)
    assert max_windows(1000, 128) == 8 and max_windows(0, 128) == 1


def test_gather_rows_copies_the_rows_below_a_device_count_and_nothing_else():
    """The windows' reads of the forward ring (megamoe.ops.gather_rows) against the torch twin: bf16, E4M3 bytes
    and fp32 scales, 0 rows, a partial block, every row; rows past the count keep their poison."""
    from megamoe.ops.gather_rows import gather_rows, gather_rows_reference

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.uint8, torch.float32):
        src = (torch.randn(50, 96, generator=g) * 10).to(dtype)
        index = torch.randint(0, 50, (70,), generator=g)
        for rows in (0, 1, 33, 70):
            got = torch.full((70, 96), 7).to(dtype)
            want = gather_rows_reference(src, index, rows, got.clone())
            gather_rows(src, index, torch.tensor(rows, dtype=torch.int32), got)
            assert torch.equal(got, want), (dtype, rows)
    with pytest.raises(ValueError, match="one width and dtype"):
        gather_rows(torch.zeros(4, 8), torch.zeros(4, dtype=torch.int64), torch.tensor(4), torch.zeros(4, 9))
