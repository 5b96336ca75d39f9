"""Row tiles heaviest expert first, dealt from both ends of the list (``megamoe.ops.launch.TWO_ENDED_TILES``)."""

import pytest
import torch
import triton
import triton.language as tl

from megamoe.kernels.tasks import two_ended
from megamoe.ops import launch
from megamoe.ops.experts import expert_forward
from megamoe.ops.experts_bwd import expert_backward
from megamoe.routing.row_tiles import build_row_tiles

from loads import DEVICE, in_regions, regions  # tests/loads.py
from test_experts import TILE_BACKENDS, expected_runs  # tests/test_experts.py


def _tiles(tiles) -> list[tuple[int, int, int]]:
    n = int(tiles.num_tiles)
    return [(int(e), int(r), int(x)) for e, r, x in zip(tiles.tile_expert[:n], tiles.tile_row0[:n],
                                                        tiles.tile_row_end[:n])]


@pytest.mark.parametrize("backend", TILE_BACKENDS)
def test_heavy_first_tiles_take_the_regions_by_tile_count_most_first(backend):
    counts = torch.tensor([5, 0, 40, 33, 1, 17], device=DEVICE)  # tiles of 16 rows: 1, 0, 3, 3, 1, 2
    offsets = torch.tensor([0, 8, 8, 50, 90, 91], device=DEVICE)
    tiles = build_row_tiles(counts, offsets, capacity=110, block_m=16, backend=backend, heavy_first=True)
    assert tiles.heavy_first
    # experts 2 and 3 (3 tiles; ties in expert order), 5 (2), 0 and 4 (1); each region's rows in order
    assert _tiles(tiles) == [(2, 8, 24), (2, 24, 40), (2, 40, 48), (3, 50, 66), (3, 66, 82), (3, 82, 83),
                             (5, 91, 107), (5, 107, 108), (0, 0, 5), (4, 90, 91)]
    assert tiles.tile_run[:10].tolist() == expected_runs(tiles)
    assert tiles.minibatch_tiles.tolist() == [0, 10]


def test_heavy_first_tile_builders_agree_on_random_layouts():
    gen = torch.Generator().manual_seed(1)
    for _ in range(25):
        experts = int(torch.randint(1, 9, (), generator=gen))
        block_m = (16, 32)[int(torch.randint(2, (), generator=gen))]
        counts = torch.randint(0, 101, (experts,), generator=gen) * (torch.rand(experts, generator=gen) > 0.3)
        offsets = counts.cumsum(0) - counts
        capacity = int(counts.sum()) + int(torch.randint(0, 51, (), generator=gen))
        cut = bool(torch.randint(2, (), generator=gen))
        cut = torch.tensor([cut], device=DEVICE) if torch.randint(2, (), generator=gen) else cut
        built = [build_row_tiles(counts.to(DEVICE), offsets.to(DEVICE), capacity, block_m, cut=cut, backend=b,
                                 heavy_first=True) for b in TILE_BACKENDS]
        plain = build_row_tiles(counts.to(DEVICE), offsets.to(DEVICE), capacity, block_m, backend="torch")
        n = int(plain.num_tiles)
        for tiles in built:
            assert int(tiles.num_tiles) == n and tiles.minibatch_tiles.tolist() == [0, n]
            assert sorted(_tiles(tiles)) == sorted(_tiles(plain)), counts  # the same tiles, reordered
            sizes = [int((counts[e] + block_m - 1) // block_m) for e, _, _ in _tiles(tiles)]
            assert sizes == sorted(sizes, reverse=True), counts
            assert tiles.tile_run[:n].tolist() == expected_runs(tiles), counts
        for name in ("tile_expert", "tile_row0", "tile_row_end", "tile_run"):
            assert torch.equal(getattr(built[0], name)[:n], getattr(built[1], name)[:n]), (name, counts)


def test_heavy_first_takes_one_minibatch():
    counts, offsets = torch.tensor([5, 40]), torch.tensor([0, 5])
    with pytest.raises(ValueError, match="one minibatch"):
        build_row_tiles(counts, offsets, 45, 16, minibatch=24, heavy_first=True)


@triton.jit
def _two_ended_kernel(out_ptr, num_tasks):
    for task in range(num_tasks):
        tl.store(out_ptr + task, two_ended(task, num_tasks))


def test_two_ended_deals_every_task_once_alternating_ends():
    for num_tasks in range(1, 10):
        out = torch.full((num_tasks,), -1, dtype=torch.int32, device=DEVICE)
        _two_ended_kernel[(1,)](out, num_tasks)
        picks = out.tolist()
        assert sorted(picks) == list(range(num_tasks)), picks
        assert picks[0::2] == list(range(len(picks[0::2]))), picks  # the front, in order
        assert picks[1::2] == list(range(num_tasks - 1, num_tasks - 1 - len(picks[1::2]), -1)), picks  # the back


def test_two_ended_tiles_give_the_same_bits(monkeypatch):
    """The expert forward and backward with their tiles heaviest first and dealt from both ends against the
    list in expert order: every bit (each tile is one program's whenever it runs), on a skewed load with an empty
    expert and partial tiles, an even number of programs (each walks one end)."""
    built = []
    real = launch.build_row_tiles

    def spy(*args, **kwargs):
        built.append(kwargs.get("heavy_first"))
        return real(*args, **kwargs)

    monkeypatch.setattr(launch, "build_row_tiles", spy)
    g = torch.Generator().manual_seed(21)
    counts, offsets, rows = regions([3, 90, 0, 40, 7, 64, 1], 2)
    d, i = 64, 48
    x = torch.randn(rows, d, generator=g).bfloat16().to(DEVICE)
    wgu = (torch.randn(len(counts), 2 * i, d, generator=g) / d**0.5).bfloat16().to(DEVICE)
    wd = (torch.randn(len(counts), d, i, generator=g) / i**0.5).bfloat16().to(DEVICE)
    dy = torch.randn(rows, d, generator=g).bfloat16().to(DEVICE)
    w = torch.rand(rows, generator=g).to(DEVICE)
    counts, offsets = counts.to(DEVICE), offsets.to(DEVICE)
    runs = []
    for on in (False, True):
        monkeypatch.setattr(launch, "TWO_ENDED_TILES", on)
        built.clear()
        fwd = expert_forward(x, counts, offsets, wgu, wd, num_programs=4)
        bwd = expert_backward(dy, w, x, fwd.h, counts, offsets, wgu, wd, num_programs=4)
        assert built and set(built) == {on}, built  # every row-tile launch took the order asked for
        runs.append((fwd, bwd))
    inside = in_regions(counts, offsets, rows)
    (f0, b0), (f1, b1) = runs
    for name in ("h", "act", "y"):
        assert torch.equal(getattr(f0, name)[inside], getattr(f1, name)[inside]), name
    for name in ("d_x", "d_router"):
        assert torch.equal(getattr(b0, name)[inside], getattr(b1, name)[inside]), name
    for name in ("d_w_gate_up", "d_w_down"):
        assert torch.equal(getattr(b0, name), getattr(b1, name)), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
def test_gpu_two_ended_tiles_give_the_same_bits(monkeypatch):
    """The Gluon forward and dact (Hopper's defaults) and the Triton down and dx with the tiles heaviest first and
    dealt from both ends: every bit of the expert-order run, on a skewed load of more tasks than programs."""
    g = torch.Generator(device="cuda").manual_seed(22)
    counts = torch.tensor([700, 0, 33, 129, 5, 2000, 131, 1], dtype=torch.int32, device="cuda")
    offsets = (counts.cumsum(0) - counts).to(torch.int32)
    rows, d, i = int(counts.sum()), 448, 320
    x = torch.randn(rows, d, generator=g, device="cuda").bfloat16()
    wgu = (torch.randn(len(counts), 2 * i, d, generator=g, device="cuda") / d**0.5).bfloat16()
    wd = (torch.randn(len(counts), d, i, generator=g, device="cuda") / i**0.5).bfloat16()
    dy = torch.randn(rows, d, generator=g, device="cuda").bfloat16()
    w = torch.rand(rows, generator=g, device="cuda")
    runs = []
    for on in (False, True):
        monkeypatch.setattr(launch, "TWO_ENDED_TILES", on)
        fwd = expert_forward(x, counts, offsets, wgu, wd, num_programs=6)
        runs.append((fwd, expert_backward(dy, w, x, fwd.h, counts, offsets, wgu, wd, num_programs=6)))
    torch.cuda.synchronize()
    (f0, b0), (f1, b1) = runs
    for name in ("h", "act", "y"):
        assert torch.equal(getattr(f0, name), getattr(f1, name)), name
    for name in ("d_x", "d_router", "d_w_gate_up", "d_w_down"):
        a, b = getattr(b0, name), getattr(b1, name)
        assert torch.equal(a, b), f"{name}: {int((a != b).sum())} elements differ"


@pytest.mark.parametrize("fmt", ["fp8-block", "mxfp8"])
def test_two_ended_tiles_give_the_fp8_backwards_bits(fmt, monkeypatch):
    """The FP8 backwards' row-tile kernels (dact, dx) with the tiles heaviest first and dealt from both ends: the
    bits of the expert-order run (mxfp8 as its own tiles and as the BF16 kernels, whichever the switch picks)."""
    from megamoe.ops.experts_fp8_bwd import expert_backward_fp8_block, expert_backward_mxfp8

    backward = expert_backward_fp8_block if fmt == "fp8-block" else expert_backward_mxfp8
    built = []
    real = launch.build_row_tiles
    monkeypatch.setattr(launch, "build_row_tiles",
                        lambda *a, **k: built.append(k.get("heavy_first")) or real(*a, **k))
    g = torch.Generator().manual_seed(23)
    counts, offsets, rows = regions([3, 140, 0, 40, 7, 1], 2)
    d, i = 256, 128
    t = dict(dy=torch.randn(rows, d, generator=g).bfloat16(), w=torch.rand(rows, generator=g),
             x=torch.randn(rows, d, generator=g).bfloat16(), h=(torch.randn(rows, 2 * i, generator=g) * 2).bfloat16(),
             wgu=(torch.randn(len(counts), 2 * i, d, generator=g) / d**0.5).bfloat16(),
             wd=(torch.randn(len(counts), d, i, generator=g) / i**0.5).bfloat16())
    t = {k: v.to(DEVICE) for k, v in t.items()}
    counts, offsets = counts.to(DEVICE), offsets.to(DEVICE)
    runs = []
    for on in (False, True):
        monkeypatch.setattr(launch, "TWO_ENDED_TILES", on)
        built.clear()
        runs.append(backward(t["dy"], t["w"], t["x"], t["h"], counts, offsets, t["wgu"], t["wd"], num_programs=4))
        assert built and set(built) == {on}, built
    inside = in_regions(counts, offsets, rows)
    for name in ("d_x", "d_router"):
        assert torch.equal(getattr(runs[0], name)[inside], getattr(runs[1], name)[inside]), name
    for name in ("d_w_gate_up", "d_w_down"):
        assert torch.equal(getattr(runs[0], name), getattr(runs[1], name)), name
