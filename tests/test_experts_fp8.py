"""FP8-block grouped expert GEMM tiles (gate/up + SwiGLU + act quantisation, down) against the torch twin."""

import pytest
import torch

from megamoe.ops.launch import flat_row_stride
from megamoe.planner.tiles import TileConfig
from megamoe.planner.tuning import Tuning
from megamoe.ops.experts_fp8 import ExpertForwardQuantized, expert_forward_fp8_block, expert_forward_fp8_block_reference
from megamoe.reference.formats import fp8_block_quantize

from kinds import EVERY_KIND, clamped  # tests/kinds.py
from loads import DEVICE, LOADS, in_regions, regions, rel  # tests/loads.py
from sm90 import sm90_report  # tests/sm90.py

FP8 = torch.float8_e4m3fn


def _problem(counts, gap, d=256, i=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts, offsets, rows = regions(counts, gap)
    x = torch.randn(rows, d, generator=g) * torch.rand(rows, 1, generator=g) * 4  # per-row ranges differ
    wgu = torch.randn(len(counts), 2 * i, d, generator=g) / d**0.5
    wd = torch.randn(len(counts), d, i, generator=g) / i**0.5
    x_q, x_s = fp8_block_quantize(x)
    gu_q, gu_s = fp8_block_quantize(wgu, (128, 128))
    dn_q, dn_s = fp8_block_quantize(wd, (128, 128))
    return tuple(t.to(DEVICE) for t in (x_q, x_s, counts, offsets, gu_q, gu_s, dn_q, dn_s))


def _poisoned(rows, d, i):
    nan = dict(dtype=torch.bfloat16, device=DEVICE)
    return ExpertForwardQuantized(
        h=torch.full((rows, 2 * i), float("nan"), **nan),
        act_q=torch.full((rows, i), 0xFF, dtype=torch.uint8, device=DEVICE).view(FP8),
        act_scale=torch.full((rows, i // 128), float("nan"), dtype=torch.float32, device=DEVICE),
        y=torch.full((rows, d), float("nan"), **nan),
    )


@pytest.mark.parametrize("load, activation", [("mixed", EVERY_KIND[0]), ("one-expert", EVERY_KIND[1]),
                                              ("no-rows", EVERY_KIND[0]), *(("mixed", a) for a in EVERY_KIND[1:])])
def test_forward_matches_twin_and_writes_only_its_rows(load, activation):
    args = _problem(*LOADS[load])
    x_q, counts, offsets = args[0], args[2], args[3]
    rows, d = x_q.shape
    i = args[6].shape[2]
    out = expert_forward_fp8_block(*args, activation=activation, num_programs=3, out=_poisoned(rows, d, i))
    ref = expert_forward_fp8_block_reference(*args, activation=activation)
    inside = in_regions(counts, offsets, rows)
    # written exactly inside the expert regions
    assert not out.y[inside].isnan().any() and out.y[~inside].isnan().all()
    assert not out.h[inside].isnan().any() and out.h[~inside].isnan().all()
    assert not out.act_scale[inside].isnan().any() and out.act_scale[~inside].isnan().all()
    q = out.act_q.view(torch.uint8)
    assert (q[inside] != 0xFF).all() and (q[~inside] == 0xFF).all()
    if not inside.any():
        return
    assert rel(out.y[inside], ref.y[inside]) <= 2e-2, rel(out.y[inside], ref.y[inside])
    assert rel(out.h[inside], ref.h[inside]) <= 1e-2
    # act scales: the same up to the rounding of the fp32 block sums (an ulp or so of the amax)
    got_s, want_s = out.act_scale[inside], ref.act_scale[inside]
    assert ((got_s / want_s - 1).abs() <= 1e-3).all()
    # act values: the dequantised activations agree within FP8 resolution on every device
    got_act = out.act_q[inside].float() * got_s.repeat_interleave(128, dim=1)
    want_act = ref.act_q[inside].float() * want_s.repeat_interleave(128, dim=1)
    assert rel(got_act, want_act) <= 2e-2, rel(got_act, want_act)
    if DEVICE.type == "cpu":
        # The interpreter accumulates like the twin: scales and bytes match (but for rare rounding ties).
        # The GPU's FP8 wgmma accumulates with fewer bits, so there only the tolerances above apply.
        same = got_s == want_s
        assert float(same.float().mean()) >= 0.9, float(same.float().mean())
        blocks = same.repeat_interleave(128, dim=1)
        got_q, want_q = q[inside][blocks], ref.act_q.view(torch.uint8)[inside][blocks]
        assert float((got_q == want_q).float().mean()) >= 0.999


def test_store_h_false_and_tile_shapes_do_not_change_the_result():
    args = _problem(*LOADS["mixed"], seed=3)
    rows = args[0].shape[0]
    base = expert_forward_fp8_block(*args, num_programs=4)
    tiles = {"gate_up": TileConfig(16, 128, 128, num_warps=4, num_stages=1, group_m=3),
             "down": TileConfig(64, 256, 128, num_warps=4, num_stages=1, group_m=1)}  # per-column weight scales
    other = expert_forward_fp8_block(*args, num_programs=1, tuning=Tuning(**tiles), store_h=False)
    tiles["down"] = TileConfig(16, 64, 128, num_warps=4, num_stages=1, group_m=2)  # half a weight block
    third = expert_forward_fp8_block(*args, num_programs=2, tuning=Tuning(**tiles), store_h=False)
    assert other.h is None
    inside = in_regions(args[2], args[3], rows)
    for o in (other, third):
        # other tile shapes sum the 128-term blocks in another order: the act amaxes may move by an ulp
        torch.testing.assert_close(base.act_scale[inside], o.act_scale[inside], rtol=1e-3, atol=0)
        if DEVICE.type == "cpu":  # on the GPU the FP8 accumulation order moves act bytes by an ulp
            same = (base.act_q.view(torch.uint8)[inside] == o.act_q.view(torch.uint8)[inside]).float().mean()
            assert float(same) >= 0.99, float(same)
        assert rel(o.y[inside], base.y[inside]) <= 1e-2, rel(o.y[inside], base.y[inside])


def test_fp8_plan_takes_64_row_gate_up_tiles_for_few_rows_per_expert():
    """The compiled plan (GPU, ``compiled``: on any device): 64-row gate/up tiles at <= FEW_ROWS_PER_EXPERT rows per
    expert, 128-row ones above it or without a load; down keeps 128-row tiles (64-row ones gained nothing there)."""
    from megamoe.planner.tiles import FEW_ROWS_PER_EXPERT, plan_tiles_fp8

    gpu = torch.device("cuda")
    assert plan_tiles_fp8("gate_up", gpu, 170, compiled=True).block_m == 64
    assert plan_tiles_fp8("gate_up", gpu, FEW_ROWS_PER_EXPERT, compiled=True).block_m == 64
    assert plan_tiles_fp8("gate_up", gpu, FEW_ROWS_PER_EXPERT + 1, compiled=True).block_m == 128
    assert plan_tiles_fp8("gate_up", gpu, compiled=True).block_m == 128
    assert {plan_tiles_fp8("down", gpu, r, compiled=True).block_m for r in (None, 100, 341)} == {128}
    assert plan_tiles_fp8("gate_up", gpu, 170, compiled=True).num_warps == 4  # one warpgroup for 64 rows


def test_fp8_forward_plans_its_tiles_for_the_loads_mean_rows():
    """gate/up and down ask the planner for rows / experts by default, and for the caller's mean when given."""
    from recording_tuning import RecordingTuning  # tests/recording_tuning.py

    tuning = RecordingTuning()
    args = _problem(*LOADS["mixed"], seed=1)
    rows = args[0].shape[0]
    expert_forward_fp8_block(*args, tuning=tuning)
    expert_forward_fp8_block(*args, rows_per_expert=170.0, tuning=tuning)
    asked = tuning.asked
    assert asked == [("gate_up", rows / 4), ("down", rows / 4), ("gate_up", 170.0), ("down", 170.0)], asked


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_fp8_few_row_tiles_give_the_same_bits():
    """64-row gate/up tiles (the plan for few rows per expert) write every region row with the 128-row tiles'
    bits: h, act, its scales and y."""
    args = _problem([170, 0, 171, 3, 64, 65, 128, 129], 5, d=512, i=256, seed=4)
    rows, d, i = args[0].shape[0], 512, 256
    wide = expert_forward_fp8_block(*args, out=_poisoned(rows, d, i), rows_per_expert=300)
    narrow = expert_forward_fp8_block(*args, out=_poisoned(rows, d, i))  # a mean of 91 rows: 64-row gate/up
    inside = in_regions(args[2], args[3], rows)
    for name in ("h", "act_scale", "y"):
        a, b = getattr(wide, name), getattr(narrow, name)
        assert not a[inside].isnan().any() and torch.equal(a.isnan(), b.isnan()), name
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), name
    assert torch.equal(wide.act_q.view(torch.uint8), narrow.act_q.view(torch.uint8))


def test_warp_specialized_launch_refuses_strided_rows(monkeypatch):
    """The Gluon kernel's descriptors take rows of unit column stride: a transposed view is a ValueError before
    any launch (the CPU stands in for Hopper here), not a silently wrong result."""
    from megamoe.ops import experts_fp8

    monkeypatch.setattr(experts_fp8, "warp_specialized_fp8", lambda device, tile: True)
    x_q, x_s, counts, offsets, gu_q, gu_s, dn_q, dn_s = _problem(*LOADS["mixed"])
    rows, d = x_q.shape
    i = dn_q.shape[2]
    strided = x_q.view(torch.uint8).t().contiguous().t().view(FP8)  # the same values, column-major
    assert torch.equal(strided.view(torch.uint8), x_q.view(torch.uint8)) and strided.stride(1) != 1
    with pytest.raises(ValueError, match="a_q must have unit column stride"):
        experts_fp8.gate_up_fp8(strided, x_s, counts, offsets, gu_q, gu_s, _poisoned(rows, d, i))


def test_warp_specialized_rings_have_two_slots_at_least():
    """A tile asking for one stage still gets a two-slot ring in the Gluon kernels: FP8 down holds two steps' slots
    at once, the BF16 forward one wgmma in flight, and one slot would deadlock both (a hang, not an error)."""
    from megamoe.ops.experts import forward_ws_constexprs
    from megamoe.ops.experts_fp8 import forward_fp8_ws_constexprs

    one = TileConfig(128, 128, 128, num_warps=8, num_stages=1)
    for gate_up in (True, False):
        assert forward_fp8_ws_constexprs(one, 132, gate_up=gate_up)["STAGES"] == 2
        assert forward_ws_constexprs(one, 132, gate_up=gate_up, act=0)["STAGES"] == 2
    assert forward_fp8_ws_constexprs(TileConfig(128, 128, 128, num_stages=4), 132, gate_up=False)["STAGES"] == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("d, i, activation, store_h", [(384, 384, EVERY_KIND[1], True), (512, 256, EVERY_KIND[0], False),
                                                       (384, 384, EVERY_KIND[2], True), (512, 256, EVERY_KIND[3], True)],
                         ids=lambda v: getattr(v, "kind", v))
@pytest.mark.parametrize("skip_empty_half", [False, True], ids=["whole halves", "empty halves skipped"])
def test_gpu_fp8_ws_gives_the_triton_tiles_bits(d, i, activation, store_h, skip_empty_half, monkeypatch):
    """The warp-specialised Gluon kernel (what gate_up_fp8 / down_fp8 run on Hopper at 128-row tiles) against
    ``gate_up_fp8_kernel`` and ``down_fp8_kernel``: the same bits on a load with an empty expert and partial row
    tiles (four of them of at most 64 rows: one warpgroup's with ``SKIP_EMPTY_HALF``), more tasks than programs, an
    odd number of K steps (384: down's pairs and a single step), NaN-poisoned outputs; and close to the torch
    twin."""
    from megamoe.ops import experts as expert_ops
    from megamoe.ops.experts_fp8 import down_fp8, gate_up_fp8, warp_specialized_fp8
    from megamoe.planner.tiles import plan_tiles_fp8

    monkeypatch.setattr(expert_ops, "SKIP_EMPTY_HALF", skip_empty_half)
    args = _problem([70, 0, 33, 129, 5, 200, 131], 3, d=d, i=i, seed=12)
    x_q, x_s, counts, offsets, gu_q, gu_s, dn_q, dn_s = args
    rows = x_q.shape[0]
    assert all(warp_specialized_fp8(DEVICE, plan_tiles_fp8(kind, DEVICE, 300)) for kind in ("gate_up", "down"))
    outs = []
    for ws in (False, True):
        out = _poisoned(rows, d, i)
        gate_up_fp8(x_q, x_s, counts, offsets, gu_q, gu_s, out, activation=activation, num_programs=5, store_h=store_h,
                    rows_per_expert=300, warp_specialized=ws)
        down_fp8(out.act_q, out.act_scale, counts, offsets, dn_q, dn_s, out.y, num_programs=5, rows_per_expert=300,
                 warp_specialized=ws)
        outs.append(out)
    torch.cuda.synchronize()
    plan, ws = outs
    inside = in_regions(counts, offsets, rows)
    for name in ("h", "act_scale", "y") if store_h else ("act_scale", "y"):
        a, b = getattr(plan, name), getattr(ws, name)
        assert not b[inside].isnan().any() and torch.equal(a.isnan(), b.isnan()), f"{name}: written rows differ"
        differ = (a.nan_to_num() != b.nan_to_num()).any(1).nonzero().flatten().tolist()[:20]
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), f"{name}: rows differing {differ}"
    assert torch.equal(plan.act_q.view(torch.uint8), ws.act_q.view(torch.uint8))
    if not store_h:
        assert ws.h.isnan().all(), "h written without store_h"
    ref = expert_forward_fp8_block_reference(*args, activation=activation)
    assert rel(ws.y[inside], ref.y[inside]) < 2e-2


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.__setitem__(0, a[0].float()), "x_q must be"),
        (lambda a: a.__setitem__(1, a[1][:, :1]), "x_scale must be"),
        (lambda a: a.__setitem__(2, a[2][:-1]), "counts and offsets must be"),
        (lambda a: (a.__setitem__(4, a[4][:, :, :192]), a.__setitem__(6, a[6][:, :192])), "multiples of 128"),
        (lambda a: a.__setitem__(7, a[7].double()), "w_down_scale must be"),
        (lambda a: a.__setitem__(2, a[2].float()), "counts must be int32/int64"),
        (lambda a: a.__setitem__(3, a[3].tolist()), "every input must be a torch.Tensor"),
    ],
)
def test_bad_arguments_raise_value_error(mutate, message):
    args = list(_problem(*LOADS["mixed"]))
    mutate(args)
    if message == "multiples of 128":
        args[0] = args[0][:, :192]
    with pytest.raises(ValueError, match=message):
        expert_forward_fp8_block(*args)


def test_scales_with_a_size_one_dim_of_any_stride_give_the_same_bits():
    """D = 128: the down scales are [L, 1, I/128], and torch calls them contiguous whatever the size-1 dim's
    stride (a transposed view has 1 there). The kernels flatten [L, D/128] rows by the last size, not by that
    stride, so such a tensor gives the canonical tensor's bits (it read the wrong experts' scales before)."""
    args = list(_problem([6, 0, 37, 20], 3, d=128, seed=4))
    dn_s = args[7]
    assert dn_s.shape[1] == 1
    odd = dn_s.as_strided(dn_s.shape, (dn_s.stride(0), 1, 1))
    assert odd.is_contiguous() and odd.stride(1) != dn_s.shape[2] and torch.equal(odd, dn_s)
    base = expert_forward_fp8_block(*args, num_programs=3)
    args[7] = odd
    got = expert_forward_fp8_block(*args, num_programs=3)
    inside = in_regions(args[2], args[3], args[0].shape[0])
    assert torch.equal(got.y[inside].view(torch.int16), base.y[inside].view(torch.int16))
    with pytest.raises(ValueError, match="must be contiguous"):
        flat_row_stride(torch.zeros(2, 4, 6)[:, :, :3])


def test_bad_tiles_raise_value_error():
    args = _problem(*LOADS["mixed"])
    with pytest.raises(ValueError, match="block_k"):
        expert_forward_fp8_block(*args, tuning=Tuning(down=TileConfig(32, 128, 64)))
    with pytest.raises(ValueError, match="block_n"):
        expert_forward_fp8_block(*args, tuning=Tuning(gate_up=TileConfig(32, 64, 128)))


def test_fp8_kernels_compile_to_fp8_wgmma_and_tma_for_sm90():
    """Compiled on the CPU for Hopper: FP8 (e4m3 x e4m3) wgmma and TMA bulk copies in the PTX, forward and
    backward (dact, wgrad; dx is the down kernel); down, dact and wgrad do not spill (gate/up does, ~0.9 KB, a known
    Triton 3.6 register limit: see expert_gemm_fp8.summary). The Gluon kernels that run them on Hopper: gate/up's
    consumers hold a register or two around the epilogue's quantisation on the stack (16 bytes), down, the wgrad
    (with the backward window's carry too) and the dact none; the Gluon dact sums its router-gradient partials in
    the Triton dact's layout (their bits)."""
    summary = sm90_report("fp8")
    assert set(summary) == {"gate_up_fp8_kernel", "gate_up_fp8_kernel (few rows per expert)", "down_fp8_kernel",
                            "dact_fp8_kernel", "wgrad_fp8_kernel", "forward_fp8_ws_kernel (gate/up)",
                            "forward_fp8_ws_kernel (down)", "wgrad_fp8_ws_kernel",
                            "wgrad_fp8_ws_kernel (4 stages)", "dact_fp8_ws_kernel", "wgrad_fp8_kernel (carry)",
                            "wgrad_fp8_ws_kernel (carry)", "down_fp8_kernel (rows into slots)",
                            "forward_fp8_ws_kernel (down, rows into slots)",
                            *(f"{name} (empty halves skipped)" for name in (
                                "forward_fp8_ws_kernel (gate/up)", "forward_fp8_ws_kernel (down)",
                                "dact_fp8_ws_kernel"))}
    for name in ("forward_fp8_ws_kernel (down)", "forward_fp8_ws_kernel (down, rows into slots)",
                 "wgrad_fp8_ws_kernel", "wgrad_fp8_ws_kernel (4 stages)", "wgrad_fp8_ws_kernel (carry)",
                 "dact_fp8_ws_kernel"):
        assert summary[name]["stack_bytes"] in (0, None), summary[name]
    assert summary["forward_fp8_ws_kernel (gate/up)"]["stack_bytes"] <= 16, summary["forward_fp8_ws_kernel (gate/up)"]
    # SKIP_EMPTY_HALF (a tile of at most 64 rows in one warpgroup): the same wgmmas and shared memory, no more stack
    for name in ("forward_fp8_ws_kernel (gate/up)", "forward_fp8_ws_kernel (down)", "dact_fp8_ws_kernel"):
        base, facts = summary[name], summary[f"{name} (empty halves skipped)"]
        assert facts["wgmma"] == base["wgmma"] and facts["shared_bytes"] == base["shared_bytes"], (name, facts)
        assert (facts["stack_bytes"] or 0) <= (base["stack_bytes"] or 0), (name, facts)
    for name, facts in summary.items():
        assert facts["wgmma"] > 0 and facts["wgmma_fp8"] and facts["tma"], (name, facts)
        assert not facts["local_memory"], (name, facts)
        assert facts["shared_bytes"] <= 227 * 1024, (name, facts)
    # the backward's builds without spills (the dx: down, into slots too)
    for name in ("down_fp8_kernel", "down_fp8_kernel (rows into slots)", "dact_fp8_kernel", "wgrad_fp8_kernel"):
        assert summary[name]["stack_bytes"] in (0, None), summary[name]
    triton_sums = summary["dact_fp8_kernel"]["reduce_layouts"]
    assert len(triton_sums) == 1 and summary["dact_fp8_ws_kernel"]["reduce_layouts"] == triton_sums, summary
