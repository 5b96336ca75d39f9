"""Grouped expert GEMM tiles (gate/up + SwiGLU, down) against the torch twin."""

import itertools

import pytest
import torch
import triton
import triton.language as tl

from megamoe.kernels.tasks import row_tile_task
from megamoe.planner.tiles import FEW_ROWS_PER_EXPERT, TileConfig, ping_pong_tile, plan_tiles, wgrad_ws_stages
from megamoe.planner.tuning import Tuning
from megamoe.routing.row_tiles import build_row_tiles
from megamoe.ops.experts import down, expert_forward, expert_forward_reference, gate_up

from kinds import EVERY_KIND  # tests/kinds.py
from loads import DEVICE, LOADS, in_regions, regions  # tests/loads.py
from sm90 import sm90_report  # tests/sm90.py


def _problem(counts, gap, d=128, i=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts, offsets, rows = regions(counts, gap)
    x = torch.randn(rows, d, generator=g).bfloat16()
    wgu = (torch.randn(len(counts), 2 * i, d, generator=g) / d**0.5).bfloat16()
    wd = (torch.randn(len(counts), d, i, generator=g) / i**0.5).bfloat16()
    return tuple(t.to(DEVICE) for t in (x, counts, offsets, wgu, wd))


def _poisoned_like(ref):
    from megamoe.ops.experts import ExpertForward

    return ExpertForward(*(torch.full_like(getattr(ref, n), float("nan"), dtype=torch.bfloat16) for n in ("h", "act", "y")))


#: (D, I): multiples of the CPU tiles (32), and neither (every GEMM gets partial n- and output tiles).
SHAPES = {"aligned": (128, 96), "ragged": (136, 40)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("activation", EVERY_KIND, ids=lambda a: a.kind)
def test_forward_tiles_match_reference_and_write_only_their_rows(load, activation, shape):
    x, counts, offsets, wgu, wd = _problem(*LOADS[load], *SHAPES[shape])
    ref = expert_forward_reference(x, counts, offsets, wgu, wd, activation=activation)
    out = expert_forward(x, counts, offsets, wgu, wd, activation=activation, out=_poisoned_like(ref), num_programs=3)
    for name in ("h", "act", "y"):
        got, want = getattr(out, name).float(), getattr(ref, name)
        inside = ~want.isnan()
        assert torch.equal(got.isnan(), want.isnan()), f"{name}: written rows differ from the expert regions"
        if inside.any():
            err = (got[inside] - want[inside]).abs().max()
            assert err <= 2e-2 * max(1.0, float(want[inside].abs().max())), f"{name}: max error {err}"


def test_tile_shapes_and_grid_size_do_not_change_the_result():
    x, counts, offsets, wgu, wd = _problem(*LOADS["mixed"])
    base = expert_forward(x, counts, offsets, wgu, wd, num_programs=4)
    tiles = {"gate_up": TileConfig(16, 64, 32, num_warps=4, num_stages=1, group_m=3),
             "down": TileConfig(64, 16, 64, num_warps=4, num_stages=1, group_m=1)}
    other = expert_forward(x, counts, offsets, wgu, wd, num_programs=1, tuning=Tuning(**tiles))
    for name in ("h", "act", "y"):
        a, b = getattr(base, name), getattr(other, name)
        inside = in_regions(counts, offsets, a.shape[0])
        torch.testing.assert_close(a[inside].float(), b[inside].float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_few_row_tiles_give_the_same_bits():
    """Experts with few rows get 64-row tiles from the planner (by default: this load's mean is 91 rows):
    every region row written, the same bits as the 128-row tiles, close to the reference."""
    x, counts, offsets, wgu, wd = _problem([170, 0, 171, 3, 64, 65, 128, 129], 5, d=512, i=256)
    few = {kind: plan_tiles(kind, DEVICE, rows_per_expert=100) for kind in ("gate_up", "down")}
    assert few["gate_up"].block_m == few["down"].block_m == 64
    assert plan_tiles("gate_up", DEVICE, rows_per_expert=300).block_m == 128
    ref = expert_forward_reference(x, counts, offsets, wgu, wd)
    wide = expert_forward(x, counts, offsets, wgu, wd, out=_poisoned_like(ref), rows_per_expert=300)
    narrow = expert_forward(x, counts, offsets, wgu, wd, out=_poisoned_like(ref))
    for name in ("h", "act", "y"):
        a, b, want = getattr(wide, name), getattr(narrow, name), getattr(ref, name)
        assert torch.equal(b.isnan(), want.isnan()), f"{name}: written rows differ from the expert regions"
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), name
        inside = ~want.isnan()
        assert (b.float()[inside] - want[inside]).abs().max() <= 2e-2 * max(1.0, float(want[inside].abs().max()))


def test_ping_pong_tiles_only_for_128_row_tiles_at_short_k():
    """``ping_pong_tile``: the planned 128-row down / dx tile at K up to its bound becomes 128 x 128 with 6 slots
    (its K step and task order kept); 64-row tiles, longer K and other kinds get none or an error."""
    from megamoe.planner.tiles import PING_PONG_MAX_K

    gpu = torch.device("cuda")
    for kind in ("down", "dx"):
        tile = plan_tiles(kind, gpu, compiled=True)
        bound = PING_PONG_MAX_K[kind]
        pp = ping_pong_tile(kind, tile, bound)
        assert (pp.block_m, pp.block_n, pp.num_stages) == (128, 128, 6), pp
        assert (pp.block_k, pp.group_m) == (tile.block_k, tile.group_m)
        assert ping_pong_tile(kind, tile, bound + 8) is None
        assert ping_pong_tile(kind, plan_tiles(kind, gpu, 170, compiled=True), 256) is None  # 64-row tiles
    assert PING_PONG_MAX_K["dx"] >= PING_PONG_MAX_K["down"]  # the same products, twice the K steps
    with pytest.raises(ValueError, match="ping-pong tiles are for"):
        ping_pong_tile("gate_up", plan_tiles("gate_up", gpu, compiled=True), 256)


def test_compiled_plan_by_rows_per_expert():
    """The GPU plan (``compiled``: on any device): at <= FEW_ROWS_PER_EXPERT rows per expert 64-row forward and dx
    tiles and BK 64 wgrad blocks; above it, or without a load, 128-row tiles and BK 32."""
    gpu = torch.device("cuda")
    for rows in (170, FEW_ROWS_PER_EXPERT):
        assert {plan_tiles(kind, gpu, rows, compiled=True).block_m for kind in ("gate_up", "down", "dx")} == {64}
        assert plan_tiles("wgrad", gpu, rows, compiled=True).block_k == 64
    for rows in (None, FEW_ROWS_PER_EXPERT + 1, 341):
        assert {plan_tiles(kind, gpu, rows, compiled=True).block_m
                for kind in ("gate_up", "down", "dx", "wgrad")} == {128}
        assert plan_tiles("wgrad", gpu, rows, compiled=True).block_k == 32


def test_the_gluon_wgrad_ring_is_as_deep_as_its_shared_memory_allows():
    """``wgrad_ws_stages``: 6 / 3 slots at BK 32 / 64 beside two 64 x 256 output buffers, 8 / 4 beside the split
    store's four 64 x 64 ones; each ring fits with its buffers in the 227 KB a block may take, one slot more would
    not."""
    from megamoe.planner.tiles import HOPPER_SHARED_BYTES

    for block_k, split, want in ((32, False, 6), (64, False, 3), (32, True, 8), (64, True, 4)):
        stages = wgrad_ws_stages(256, block_k, split)
        slot = (128 * block_k + block_k * 256) * 2 + 16
        outputs = 2 * 64 * (128 if split else 256) * 2
        assert stages == want and stages * slot + outputs <= HOPPER_SHARED_BYTES < (stages + 1) * slot + outputs


def test_forward_ops_plan_their_tiles_for_the_loads_mean_rows():
    """gate/up and down ask the planner for rows / experts by default, and for the caller's mean when given
    (a capacity's rows are not the load's)."""
    from recording_tuning import RecordingTuning  # tests/recording_tuning.py

    tuning = RecordingTuning()
    x, counts, offsets, wgu, wd = _problem([40, 0, 17, 33], 3)
    rows = x.shape[0]
    expert_forward(x, counts, offsets, wgu, wd, tuning=tuning)
    expert_forward(x, counts, offsets, wgu, wd, rows_per_expert=170.0, tuning=tuning)
    asked = tuning.asked
    assert asked == [("gate_up", rows / 4), ("down", rows / 4), ("gate_up", 170.0), ("down", 170.0)], asked


TILE_BACKENDS = ("triton", "torch")


@pytest.mark.parametrize("backend", TILE_BACKENDS)
def test_row_tiles_cover_every_region_once(backend):
    counts = torch.tensor([5, 0, 40, 33, 1], device=DEVICE)
    offsets = torch.tensor([0, 8, 8, 50, 90], device=DEVICE)
    tiles = build_row_tiles(counts, offsets, capacity=100, block_m=16, backend=backend)
    n = int(tiles.num_tiles)
    assert n == 1 + 0 + 3 + 3 + 1
    got = [(int(e), int(r), int(x)) for e, r, x in zip(tiles.tile_expert[:n], tiles.tile_row0[:n],
                                                        tiles.tile_row_end[:n])]
    assert got == [(0, 0, 5), (2, 8, 24), (2, 24, 40), (2, 40, 48), (3, 50, 66), (3, 66, 82), (3, 82, 83),
                   (4, 90, 91)]
    assert tiles.minibatch_tiles.tolist() == [0, n]


@pytest.mark.parametrize("backend", TILE_BACKENDS)
def test_minibatch_tiles_never_straddle_a_minibatch_and_cover_each_row_once(backend):
    counts = torch.tensor([5, 0, 40, 33, 1, 17], device=DEVICE)
    offsets = torch.tensor([0, 8, 8, 50, 90, 91], device=DEVICE)
    tiles = build_row_tiles(counts, offsets, capacity=110, block_m=16, minibatch=24, backend=backend)
    n = int(tiles.num_tiles)
    bounds = tiles.minibatch_tiles.tolist()
    assert len(bounds) == 1 + 5 and bounds[0] == 0 and bounds[-1] == n
    covered = []
    for j in range(5):
        for t in range(bounds[j], bounds[j + 1]):
            e, r0, r1 = int(tiles.tile_expert[t]), int(tiles.tile_row0[t]), int(tiles.tile_row_end[t])
            assert 0 < r1 - r0 <= 16 and j * 24 <= r0 and r1 <= (j + 1) * 24, (j, r0, r1)
            assert offsets[e] <= r0 and r1 <= offsets[e] + counts[e], (e, r0, r1)
            covered += range(r0, r1)
    want = [r for o, c in zip(offsets.tolist(), counts.tolist()) for r in range(o, o + c)]
    assert sorted(covered) == want


@pytest.mark.parametrize("backend", TILE_BACKENDS)
def test_uncut_minibatch_tiles_are_the_regions_tiles_grouped_by_their_first_row(backend):
    counts = torch.tensor([5, 0, 40, 33, 1, 17], device=DEVICE)
    offsets = torch.tensor([0, 8, 8, 50, 90, 91], device=DEVICE)
    whole = build_row_tiles(counts, offsets, capacity=110, block_m=16, backend=backend)
    tiles = build_row_tiles(counts, offsets, capacity=110, block_m=16, minibatch=24, cut=False, backend=backend)
    n = int(whole.num_tiles)
    assert int(tiles.num_tiles) == n
    for name in ("tile_expert", "tile_row0", "tile_row_end"):
        assert torch.equal(getattr(tiles, name)[:n], getattr(whole, name)[:n]), name
    row0 = whole.tile_row0[:n].tolist()  # 0, 8, 24, 40, 50, 66, 82, 90, 91, 107
    assert tiles.minibatch_tiles.tolist() == [sum(r < j * 24 for r in row0) for j in range(6)] == [0, 2, 4, 6, 9, 10]
    # runs: expert 2's tiles 1-3 start in minibatches 0, 1, 1; expert 5's tiles 8-9 in 3 and 4
    assert whole.tile_run[:n].tolist() == [[0, 1], [1, 4], [1, 4], [1, 4], [4, 7], [4, 7], [4, 7], [7, 8],
                                           [8, 10], [8, 10]]
    assert tiles.tile_run[:n].tolist() == expected_runs(tiles) == [
        [0, 1], [1, 2], [2, 4], [2, 4], [4, 6], [4, 6], [6, 7], [7, 8], [8, 9], [9, 10]]


def expected_runs(tiles) -> list[list[int]]:
    """[first, end) of each tile's run: the maximal span of consecutive tiles of one expert and minibatch."""
    n = int(tiles.num_tiles)
    bounds = tiles.minibatch_tiles.tolist()
    key = [(int(tiles.tile_expert[t]), max(j for j in range(len(bounds) - 1) if bounds[j] <= t)) for t in range(n)]
    runs = []
    for t in range(n):
        first, end = t, t + 1
        while first > 0 and key[first - 1] == key[t]:
            first -= 1
        while end < n and key[end] == key[t]:
            end += 1
        runs.append([first, end])
    return runs


def test_row_tile_builders_agree_on_random_layouts():
    gen = torch.Generator().manual_seed(0)
    for _ in range(25):
        experts = int(torch.randint(1, 7, (), generator=gen))
        block_m = (16, 32)[int(torch.randint(2, (), generator=gen))]
        align = (1, 16, 32)[int(torch.randint(3, (), generator=gen))]
        counts = torch.randint(0, 101, (experts,), generator=gen) * (torch.rand(experts, generator=gen) > 0.3)
        padded = (counts + align - 1) // align * align
        offsets = padded.cumsum(0) - padded
        capacity = int(padded.sum()) + int(torch.randint(0, 51, (), generator=gen))
        minibatch = (None, 8, 24, 64, 100)[int(torch.randint(5, (), generator=gen))]
        cut = bool(torch.randint(2, (), generator=gen))
        cut = torch.tensor([cut], device=DEVICE) if torch.randint(2, (), generator=gen) else cut  # read on device
        a, b = (build_row_tiles(counts.to(DEVICE), offsets.to(DEVICE), capacity, block_m, minibatch=minibatch,
                                cut=cut, backend=backend) for backend in TILE_BACKENDS)
        n = int(b.num_tiles)
        assert int(a.num_tiles) == n and torch.equal(a.minibatch_tiles, b.minibatch_tiles)
        for name in ("tile_expert", "tile_row0", "tile_row_end", "tile_run"):
            assert torch.equal(getattr(a, name)[:n], getattr(b, name)[:n]), (name, counts, capacity, minibatch, cut)
        assert a.tile_run[:n].tolist() == expected_runs(a), (counts, capacity, minibatch, cut)
    with pytest.raises(ValueError, match="backend must be"):
        build_row_tiles(counts, offsets, capacity, 16, backend="numpy")


@pytest.mark.parametrize("backend", TILE_BACKENDS)
def test_a_device_cut_flag_picks_either_layout(backend):
    counts = torch.tensor([5, 0, 40, 33, 1, 17], device=DEVICE)
    offsets = torch.tensor([0, 8, 8, 50, 90, 91], device=DEVICE)
    for cut in (True, False):
        want = build_row_tiles(counts, offsets, 110, 16, minibatch=24, cut=cut, backend=backend)
        got = build_row_tiles(counts, offsets, 110, 16, minibatch=24, cut=torch.tensor([cut], device=DEVICE),
                              backend=backend)
        n = int(want.num_tiles)
        assert int(got.num_tiles) == n and torch.equal(got.minibatch_tiles, want.minibatch_tiles)
        for name in ("tile_expert", "tile_row0", "tile_row_end", "tile_run"):
            assert torch.equal(getattr(got, name)[:n], getattr(want, name)[:n]), (cut, name)


@triton.jit
def _task_order_kernel(tile_run_ptr, minibatch_tiles_ptr, out_ptr, num_n, GROUP_M: tl.constexpr):
    """Program j writes (tile, n-tile) of each of minibatch j's tasks, in task order."""
    j = tl.program_id(0)
    t0 = tl.load(minibatch_tiles_ptr + j)
    for task in range((tl.load(minibatch_tiles_ptr + j + 1) - t0) * num_n):
        tile, n = row_tile_task(task, num_n, t0, tile_run_ptr, GROUP_M)
        tl.store(out_ptr + 2 * (t0 * num_n + task), tile)
        tl.store(out_ptr + 2 * (t0 * num_n + task) + 1, n)


@pytest.mark.parametrize("cut", (True, False))
def test_tasks_walk_groups_inside_each_run_n_tile_outer(cut):
    """Every task is one (tile, n-tile), each once; a group is at most GROUP_M tiles of one run, and the
    programs running at once share its weight slice (n-tile outer)."""
    counts = torch.tensor([5, 0, 90, 33, 1, 17, 64], device=DEVICE)
    offsets = torch.tensor([0, 8, 8, 98, 131, 132, 149], device=DEVICE)
    tiles = build_row_tiles(counts, offsets, capacity=220, block_m=16, minibatch=48, cut=cut)
    n, num_n, group = int(tiles.num_tiles), 3, 2
    out = torch.full((n * num_n, 2), -1, dtype=torch.int32, device=DEVICE)
    _task_order_kernel[(len(tiles.minibatch_tiles) - 1,)](tiles.tile_run, tiles.minibatch_tiles, out, num_n,
                                                          GROUP_M=group)
    want = []
    for first, end in sorted({tuple(r) for r in expected_runs(tiles)}):
        for g in range(first, end, group):
            want += [[t, k] for k in range(num_n) for t in range(g, min(g + group, end))]
    assert out.tolist() == want
    assert max(end - first for first, end in tiles.tile_run[:n].tolist()) > group  # a run of several groups


def test_forward_over_minibatch_tiles_gives_the_same_bits():
    x, counts, offsets, wgu, wd = _problem(*LOADS["mixed"], seed=4)
    plain = expert_forward(x, counts, offsets, wgu, wd, num_programs=3)
    cut = expert_forward(x, counts, offsets, wgu, wd, num_programs=3, minibatch=24)
    inside = in_regions(counts, offsets, x.shape[0])
    for name in ("h", "act", "y"):
        assert torch.equal(getattr(plain, name)[inside], getattr(cut, name)[inside]), name


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(x=a["x"].float()), "x_rows must be bfloat16"),
        (lambda a: a.update(x=a["x"][:, :64]), "shapes disagree"),
        (lambda a: a.update(counts=a["counts"][:-1]), "counts and offsets must be"),
        (lambda a: a.update(wd=a["wd"][:, :, :-4], wgu=a["wgu"][:, :-8]), "multiple of 8"),
    ],
)
def test_bad_arguments_raise_value_error(mutate, message):
    x, counts, offsets, wgu, wd = _problem(*LOADS["mixed"])
    args = dict(x=x, counts=counts, offsets=offsets, wgu=wgu, wd=wd)
    mutate(args)
    with pytest.raises(ValueError, match=message):
        expert_forward(args["x"], args["counts"], args["offsets"], args["wgu"], args["wd"])


def test_backward_bad_arguments_raise_value_error():
    from megamoe.ops.experts_bwd import expert_backward

    x, counts, offsets, wgu, wd = _problem(*LOADS["mixed"])
    dy, w = torch.randn_like(x), torch.rand(x.shape[0], device=DEVICE)
    h = expert_forward(x, counts, offsets, wgu, wd).h
    strided = torch.cat([x, x], dim=1)[:, : x.shape[1]]  # rows of twice the length: not contiguous
    for args, message in (((dy, w, strided, h), "x_rows must be contiguous"),
                          ((dy.float(), w, x, h), "dy_rows must be"),
                          ((dy, w, x, h[:, :8]), "h must be")):
        with pytest.raises(ValueError, match=message):
            expert_backward(*args, counts, offsets, wgu, wd)


def test_backward_with_no_rows_gives_zero_weight_gradients():
    from megamoe.ops.experts_bwd import expert_backward

    _, counts, offsets, wgu, wd = _problem([0, 0], 0)
    x = torch.empty(0, wgu.shape[2], dtype=torch.bfloat16, device=DEVICE)
    got = expert_backward(x, torch.empty(0, device=DEVICE), x, torch.empty(0, wgu.shape[1], dtype=torch.bfloat16,
                                                                       device=DEVICE), counts, offsets, wgu, wd)
    assert got.d_x.shape == (0, wgu.shape[2]) and got.d_router.shape == (0,)
    assert got.d_w_gate_up.eq(0).all() and got.d_w_down.eq(0).all()


def test_wgrad_with_no_experts_launches_nothing(monkeypatch):
    """``wgrad`` into an `[0, M, N]` gradient (a rank without local experts) returns before any launch, whatever the
    deal (a deal of no expert has no first entry for a kernel to read)."""
    from megamoe.ops import expert_wgrad

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError(f"a wgrad kernel launched on {grid} for no experts")

    monkeypatch.setattr(expert_wgrad.expert_gemm_bwd, "wgrad_kernel", NoLaunch())
    monkeypatch.setattr(expert_wgrad.wgrad_warp_specialized, "wgrad_ws_kernel", NoLaunch())
    rows = torch.randn(6, 16, device=DEVICE).bfloat16()
    none = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    expert_wgrad.wgrad(rows, rows, torch.empty(0, 16, 16, dtype=torch.bfloat16, device=DEVICE), none, none,
                      plan_tiles("wgrad", torch.device(DEVICE)), 4)


def test_the_dynamic_wgrad_deal_names_every_block_once_heavy_experts_first():
    """``wgrad_deal`` (the Gluon wgrad's DYNAMIC deal): a zero counter, the blocks of the experts a launch computes,
    those experts by their rows heaviest first (ties in expert order, an empty expert dealt too, the ones a window
    skips last), each with its rows (a window's offsets, not the counts' running sum); the takes, even ones from the
    heavy end and odd ones from the light end (``dealt_block``'s arithmetic, a take past the end clamped to the
    last), name every dealt block once."""
    from megamoe.ops.expert_wgrad import wgrad_deal

    counts = torch.tensor([5, 0, 40, 33, 40, 7], dtype=torch.int32, device=DEVICE)
    offsets = torch.tensor([3, 9, 9, 60, 100, 150], dtype=torch.int32, device=DEVICE)
    for modes, order, dealt in ((None, [2, 4, 3, 5, 0, 1], 6), (torch.tensor([1, 0, 0, 2, 3, 0], dtype=torch.int32,
                                                                             device=DEVICE), [4, 3, 0], 3)):
        deal = wgrad_deal(counts, offsets, modes, per_expert=7).cpu()
        assert deal.dtype == torch.int32 and deal.shape == (2 + 4 * 6,) and deal[0] == 0 and deal[1] == 7 * dealt
        fields = deal[2:].view(6, 4)
        assert fields[:dealt, 0].tolist() == order and sorted(fields[:, 0].tolist()) == list(range(6))
        assert fields[:, 1].tolist() == offsets.cpu()[fields[:, 0].long()].tolist()
        assert (fields[:, 2] - fields[:, 1]).tolist() == counts.cpu()[fields[:, 0].long()].tolist()
        total = int(deal[1])

        def position(t):  # dealt_block's
            t = max(min(t, total - 1), 0)
            return t // 2 + (t % 2) * (total - 1 - 2 * (t // 2))

        named = [position(t) for t in range(total)]
        assert sorted(named) == list(range(total)) and named[:2] == [0, total - 1]
        assert position(total + 5) == named[-1]


def _deal_by_torch(counts, offsets, modes, per_expert, skew=0.0):
    """``wgrad_deal``'s table from torch ops (its first build): a stable descending argsort of the keys; no blocks
    where the heaviest computed expert has under ``skew`` times their mean rows (the kernel's two fp32 products)."""
    active = torch.ones_like(counts, dtype=torch.bool) if modes is None else modes != 0
    order = torch.argsort(torch.where(active, counts, -1), descending=True, stable=True)
    row0 = offsets[order].to(torch.int32)
    dealt = torch.stack([order.to(torch.int32), row0, row0 + counts[order].to(torch.int32), torch.zeros_like(row0)], 1)
    computed = torch.where(active, counts, 0)
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    skewed = bool(f32(int(computed.max())) * f32(int(active.sum())) >= f32(skew) * f32(int(computed.sum())))
    blocks = (active.sum(dtype=torch.int32) * per_expert * skewed).view(1)
    return torch.cat([torch.zeros(1, dtype=torch.int32, device=counts.device), blocks, dealt.flatten()])


@pytest.mark.parametrize("experts", [1, 5, 32, 33, 256, 384])
def test_the_wgrad_deal_kernel_gives_the_torch_builders_table(experts):
    """``wgrad_deal_kernel`` (one launch) against the torch ops it replaced, on random rows with many ties (rows
    drawn from a few values, zeros among them), with and without a window's modes (some experts skipped), through
    ``wgrad_deal`` and into a poisoned table."""
    import triton

    from megamoe.kernels.wgrad_deal import wgrad_deal_kernel
    from megamoe.ops.expert_wgrad import DEAL_CHUNK, wgrad_deal

    g = torch.Generator().manual_seed(experts)
    for trial in range(3):
        counts = torch.randint(0, 4, (experts,), generator=g, dtype=torch.int32) * torch.randint(
            1, 300, (1,), generator=g, dtype=torch.int32)
        offsets = (torch.cumsum(counts, 0) - counts + torch.randint(0, 9, (experts,), generator=g)).to(torch.int32)
        modes = torch.randint(0, 4, (experts,), generator=g, dtype=torch.int32) if trial else None
        counts, offsets = counts.to(DEVICE), offsets.to(DEVICE)
        modes = None if modes is None else modes.to(DEVICE)
        want = _deal_by_torch(counts, offsets, modes, 7)
        got = wgrad_deal(counts, offsets, modes, per_expert=7)
        assert got.dtype == torch.int32 and torch.equal(got, want), (experts, trial)
        poisoned = torch.full_like(want, -7)
        wgrad_deal_kernel[(1,)](counts, offsets, counts if modes is None else modes, poisoned, experts, 7, 0.0,
                                HAS_MODES=modes is not None, EXPERTS=triton.next_power_of_2(experts), CHUNK=DEAL_CHUNK)
        assert torch.equal(poisoned, want), (experts, trial)
        # the plan's skew test: its blocks at any skew up to the rows' (heaviest over mean), none above it
        computed = counts if modes is None else torch.where(modes != 0, counts, 0)
        ratio = float(computed.max()) * int(want[1] // 7) / max(float(computed.sum()), 1.0)
        for skew in (1.0, ratio, ratio * 1.01 + 0.01, 3.0, float("inf")):
            want = _deal_by_torch(counts, offsets, modes, 7, skew)
            assert torch.equal(wgrad_deal(counts, offsets, modes, 7, skew), want), (experts, trial, skew)


def test_the_gluon_wgrad_constexprs_pick_one_deal_and_split_only_256_wide_blocks():
    """``wgrad_ws_constexprs``: the split store (the default) only on 256-wide blocks and never with the counter
    deal, whose ring is then the whole-half store's; the counter and the plan together are refused."""
    import dataclasses

    from megamoe.ops.expert_wgrad import WGRAD_SPLIT_STORE, wgrad_ws_constexprs

    tile = plan_tiles("wgrad", torch.device("cuda"), compiled=True)
    assert tile.block_n == 256
    assert wgrad_ws_constexprs(tile, 5)["SPLIT_STORE"] is WGRAD_SPLIT_STORE
    split, whole = wgrad_ws_constexprs(tile, 5, split=True), wgrad_ws_constexprs(tile, 5, split=False)
    assert split["SPLIT_STORE"] and not whole["SPLIT_STORE"] and split["STAGES"] > whole["STAGES"]
    assert wgrad_ws_constexprs(tile, 5, True, split=True) == {**whole, "DYNAMIC": True}
    assert wgrad_ws_constexprs(tile, 5, split=True, planned=True) == {**split, "PLANNED": True}
    assert not wgrad_ws_constexprs(dataclasses.replace(tile, block_n=128), 5, split=True)["SPLIT_STORE"]
    with pytest.raises(ValueError, match="not both"):
        wgrad_ws_constexprs(tile, 5, True, planned=True)


def planned_blocks(program: int, programs: int, total: int) -> list[int]:
    """``wgrad_planned.planned_block``'s arithmetic in Python: program's blocks in its order, each as its place in
    the deal's order."""
    got = []
    for k in range(-(-total // programs)):
        pos = k * programs + program + (k % 2) * (programs - 1 - 2 * program)
        if pos < total:
            got.append(pos)
    return got


@pytest.mark.parametrize("programs, total", [(5, 0), (5, 1), (5, 7), (4, 9), (132, 6144), (132, 301), (7, 14)])
def test_the_planned_wgrad_deal_names_every_block_once_a_round_side_by_side(programs, total):
    """The planned deal (``WGRAD_PLAN_SKEW``): over the programs every block of the deal's order once, each program's
    heaviest first; round k's blocks are the order's k-th run of ``programs`` (side by side, as the static deal's:
    the programs share their experts' rows in L2), the snake turning each round."""
    plans = [planned_blocks(p, programs, total) for p in range(programs)]
    assert sorted(pos for plan in plans for pos in plan) == list(range(total))
    for p, plan in enumerate(plans):
        assert plan == sorted(plan) and all(pos // programs == k for k, pos in enumerate(plan))
        assert all(pos % programs == (p if k % 2 == 0 else programs - 1 - p) for k, pos in enumerate(plan))


def test_the_planned_wgrad_deal_balances_the_bench_zipf_load():
    """qwen3-30b-a3b at 16384 tokens under the bench's zipf routing (its hottest expert ~15x the median), each block
    costing its expert's rows and a fixed 64: the planned deal's busiest program carries at most 1.06x the mean,
    and dealing each expert's blocks round robin (the static deal) gives one 0.05x of the mean more (the down
    wgrad's 48 blocks an expert: 1.05x against 1.13x; gate/up's 96: 1.02x against 1.09x). Its limit: a block near
    a program's mean share, whose program the snake cannot spare later blocks (the counter deal can)."""
    from megamoe.bench.problem import _route
    from megamoe.config import preset

    cfg, programs = preset("qwen3-30b-a3b"), 132
    g = torch.Generator().manual_seed(0)
    rows = torch.bincount(_route(cfg, 16384, 0, 1, "zipf", 0.0, g, "cpu").flatten().long(),
                          minlength=cfg.num_experts).tolist()
    order = sorted(rows, reverse=True)
    for per_expert in (48, 96):
        cost = [order[pos // per_expert] + 64 for pos in range(len(rows) * per_expert)]
        mean = sum(cost) / programs
        planned = max(sum(cost[pos] for pos in planned_blocks(p, programs, len(cost))) for p in range(programs))
        static = [0] * programs
        for e, r in enumerate(rows):
            for b in range(per_expert):
                static[(e * per_expert + b) % programs] += r + 64
        assert planned <= 1.06 * mean and max(static) >= planned + 0.05 * mean, (per_expert, planned / mean,
                                                                               max(static) / mean)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("out_m, out_n", [(384, 512), (320, 448)])
@pytest.mark.parametrize("rows_per_expert", [None, FEW_ROWS_PER_EXPERT])
def test_gpu_wgrad_ws_gives_wgrad_kernels_bits(out_m, out_n, rows_per_expert, monkeypatch):
    """The wgrad that expert_backward runs on Hopper (the warp-specialised Gluon kernel) against wgrad_kernel at the
    same block (both of the planner's: BK 32, BK 64; the Gluon ring as deep as the launch makes it): the same bits
    on a load with an empty expert, partial K steps, partial blocks (320 x 448) and more blocks than programs,
    NaN-poisoned; and the Gluon kernel with the operands swapped and the blocks stored transposed (OUT_T, how it
    runs a gathered B: ``(bᵀ · a)ᵀ``); both again with each half stored in 64-column quarters (SPLIT_STORE),
    with the blocks dealt dynamically (DYNAMIC) and by the plan (PLANNED); ``wgrad`` at every plan skew
    (``WGRAD_PLAN_SKEW``: the plan's launch, the static deal's, both with either dealing); the static deal told
    that the plan took its blocks writes nothing."""
    from megamoe.kernels import expert_gemm_bwd, wgrad_warp_specialized
    from megamoe.ops import expert_wgrad
    from megamoe.ops.expert_wgrad import (warp_specialized_wgrad, wgrad, wgrad_blocks_per_expert, wgrad_deal,
                                          wgrad_ws_constexprs)
    from megamoe.ops.launch import scratch_allocator

    gpu = torch.device("cuda")
    tile = plan_tiles("wgrad", gpu, rows_per_expert)
    assert warp_specialized_wgrad(gpu, tile) == (torch.cuda.get_device_capability()[0] == 9)
    g = torch.Generator(device="cuda").manual_seed(7)
    counts = torch.tensor([70, 0, 33, 129, 5, 200], dtype=torch.int32, device="cuda")
    offsets = (counts.cumsum(0) - counts).to(torch.int32)
    rows, programs = int(counts.sum()), 5
    a = torch.randn(rows, out_m, generator=g, device="cuda").bfloat16()
    b = torch.randn(rows, out_n, generator=g, device="cuda").bfloat16()
    outs = [torch.full((len(counts), out_m, out_n), float("nan"), dtype=torch.bfloat16, device="cuda")
            for _ in "abcdefghijk"]
    with scratch_allocator():
        expert_gemm_bwd.wgrad_kernel[(programs,)](
            a, b, outs[0], offsets, counts, len(counts), out_m, out_n, counts, outs[0], outs[0], DOT_FP32=False,
            NUM_PROGRAMS=programs, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            FLATTEN=tile.flatten, num_warps=tile.num_warps, num_stages=tile.num_stages)  # no window: unread
        for out, in_flight in zip(outs[2:4], (False, True)):  # waiting for each wgmma, or one left in flight
            wgrad_warp_specialized.wgrad_ws_kernel[(programs,)](
                a, b, out, offsets, counts, len(counts), out_m, out_n, counts, out, out, counts,
                NUM_PROGRAMS=programs,
                BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                STAGES=wgrad_ws_stages(tile.block_n, tile.block_k), MMA_IN_FLIGHT=in_flight,
                num_warps=4)
        wgrad_warp_specialized.wgrad_ws_kernel[(programs,)](
            b, a, outs[4], offsets, counts, len(counts), out_n, out_m, counts, outs[4], outs[4], counts,
            NUM_PROGRAMS=programs, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            STAGES=wgrad_ws_stages(tile.block_n, tile.block_k), OUT_T=True, num_warps=4)
        # each half stored in 64-column quarters through two buffers, the ring deeper (plain and transposed)
        for out, swap in zip(outs[7:9], (False, True)):
            first, second, m, n = (b, a, out_n, out_m) if swap else (a, b, out_m, out_n)
            wgrad_warp_specialized.wgrad_ws_kernel[(programs,)](
                first, second, out, offsets, counts, len(counts), m, n, counts, out, out, counts,
                NUM_PROGRAMS=programs, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                STAGES=wgrad_ws_stages(tile.block_n, tile.block_k, True), OUT_T=swap, SPLIT_STORE=True, num_warps=4)
        # the dynamic deal (blocks from a counter, heavy experts first from one end, light from the other)
        for out, swap in zip(outs[5:7], (False, True)):
            first, second, m, n = (b, a, out_n, out_m) if swap else (a, b, out_m, out_n)
            deal = wgrad_deal(counts, offsets, None, wgrad_blocks_per_expert(m, n, tile.block_n))
            wgrad_warp_specialized.wgrad_ws_kernel[(programs,)](
                first, second, out, offsets, counts, len(counts), m, n, counts, out, out, counts,
                NUM_PROGRAMS=programs, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                STAGES=wgrad_ws_stages(tile.block_n, tile.block_k), OUT_T=swap, deal_ptr=deal, DYNAMIC=True,
                num_warps=4)
            assert int(deal[0]) == int(deal[1]) + programs  # every block taken, each program's last take past them
        # the planned deal (the same order in a fixed plan, a snake over the programs)
        for out, swap in zip(outs[9:11], (False, True)):
            first, second, m, n = (b, a, out_n, out_m) if swap else (a, b, out_m, out_n)
            deal = wgrad_deal(counts, offsets, None, wgrad_blocks_per_expert(m, n, tile.block_n))
            wgrad_warp_specialized.wgrad_ws_kernel[(programs,)](
                first, second, out, offsets, counts, len(counts), m, n, counts, out, out, counts, deal_ptr=deal,
                **wgrad_ws_constexprs(tile, programs, planned=True), OUT_T=swap, num_warps=4)
        # the static deal beside the plan's launch: a no-op where the plan counted blocks (the output left poisoned)
        skipped = torch.full_like(outs[0], float("nan"))
        wgrad_warp_specialized.wgrad_ws_kernel[(programs,)](
            a, b, skipped, offsets, counts, len(counts), out_m, out_n, counts, skipped, skipped, counts,
            skip_ptr=torch.tensor([1], dtype=torch.int32, device="cuda"), **wgrad_ws_constexprs(tile, programs),
            num_warps=4)
    wgrad(a, b, outs[1], offsets, counts, tile, programs)
    # the plan's skew test (the heaviest expert 200 rows, 2.75x the mean): 2.5 deals by the plan, 3 by the static
    # deal's launch beside it; 0 the plan's launch alone, inf the static deal's
    per_expert = wgrad_blocks_per_expert(out_m, out_n, tile.block_n)
    assert int(wgrad_deal(counts, offsets, None, per_expert, 2.5)[1]) == 6 * per_expert
    assert int(wgrad_deal(counts, offsets, None, per_expert, 3.0)[1]) == 0
    for skew in (0.0, 2.5, 3.0, float("inf")):
        monkeypatch.setattr(expert_wgrad, "WGRAD_PLAN_SKEW", skew)
        outs.append(torch.full_like(outs[0], float("nan")))
        wgrad(a, b, outs[-1], offsets, counts, tile, programs)
    torch.cuda.synchronize()
    assert skipped.isnan().all()
    want = torch.stack([a[o:o + c].float().T @ b[o:o + c].float() for o, c in zip(offsets.tolist(), counts.tolist())])
    assert _rel(outs[0], want) < 1e-2 and outs[0][1].eq(0).all()
    for got in outs[1:]:
        differ = torch.nn.functional.pad(outs[0] != got, (0, -out_n % 256, 0, -out_m % 128)).view(
            len(counts), -(-out_m // 128), 128, -(-out_n // 256), 256).any(4).any(2).nonzero()
        assert torch.equal(outs[0], got), f"(expert, m block, n block) differing: {differ.tolist()}"


#: The Gluon wgrad's launches the carry test holds to ``wgrad_kernel``'s bits.
GLUON_WGRADS = ("static", "transposed", "dynamic", "transposed dynamic", "whole halves", "transposed whole halves",
                "planned", "transposed planned")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("rows_per_expert", [None, FEW_ROWS_PER_EXPERT])
def test_gpu_wgrad_ws_carry_gives_wgrad_kernels_bits_and_the_unsplit_ones(rows_per_expert):
    """The backward's windows (``megamoe.kernels.wgrad_carry``): an expert's rows cut at 256 of them into two
    launches, the first leaving its FP32 carry (CARRY_OUT), the second starting from it (CARRY_IN | STORE), beside
    experts stored in one window (STORE; an empty one in the first) and skipped in the other (mode 0, no rows). The
    Gluon wgrad (both of the planner's blocks: BK 32 with a wgmma left in flight, BK 64 without) gives
    ``wgrad_kernel``'s bits, gradients and carry, and the unsplit launch's gradients; nothing is written that a mode
    leaves out (NaN-poisoned); every expert STORE in one launch with CARRY is the launch without it. So does the
    Gluon wgrad with the operands swapped and the blocks and the carry stored transposed (OUT_T), and both with the
    blocks dealt dynamically (DYNAMIC: the skipped experts never dealt) or by the plan (PLANNED) and storing whole
    halves (without the default split store).

    ``wgrad_kernel`` runs the 128-wide blocks ``wgrad`` gives it with a carry (``carry_tile``: the same wgmma
    reductions, so the same bits)."""
    from megamoe.kernels import expert_gemm_bwd, wgrad_warp_specialized
    from megamoe.ops.expert_wgrad import wgrad_blocks_per_expert, wgrad_deal, wgrad_ws_constexprs
    from megamoe.planner.tiles import carry_tile
    from megamoe.ops.launch import scratch_allocator
    from megamoe.routing.windows import CARRY_IN, CARRY_OUT, STORE

    gpu = torch.device("cuda")
    tile = plan_tiles("wgrad", gpu, rows_per_expert)
    narrow = carry_tile(tile)  # wgrad_kernel's with a carry
    out_m, out_n, programs = 320, 448, 5  # partial blocks, more blocks than programs
    g = torch.Generator(device="cuda").manual_seed(8)
    counts = torch.tensor([70, 0, 33, 300, 5, 200], dtype=torch.int32, device="cuda")
    offsets = (counts.cumsum(0) - counts).to(torch.int32)
    split, cut = 3, 256  # expert 3's rows: 256 in the first window (a multiple of 128), 44 in the second
    a = torch.randn(int(counts.sum()), out_m, generator=g, device="cuda").bfloat16()
    b = torch.randn(int(counts.sum()), out_n, generator=g, device="cuda").bfloat16()
    experts = len(counts)
    windows = []  # (counts, offsets, modes) of each window: the split expert's second part starts at its row 256
    for rows, skip, modes in (([70, 0, 33, 256, 0, 0], 0, [STORE, STORE, STORE, CARRY_OUT, 0, 0]),
                              ([0, 0, 0, 44, 5, 200], cut, [0, 0, 0, CARRY_IN | STORE, STORE, STORE])):
        o = offsets.clone()
        o[split] += skip
        windows.append(tuple(torch.tensor(t, dtype=torch.int32, device="cuda") for t in (rows, o.tolist(), modes)))
    nan = lambda *shape, dtype=torch.float32: torch.full(shape, float("nan"), dtype=dtype, device="cuda")  # noqa: E731

    def launch(gluon, out, c, o, window=None):
        carry = window is not None
        window = window if carry else (c, out, out)  # unread without CARRY
        if gluon:  # "transposed": the operands swapped, the blocks (and the carry's) stored transposed (OUT_T)
            swap = gluon.startswith("transposed")
            dynamic = gluon.endswith("dynamic")  # the blocks dealt from a counter
            planned = gluon.endswith("planned")  # or by the plan
            split = False if gluon.endswith("whole halves") else None  # else the default store
            first, second, m, n = (b, a, out_n, out_m) if swap else (a, b, out_m, out_n)
            deal = wgrad_deal(c, o, window[0] if carry else None, wgrad_blocks_per_expert(m, n, tile.block_n))
            wgrad_warp_specialized.wgrad_ws_kernel[(programs,)](
                first, second, out, o, c, experts, m, n, *window, c, CARRY=carry, OUT_T=swap, deal_ptr=deal,
                **wgrad_ws_constexprs(tile, programs, dynamic, split, planned), num_warps=4)
        else:
            expert_gemm_bwd.wgrad_kernel[(programs,)](
                a, b, out, o, c, experts, out_m, out_n, *window, DOT_FP32=False, NUM_PROGRAMS=programs,
                BLOCK_M=narrow.block_m, BLOCK_N=narrow.block_n, BLOCK_K=narrow.block_k, FLATTEN=narrow.flatten,
                CARRY=carry, num_warps=narrow.num_warps, num_stages=narrow.num_stages)

    got = {}
    with scratch_allocator():
        for gluon in (False, *GLUON_WGRADS):
            whole, stored = (nan(experts, out_m, out_n, dtype=torch.bfloat16) for _ in range(2))
            launch(gluon, whole, counts, offsets)
            every = torch.full((experts,), STORE, dtype=torch.int32, device="cuda")
            launch(gluon, stored, counts, offsets, (every, nan(out_m, out_n), nan(out_m, out_n)))
            out, carry_in, carry, carry_end = (nan(experts, out_m, out_n, dtype=torch.bfloat16), nan(out_m, out_n),
                                               nan(out_m, out_n), nan(out_m, out_n))
            launch(gluon, out, *windows[0][:2], (windows[0][2], carry_in, carry))  # carry_in unread: no CARRY_IN
            torch.cuda.synchronize()
            after_first = out.clone()
            launch(gluon, out, *windows[1][:2], (windows[1][2], carry, carry_end))
            got[gluon] = dict(whole=whole, stored=stored, after_first=after_first, out=out, carry=carry,
                              carry_end=carry_end)
    torch.cuda.synchronize()
    want = torch.stack([a[o:o + c].float().T @ b[o:o + c].float() for o, c in zip(offsets.tolist(), counts.tolist())])
    o3 = int(offsets[split])
    assert _rel(got["static"]["carry"], a[o3:o3 + cut].float().T @ b[o3:o3 + cut].float()) < 1e-5
    for gluon, run in got.items():
        assert _rel(run["whole"], want) < 1e-2 and run["whole"][1].eq(0).all(), gluon
        assert run["after_first"][split:].isnan().all() and not run["after_first"][:split].isnan().any(), gluon
        assert run["carry_end"].isnan().all(), gluon  # no CARRY_OUT in the second window
        for name in ("stored", "out"):
            differ = (run[name] != run["whole"]).flatten(1).any(1).nonzero().flatten().tolist()
            assert torch.equal(run[name], run["whole"]), f"{gluon} {name}: experts differing {differ}"
    for name, t in got[False].items():  # bit patterns: the NaN left where nothing is written compares too
        bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype]
        for gluon in GLUON_WGRADS:
            differ = int((t.view(bits) != got[gluon][name].view(bits)).sum())
            assert differ == 0, f"{gluon} {name}: {differ} elements differ from wgrad_kernel's"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("block_k, stages, in_flight", [(64, None, True), (64, 4, False), (32, 6, True)])
@pytest.mark.parametrize("activation", EVERY_KIND[1:], ids=lambda a: a.kind)
def test_gpu_forward_ws_gives_the_triton_tiles_bits(block_k, stages, in_flight, activation):
    """The warp-specialised Gluon forward (``forward_ws``) against gate_up_kernel and down_kernel at the planner's
    128-row tiles: the same bits on a load with an empty expert, partial row tiles, partial n-tiles (I 320, D 448)
    and partial K steps, NaN-poisoned outputs, the SwiGLU clamp on; once through ``gate_up`` itself."""
    import dataclasses
    from megamoe.ops.experts import forward_ws, warp_specialized_forward

    gpu = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(11)
    counts = torch.tensor([70, 0, 33, 129, 5, 200, 131], dtype=torch.int32, device="cuda")
    offsets = (counts.cumsum(0) - counts).to(torch.int32)
    rows, d, i, programs = int(counts.sum()), 448, 320, 5
    x = torch.randn(rows, d, generator=g, device="cuda").bfloat16()
    wgu = (torch.randn(len(counts), 2 * i, d, generator=g, device="cuda") / d**0.5).bfloat16()
    wd = (torch.randn(len(counts), d, i, generator=g, device="cuda") / i**0.5).bfloat16()
    nan = lambda *shape: torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")  # noqa: E731
    h, act, y = nan(rows, 2 * i), nan(rows, i), nan(rows, d)
    gate_up(x, counts, offsets, wgu, h, act, activation=activation, tuning=Tuning(gate_up=plan_tiles("gate_up", gpu)), num_programs=programs,
            warp_specialized=False)
    down(act, counts, offsets, wd, y, tuning=Tuning(down=plan_tiles("down", gpu)), num_programs=programs,
         warp_specialized=False)
    h_ws, act_ws, y_ws = nan(rows, 2 * i), nan(rows, i), nan(rows, d)
    for kind, args in (("gate_up", (x, wgu, h_ws)), ("down", (act, wd, y_ws))):
        tile = dataclasses.replace(plan_tiles(kind, gpu), block_k=block_k)
        if kind == "gate_up" and stages is None:  # the library's path, tiles also cut at minibatches of 96 rows
            assert warp_specialized_forward(gpu, tile)
            gate_up(x, counts, offsets, wgu, h_ws, act_ws, activation=activation, tuning=Tuning(gate_up=tile), num_programs=programs,
                    minibatch=96)
            continue
        forward_ws(*args, counts, offsets, tile, programs, stages=stages, mma_in_flight=in_flight,
                   **({"act": act_ws, "activation": activation} if kind == "gate_up" else {}))
    torch.cuda.synchronize()
    ref = expert_forward_reference(x, counts, offsets, wgu, wd, activation=activation)
    assert _rel(y, ref.y) < 2e-2
    for name, want, got in (("h", h, h_ws), ("act", act, act_ws), ("y", y, y_ws)):
        assert not got.isnan().any(), f"{name}: rows left unwritten"
        differ = (want != got).any(1).nonzero().flatten().tolist()[:20]
        assert torch.equal(want, got), f"{name}: rows differing {differ}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("i, stages", [(320, 4), (320, 6), (96, 4), (256, 5)])
@pytest.mark.parametrize("programs, with_bias", [(5, False), (3, True)])
def test_gpu_ping_pong_down_gives_the_triton_tiles_bits(i, stages, programs, with_bias, monkeypatch):
    """The Gluon down in ping-pong (each warpgroup whole 128 x 128 tiles in turn) against down_kernel at the
    planner's tiles: the same bits (bias too) on a load with an empty expert, partial row tiles, partial n-tiles
    (D 448), fewer and more K steps than ring slots (I 96: 2, I 320: 5 partial), tasks dealt unevenly over the
    programs (a warpgroup left with no last task), NaN-poisoned outputs; once through ``down`` itself (which runs
    it at these K), row tiles also cut at minibatches of 96 rows."""
    import dataclasses
    from megamoe.ops import experts as expert_ops
    from megamoe.ops.experts import forward_ws

    monkeypatch.setattr(expert_ops, "PING_PONG_DOWN", True)  # down's own path at any default
    gpu = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(13)
    counts = torch.tensor([70, 0, 33, 129, 5, 200, 131, 256], dtype=torch.int32, device="cuda")
    offsets = (counts.cumsum(0) - counts).to(torch.int32)
    rows, d = int(counts.sum()), 448
    act = torch.randn(rows, i, generator=g, device="cuda").bfloat16()
    wd = (torch.randn(len(counts), d, i, generator=g, device="cuda") / i**0.5).bfloat16()
    bias = torch.randn(len(counts), d, generator=g, device="cuda").bfloat16() if with_bias else None
    want = torch.full((rows, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = torch.full_like(want, float("nan"))
    down(act, counts, offsets, wd, want, tuning=Tuning(down=plan_tiles("down", gpu)), num_programs=programs,
         bias=bias, warp_specialized=False)
    tile = dataclasses.replace(plan_tiles("down", gpu), block_n=128)
    forward_ws(act, wd, got, counts, offsets, tile, programs, stages=stages, bias=bias, ping_pong=True)
    library = torch.full_like(want, float("nan"))  # down's own path: ping-pong at these short K
    assert ping_pong_tile("down", plan_tiles("down", gpu), i) is not None
    down(act, counts, offsets, wd, library, num_programs=programs, bias=bias, minibatch=96)
    torch.cuda.synchronize()
    ref = torch.cat([act[o:o + c].float() @ wd[e].float().T + (0 if bias is None else bias[e].float())
                     for e, (o, c) in enumerate(zip(offsets.tolist(), counts.tolist()))])
    assert _rel(got, ref) < 2e-2
    assert not got.isnan().any(), "rows left unwritten"
    for name, y in (("forward_ws", got), ("down", library)):
        differ = (want != y).any(1).nonzero().flatten().tolist()[:20]
        assert torch.equal(want, y), f"{name}: rows differing {differ}"
    with pytest.raises(ValueError, match="down's tiles only"):
        forward_ws(torch.zeros(rows, d, dtype=torch.bfloat16, device="cuda"),
                   torch.zeros(len(counts), 2 * i, d, dtype=torch.bfloat16, device="cuda"),
                   torch.zeros(rows, 2 * i, dtype=torch.bfloat16, device="cuda"), counts, offsets, tile, programs,
                   act=torch.zeros(rows, i, dtype=torch.bfloat16, device="cuda"), ping_pong=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("i, programs", [(160, 5), (48, 3), (512, 4)])
@pytest.mark.parametrize("scatter", [False, True])
@pytest.mark.parametrize("form", ["ping-pong", "cooperative", "cooperative, empty halves skipped"])
def test_gpu_gluon_dx_gives_the_triton_tiles_bits(i, programs, scatter, form, monkeypatch):
    """The Gluon dx (``dx`` on Hopper: in ping-pong at short K, ``MEGAMOE_PING_PONG_DX``; cooperative at the
    planner's 128 x 256 tile, ``MEGAMOE_GLUON_DX``, also with ``SKIP_EMPTY_HALF``) against ``dx_kernel``: the same
    bits on a load with an empty expert, partial row tiles (four of at most 64 rows), partial n-tiles (D 448), K =
    2I of 96 (2 steps, partial), 320 and 1024 against the ring's slots, tasks dealt unevenly over the programs; rows
    in order or into their slots (SCATTER: a permutation of the slots with routes dropped, index -1); NaN-poisoned
    outputs."""
    import dataclasses
    from megamoe.ops import experts as expert_ops, experts_bwd

    # dx's own path at any default
    monkeypatch.setattr(expert_ops, "PING_PONG_DX", form == "ping-pong")
    monkeypatch.setattr(expert_ops, "GLUON_DX", form != "ping-pong")
    monkeypatch.setattr(expert_ops, "SKIP_EMPTY_HALF", form.endswith("skipped"))
    gpu = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(14)
    counts = torch.tensor([70, 0, 33, 129, 5, 200, 131, 256], dtype=torch.int32, device="cuda")
    offsets = (counts.cumsum(0) - counts).to(torch.int32)
    rows, d = int(counts.sum()), 448
    d_h = torch.randn(rows, 2 * i, generator=g, device="cuda").bfloat16()
    wgu = (torch.randn(len(counts), 2 * i, d, generator=g, device="cuda") / (2 * i)**0.5).bfloat16()
    tile = plan_tiles("dx", gpu)
    assert ping_pong_tile("dx", tile, 2 * i) is not None
    index = None
    if scatter:
        index = torch.randperm(rows + 17, generator=g, device="cuda")[:rows].to(torch.int32)
        index[::11] = -1  # dropped routes: not stored
    outs = {}
    for gluon in (False, True):
        grads = experts_bwd.new_grads(rows, wgu, torch.empty(len(counts), d, i, device="cuda"))
        d_x = torch.full((rows + 17 if scatter else rows, d), float("nan"), dtype=torch.bfloat16, device="cuda")
        grads = dataclasses.replace(grads, d_x=d_x, d_x_index=index)
        experts_bwd.dx(d_h, wgu, grads, counts, offsets, tile, programs, gluon)
        outs[gluon] = d_x
    torch.cuda.synchronize()
    ref = torch.cat([d_h[o:o + c].float() @ wgu[e].float()
                     for e, (o, c) in enumerate(zip(offsets.tolist(), counts.tolist()))])
    got = outs[True][index.clamp_min(0).long()] if scatter else outs[True]
    kept = (index >= 0) if scatter else torch.ones(rows, dtype=torch.bool, device="cuda")
    assert _rel(got[kept], ref[kept]) < 2e-2
    assert int(outs[True].isnan().any(1).sum()) == (rows + 17 - int(kept.sum()) if scatter else 0)
    differ = (outs[False] != outs[True]).any(1) & ~outs[False].isnan().all(1)
    assert torch.equal(outs[False].isnan(), outs[True].isnan()), "different rows written"
    assert not differ.any(), f"rows differing {differ.nonzero().flatten().tolist()[:20]}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("activation", EVERY_KIND[1:], ids=lambda a: a.kind)
def test_gpu_dact_ws_gives_the_triton_tiles_bits(activation):
    """The Gluon BF16 dact and wgrads (``warp_specialized``, Hopper's default) against ``dact_swiglu_bwd_kernel``
    and ``wgrad_kernel``: every gradient bit for bit (d_h and act_w feed dx and the wgrads; the router partials are
    summed in the Triton order) on a load with an empty expert, partial row tiles, a partial n-tile (I 320) and the
    SwiGLU clamp, more tasks than programs."""
    from megamoe.ops import experts_bwd

    g = torch.Generator(device="cuda").manual_seed(12)
    counts = torch.tensor([70, 0, 33, 129, 5, 200, 131], dtype=torch.int32, device="cuda")
    offsets = (counts.cumsum(0) - counts).to(torch.int32)
    rows, d, i = int(counts.sum()), 448, 320
    x = torch.randn(rows, d, generator=g, device="cuda").bfloat16()
    wgu = (torch.randn(len(counts), 2 * i, d, generator=g, device="cuda") / d**0.5).bfloat16()
    wd = (torch.randn(len(counts), d, i, generator=g, device="cuda") / i**0.5).bfloat16()
    h = (torch.randn(rows, 2 * i, generator=g, device="cuda") * 2).bfloat16()
    dy = torch.randn(rows, d, generator=g, device="cuda").bfloat16()
    w = torch.rand(rows, generator=g, device="cuda")
    got = []
    for ws in (False, True):
        got.append(experts_bwd.expert_backward(dy, w, x, h, counts, offsets, wgu, wd, activation=activation,
                                               num_programs=5, warp_specialized=ws))
    torch.cuda.synchronize()
    for name in ("d_x", "d_router", "d_w_gate_up", "d_w_down"):
        a, b = getattr(got[0], name), getattr(got[1], name)
        assert torch.equal(a, b), f"{name}: {int((a != b).sum())} elements differ"


def test_the_empty_half_switch_reaches_every_gluon_row_tile(monkeypatch):
    """``SKIP_EMPTY_HALF`` (read at each launch) is in every Gluon row-tile launch's constexprs, and each such kernel
    takes it (a kernel that ignored it would run its tails in both warpgroups, silently)."""
    from megamoe.kernels import (dact_warp_specialized, dx_warp_specialized, forward_fp8_warp_specialized,
                                 forward_warp_specialized)
    from megamoe.ops import experts as expert_ops
    from megamoe.ops.experts import forward_ws_constexprs
    from megamoe.ops.experts_bwd import dact_ws_constexprs, dx_ws_constexprs
    from megamoe.ops.experts_fp8 import forward_fp8_ws_constexprs

    tile = TileConfig(128, 128, 64)
    for value in (True, False):
        monkeypatch.setattr(expert_ops, "SKIP_EMPTY_HALF", value)
        for consts in (forward_ws_constexprs(tile, 132, gate_up=True, act=0),
                       forward_ws_constexprs(tile, 132, gate_up=False, act=0, ping_pong=True),
                       dact_ws_constexprs(tile, 132), dx_ws_constexprs(tile, 132),
                       forward_fp8_ws_constexprs(tile, 132, gate_up=True)):
            assert consts["SKIP_EMPTY_HALF"] is value, consts
    for kernel in (forward_warp_specialized.forward_ws_kernel, dact_warp_specialized.dact_ws_kernel,
                   dact_warp_specialized.dact_fp8_ws_kernel, dx_warp_specialized.dx_ws_kernel,
                   forward_fp8_warp_specialized.forward_fp8_ws_kernel):
        assert "SKIP_EMPTY_HALF" in kernel.arg_names, kernel


#: Expert loads whose 128-row tiles end in at most 64 rows (42, 64, 1, 170 = 128 + 42, 257, 33, 300 = 256 + 44) and
#: in more (65, 128, 200 = 128 + 72), beside an empty expert: what ``SKIP_EMPTY_HALF`` passes and what it keeps.
LONE_TAILS = [42, 0, 64, 65, 1, 170, 257, 128, 33, 300, 200]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("i", [256, 320])
def test_gpu_skipped_empty_halves_give_the_same_bits(i, monkeypatch):
    """``SKIP_EMPTY_HALF`` (a 128-row tile of at most 64 rows in one warpgroup) against the same Gluon kernels
    without it, every output and gradient bit for bit: the gate/up reading routed copies (TMA) and tokens by index
    (cp.async), the ping-pong down and dx, the dact over copies and by token; loads ending in 1-64 and 65-127 rows
    (:data:`LONE_TAILS`), I 256 (the ping-pong's K) and 320 (partial n-tiles, K steps). The skipping run goes first
    into NaN-poisoned outputs, so a row it failed to write cannot match by reusing the other run's memory."""
    from megamoe.ops import experts as expert_ops
    from megamoe.ops.experts import ExpertForward
    from megamoe.ops.experts_bwd import ExpertGrads, expert_backward

    monkeypatch.setattr(expert_ops, "GATHER_FORWARD", True)
    monkeypatch.setattr(expert_ops, "GATHER_BACKWARD", True)
    monkeypatch.setattr(expert_ops, "PING_PONG_DOWN", True)
    monkeypatch.setattr(expert_ops, "PING_PONG_DX", True)
    g = torch.Generator(device="cuda").manual_seed(15)
    counts = torch.tensor(LONE_TAILS, dtype=torch.int32, device="cuda")
    offsets = (counts.cumsum(0) - counts).to(torch.int32)
    rows, tokens, d, experts = int(counts.sum()), 700, 448, len(LONE_TAILS)
    x = torch.randn(tokens, d, generator=g, device="cuda").bfloat16()
    d_out = torch.randn(tokens, d, generator=g, device="cuda").bfloat16()
    index = torch.randint(0, tokens, (rows,), generator=g, device="cuda", dtype=torch.int32)
    wgu = (torch.randn(experts, 2 * i, d, generator=g, device="cuda") / d**0.5).bfloat16()
    wd = (torch.randn(experts, d, i, generator=g, device="cuda") / i**0.5).bfloat16()
    w = torch.rand(rows, generator=g, device="cuda")
    plan = dict(rows_per_expert=341.0)  # 128-row tiles: the Gluon kernels
    nan = lambda *shape: torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")  # noqa: E731
    runs = {}
    for skip in (True, False):
        monkeypatch.setattr(expert_ops, "SKIP_EMPTY_HALF", skip)
        out = {}
        for name, src, x_index in (("copies", x[index.long()], None), ("by token", x, index)):
            fwd = expert_forward(src, counts, offsets, wgu, wd, x_index=x_index, **plan,
                                 out=ExpertForward(nan(rows, 2 * i), nan(rows, i), nan(rows, d)))
            dy, dy_index = (d_out[index.long()], None) if x_index is None else (d_out, index)
            grads = expert_backward(dy, w, x[index.long()], fwd.h, counts, offsets, wgu, wd, dy_index=dy_index,
                                    **plan, out=ExpertGrads(nan(rows, d), torch.zeros(rows, device="cuda"),
                                                            nan(experts, 2 * i, d), nan(experts, d, i)))
            out.update({f"{name} {k}": getattr(fwd, k) for k in ("h", "act", "y")})
            out.update({f"{name} {k}": getattr(grads, k) for k in ("d_x", "d_router", "d_w_gate_up", "d_w_down")})
        runs[skip] = out
    torch.cuda.synchronize()
    ref = expert_forward_reference(x[index.long()], counts, offsets, wgu, wd)
    assert _rel(runs[True]["by token y"], ref.y) < 2e-2
    for name, want in runs[False].items():
        got = runs[True][name]
        assert not want.isnan().any() and not got.isnan().any(), f"{name}: left unwritten"
        assert torch.equal(want, got), f"{name}: {int((want != got).sum())} elements differ"


def test_the_gluon_wgrads_partitions_fit_an_sms_registers():
    """The warp-specialised wgrad's register split (``gather_registers``: the second consumer's and the producer's;
    the first consumer gets what they leave, at least the second's) fits Hopper's 65,536 registers a CTA."""
    from megamoe.kernels.gluon_gather import GATHER_WARPS
    from megamoe.kernels.wgrad_warp_specialized import gather_registers

    for a_gather, block_k in itertools.product((False, True), (32, 64)):
        consumer, producer = gather_registers(a_gather, block_k)
        producer_threads = 32 * (GATHER_WARPS.value if a_gather else 1)
        assert consumer % 8 == producer % 8 == 0 and 24 <= producer <= consumer <= 256, (a_gather, block_k)
        assert 2 * 128 * consumer + producer_threads * producer <= 65536, (a_gather, block_k, consumer, producer)


def test_gemm_kernels_compile_to_wgmma_and_tma_for_sm90():
    """Compiled on the CPU for Hopper: tensor-core wgmma and TMA bulk copies must be in the PTX (the Gluon wgrad's
    and the ping-pong down's too, without spills, also with the backward window's carry, dealt dynamically, by the plan and storing whole
    halves, as the
    Triton wgrad's at its carry tile); the Gluon
    dact sums its rows' router-gradient
    partials in the Triton dact's register layout (their order, so their bits: in another layout 400 of them
    differed on the GPU)."""
    from megamoe.ops import expert_wgrad

    summary = sm90_report("gemm")
    wgrads = {f"{kernel}{tile}" for kernel in ("wgrad_kernel", "wgrad_ws_kernel")
              for tile in ("", " (few rows per expert)", " (carry)", " (few rows per expert, carry)")}
    by_token = {"forward_ws_kernel (gate/up, x rows by token)", "dact_ws_kernel (d_out rows by token)",
                "dact_ws_kernel (d_out by token, d_h on the MXFP8 grid)",
                "wgrad_ws_kernel (carry) (d_out rows by token)", "wgrad_ws_kernel (carry) (x rows by token)",
                "wgrad_ws_kernel (carry) (x rows by token, dynamic)"}
    dynamic = {"wgrad_ws_kernel (carry) (dynamic)", "wgrad_ws_kernel (carry) (x rows by token, dynamic)"}
    planned = {"wgrad_ws_kernel (carry) (planned)", "wgrad_ws_kernel (carry) (x rows by token, planned)"}
    whole = {"wgrad_ws_kernel (carry) (whole halves)", "wgrad_ws_kernel (carry) (x rows by token, whole halves)"}
    gluon_dx = {"dx_ws_kernel (ping-pong)", "dx_ws_kernel (ping-pong, into the slots)",
                    "dx_ws_kernel (cooperative)", "dx_ws_kernel (cooperative, into the slots)"}
    skipping = {f"{name} (empty halves skipped)" for name in (
        "forward_ws_kernel (gate/up)", "forward_ws_kernel (gate/up, x rows by token)",
        "forward_ws_kernel (down, ping-pong)", "dact_ws_kernel", "dact_ws_kernel (d_out rows by token)",
        "dx_ws_kernel (ping-pong)", "dx_ws_kernel (cooperative)")}
    assert set(summary) == {"gate_up_kernel", "down_kernel", "dact_swiglu_bwd_kernel", "dx_kernel",
                            "dx_kernel (few rows per expert)", "dx_kernel (into the slots)",
                            "forward_ws_kernel (gate/up)", "forward_ws_kernel (down, ping-pong)", "dact_ws_kernel",
                            *gluon_dx, *wgrads, *by_token, *dynamic, *whole, *planned, *skipping}
    for name, facts in summary.items():
        assert facts["wgmma"] > 0 and facts["wgmma_bf16"] and facts["tma"], (name, facts)
        assert facts["shared_bytes"] <= 227 * 1024, (name, facts)
    for name in ("wgrad_ws_kernel", "wgrad_ws_kernel (few rows per expert)", "wgrad_ws_kernel (carry)",
                 "wgrad_ws_kernel (few rows per expert, carry)", "forward_ws_kernel (gate/up)",
                 "forward_ws_kernel (down, ping-pong)", *gluon_dx, "dact_ws_kernel", "wgrad_kernel (carry)", "wgrad_kernel (few rows per expert, carry)",
                 "dx_kernel (into the slots)", *by_token, *dynamic, *whole, *planned):  # the gathering producers: 96 registers
        assert not summary[name]["local_memory"] and summary[name]["stack_bytes"] in (0, None), summary[name]
    for name in (*by_token, "wgrad_ws_kernel (carry) (x rows by token, planned)"):  # each gather is cp.async pieces
        # counted on the ring's barriers
        assert summary[name]["cp_async"] > 0, (name, summary[name])
    for name in dynamic:  # the block counter's take and the tag steps' shared-memory word (it stores whole halves)
        assert summary[name]["shared_bytes"] > summary[name.replace("dynamic)", "whole halves)")]["shared_bytes"], (
            name, summary[name])
    if expert_wgrad.WGRAD_SPLIT_STORE:  # the split store's freed output buffers went to the ring: more shared memory
        for name in whole:
            split = summary[name.replace(", whole halves)", ")").replace(" (whole halves)", "")]
            assert split["shared_bytes"] > summary[name]["shared_bytes"], (name, split, summary[name])
    # ping-pong: a warpgroup's two 64-row halves, each an m64n128k16 wgmma a k16 (the cooperative tile's one each)
    assert summary["forward_ws_kernel (down, ping-pong)"]["wgmma"] == 2 * summary["forward_ws_kernel (gate/up)"]["wgmma"]
    # SKIP_EMPTY_HALF: the same kernels with one more K loop (the ping-pong's top half alone) or a passing one, and
    # without spills but the gathering gate/up's: its worker holds 16 bytes of the epilogue's row addresses, which
    # it reloads once a tile (its 232 registers are what two consumers and four gathering warps leave)
    for name in skipping:
        base = summary[name.removesuffix(" (empty halves skipped)")]
        facts = summary[name]
        assert facts["wgmma"] == base["wgmma"] * (1.5 if "ping-pong" in name else 1), (name, facts)
        assert facts["shared_bytes"] == base["shared_bytes"] and facts["barriers"] > base["barriers"], (name, facts)
        bound = 16 if "x rows by token" in name else 0
        assert not facts["local_memory"] and (facts["stack_bytes"] or 0) <= bound, (name, facts)
    triton_sums = summary["dact_swiglu_bwd_kernel"]["reduce_layouts"]
    assert len(triton_sums) == 1 and summary["dact_ws_kernel"]["reduce_layouts"] == triton_sums, summary


def _rel(a, b):
    return float((a.float() - b).abs().sum() / b.abs().sum().clamp_min(1e-30))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("activation", EVERY_KIND, ids=lambda a: a.kind)
def test_backward_tiles_match_reference(load, activation, shape):
    from megamoe.ops.experts_bwd import expert_backward, expert_backward_reference

    x, counts, offsets, wgu, wd = _problem(*LOADS[load], *SHAPES[shape], seed=5)
    g = torch.Generator().manual_seed(6)
    dy = torch.randn(x.shape, generator=g).bfloat16().to(DEVICE)
    row_weights = torch.rand(x.shape[0], generator=g).to(DEVICE)
    fwd = expert_forward(x, counts, offsets, wgu, wd, activation=activation)
    outside = torch.ones(x.shape[0], dtype=torch.bool, device=DEVICE)
    for o, c in zip(offsets.tolist(), counts.tolist()):
        outside[o : o + c] = False
    for t in (x, dy, fwd.h):  # rows outside every region must never reach a result
        t[outside] = float("nan")
    got = expert_backward(dy, row_weights, x, fwd.h, counts, offsets, wgu, wd, activation=activation, num_programs=3)
    want = expert_backward_reference(dy, row_weights, x, fwd.h, counts, offsets, wgu, wd, activation=activation)
    inside = ~want.d_router.isnan()
    for name, tol in (("d_x", 2e-2), ("d_router", 1e-3), ("d_w_gate_up", 2e-2), ("d_w_down", 2e-2)):
        a, b = getattr(got, name), getattr(want, name)
        if name in ("d_x", "d_router"):
            a, b = a[inside], b[inside]
        assert bool(torch.isfinite(a).all()), name
        if b.abs().sum() > 0:
            assert _rel(a, b) <= tol, (name, _rel(a, b))
    for l, c in enumerate(counts.tolist()):
        if c == 0:  # an expert with no rows gets exact zeros, not garbage
            assert got.d_w_gate_up[l].eq(0).all() and got.d_w_down[l].eq(0).all()


def test_backward_is_bitwise_deterministic_across_grid_sizes():
    from megamoe.ops.experts_bwd import expert_backward

    x, counts, offsets, wgu, wd = _problem(*LOADS["mixed"], seed=8)
    dy, row_weights = torch.randn(x.shape, device=DEVICE).bfloat16(), torch.rand(x.shape[0], device=DEVICE)
    h = expert_forward(x, counts, offsets, wgu, wd).h
    runs = [expert_backward(dy, row_weights, x, h, counts, offsets, wgu, wd, num_programs=p) for p in (1, 5)]
    inside = in_regions(counts, offsets, x.shape[0])
    assert torch.equal(runs[0].d_x[inside], runs[1].d_x[inside])
    assert torch.equal(runs[0].d_router[inside], runs[1].d_router[inside])
    assert torch.equal(runs[0].d_w_gate_up, runs[1].d_w_gate_up) and torch.equal(runs[0].d_w_down, runs[1].d_w_down)


def test_backward_stores_d_x_rows_into_their_slots_with_the_same_bits():
    from dataclasses import replace

    from megamoe.ops.experts_bwd import expert_backward, new_grads

    x, counts, offsets, wgu, wd = _problem(*LOADS["mixed"], seed=9)
    g = torch.Generator().manual_seed(10)
    dy = torch.randn(x.shape, generator=g).bfloat16().to(DEVICE)
    row_weights = torch.rand(x.shape[0], generator=g).to(DEVICE)
    h = expert_forward(x, counts, offsets, wgu, wd).h
    rows = x.shape[0]
    inside = in_regions(counts, offsets, rows).cpu()
    # every row inside a region to a distinct slot of a larger set, a few of them (and every row outside) to none
    index = torch.randperm(2 * rows, generator=g)[:rows].to(torch.int32)
    index[~inside] = -1
    index[torch.nonzero(inside)[::7, 0]] = -1
    want = expert_backward(dy, row_weights, x, h, counts, offsets, wgu, wd)
    slots = torch.full((2 * rows, x.shape[1]), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = replace(new_grads(rows, wgu, wd), d_x=slots, d_x_index=index.to(DEVICE))
    got = expert_backward(dy, row_weights, x, h, counts, offsets, wgu, wd, out=out)
    stored = index >= 0
    assert torch.equal(slots[index[stored].long()].cpu(), want.d_x[stored.to(DEVICE)].cpu())
    untouched = torch.ones(2 * rows, dtype=torch.bool)
    untouched[index[stored].long()] = False
    assert bool(slots[untouched.to(DEVICE)].isnan().all())
    assert torch.equal(got.d_router[inside.to(DEVICE)], want.d_router[inside.to(DEVICE)])
    assert torch.equal(got.d_w_gate_up, want.d_w_gate_up) and torch.equal(got.d_w_down, want.d_w_down)
    with pytest.raises(ValueError, match="d_x_index must be int32"):
        expert_backward(dy, row_weights, x, h, counts, offsets, wgu, wd, out=replace(out, d_x_index=index[:3]))


@pytest.mark.parametrize("shape", SHAPES)
def test_backward_reading_x_by_token_gives_the_routed_copies_bits(shape):
    """One rank's backward reads each row's x from the tokens by index (Hopper: gathered by the gate/up wgrad's
    producer) instead of a routed copy: the same bits, with and without a window's carry."""
    from megamoe.ops.experts_bwd import WgradCarry, expert_backward

    x_rows, counts, offsets, wgu, wd = _problem(*LOADS["mixed"], *SHAPES[shape], seed=11)
    g = torch.Generator().manual_seed(12)
    rows, d = x_rows.shape
    tokens = torch.randn(rows // 2 + 1, d, generator=g).bfloat16().to(DEVICE)
    index = torch.randint(0, tokens.shape[0], (rows,), generator=g, dtype=torch.int32).to(DEVICE)
    x_rows = tokens[index.long()]  # the routed copies the pull makes
    dy = torch.randn(x_rows.shape, generator=g).bfloat16().to(DEVICE)
    row_weights = torch.rand(rows, generator=g).to(DEVICE)
    h = expert_forward(x_rows, counts, offsets, wgu, wd).h
    experts, two_i, _ = wgu.shape
    f32 = dict(dtype=torch.float32, device=DEVICE)
    # a window's modes: the first expert carries in, the last carries out and stores nothing
    modes = torch.tensor([3, 2, 2, 4], dtype=torch.int32, device=DEVICE)
    carry_in = (torch.randn(d, two_i // 2, generator=g).to(DEVICE), torch.randn(two_i, d, generator=g).to(DEVICE))
    for carried in (False, True):
        runs = []
        for source, x_index in ((x_rows, None), (tokens, index)):
            c = WgradCarry(modes, carry_in[0], torch.full((d, two_i // 2), float("nan"), **f32), carry_in[1],
                           torch.full((two_i, d), float("nan"), **f32)) if carried else None
            grads = expert_backward(dy, row_weights, source, h, counts, offsets, wgu, wd, carry=c, x_index=x_index)
            runs.append((grads, c))
        (want, c_want), (got, c_got) = runs
        stored = slice(0, 3) if carried else slice(0, experts)
        assert torch.equal(got.d_w_gate_up[stored], want.d_w_gate_up[stored])
        assert torch.equal(got.d_w_down[stored], want.d_w_down[stored])
        if carried:
            assert torch.equal(c_got.gate_up_out, c_want.gate_up_out) and torch.equal(c_got.down_out, c_want.down_out)
            assert bool(torch.isfinite(c_got.gate_up_out).all())
    with pytest.raises(ValueError, match="x_index must be int32"):
        expert_backward(dy, row_weights, tokens, h, counts, offsets, wgu, wd, x_index=index[:3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU (the Gluon kernels gather on load)")
@pytest.mark.parametrize("d, i", [(256, 256), (200, 136)])
def test_gpu_gathered_operands_give_the_routed_copies_bits(d, i, monkeypatch):
    """One rank's Gluon gate/up, dact and wgrads read x and d_out rows by token (cp.async in their producers) and give
    the bits of the same kernels over the routed copies, forward and backward, with and without a window's carry."""
    from megamoe.ops import experts
    from megamoe.ops.experts_bwd import WgradCarry, expert_backward

    monkeypatch.setattr(experts, "GATHER_FORWARD", True)
    monkeypatch.setattr(experts, "GATHER_BACKWARD", True)

    g = torch.Generator(device="cuda").manual_seed(13)
    counts = torch.tensor([300, 0, 170, 333], dtype=torch.int32, device="cuda")
    offsets = torch.tensor([0, 300, 300, 470], dtype=torch.int32, device="cuda")
    rows, tokens = 803 + 9, 500
    x = torch.randn(tokens, d, generator=g, device="cuda").bfloat16()
    d_out = torch.randn(tokens, d, generator=g, device="cuda").bfloat16()
    index = torch.randint(0, tokens, (rows,), generator=g, device="cuda", dtype=torch.int32)
    wgu = (torch.randn(4, 2 * i, d, generator=g, device="cuda") / d**0.5).bfloat16()
    wd = (torch.randn(4, d, i, generator=g, device="cuda") / i**0.5).bfloat16()
    w = torch.rand(rows, generator=g, device="cuda")
    plan = dict(rows_per_expert=341.0)  # 128-row tiles: the Gluon kernels
    want = expert_forward(x[index.long()], counts, offsets, wgu, wd, **plan)
    got = expert_forward(x, counts, offsets, wgu, wd, x_index=index, **plan)
    for name in ("h", "act", "y"):
        assert torch.equal(getattr(got, name)[:803], getattr(want, name)[:803]), name
    f32 = dict(dtype=torch.float32, device="cuda")
    # every SM a program, and 3 (several blocks of one expert a program: the wgrad producers' first rows kept over
    # an expert's blocks, the plan's entries held ahead)
    for carried, programs in ((False, None), (True, None), (False, 3), (True, 3)):
        runs = []
        for x_src, dy_src, x_index, dy_index in ((x[index.long()], d_out[index.long()], None, None),
                                                 (x, d_out, index, index)):
            c = WgradCarry(torch.tensor([3, 2, 2, 4], dtype=torch.int32, device="cuda"),
                           torch.ones(d, i, **f32), torch.full((d, i), float("nan"), **f32),
                           torch.ones(2 * i, d, **f32), torch.full((2 * i, d), float("nan"), **f32)) if carried else None
            runs.append((expert_backward(dy_src, w, x_src, want.h, counts, offsets, wgu, wd, carry=c, x_index=x_index,
                                         dy_index=dy_index, num_programs=programs, **plan), c))
        (a, ca), (b, cb) = runs
        stored = slice(0, 3) if carried else slice(0, 4)
        assert torch.equal(a.d_x[:803], b.d_x[:803]) and torch.equal(a.d_router[:803], b.d_router[:803])
        assert torch.equal(a.d_w_gate_up[stored], b.d_w_gate_up[stored])
        assert torch.equal(a.d_w_down[stored], b.d_w_down[stored])
        if carried:
            assert torch.equal(ca.gate_up_out, cb.gate_up_out) and torch.equal(ca.down_out, cb.down_out)


def test_forward_is_bitwise_deterministic_across_grid_sizes():
    x, counts, offsets, wgu, wd = _problem(*LOADS["mixed"], seed=9)
    runs = [expert_forward(x, counts, offsets, wgu, wd, num_programs=p) for p in (1, 3, 7)]
    inside = in_regions(counts, offsets, x.shape[0])
    for other in runs[1:]:
        for name in ("h", "act", "y"):
            assert torch.equal(getattr(runs[0], name)[inside], getattr(other, name)[inside]), name
