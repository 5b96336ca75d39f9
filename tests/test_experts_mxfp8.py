"""MXFP8 grouped expert GEMMs (dequantise-on-load) against the fp32 torch twin."""

import pytest
import torch

from megamoe.planner.tiles import TileConfig
from megamoe.planner.tuning import Tuning
from megamoe.ops.experts_mxfp8 import ExpertForwardQuantized, expert_forward_mxfp8, expert_forward_mxfp8_reference
from megamoe.reference.formats import mxfp8_dequantize, mxfp8_quantize

from kinds import EVERY_KIND, clamped  # tests/kinds.py
from loads import DEVICE, LOADS, in_regions, regions, rel  # tests/loads.py
from sm90 import sm90_report  # tests/sm90.py

FP8 = torch.float8_e4m3fn


def _problem(counts, gap, d=128, i=96, seed=0):
    """I = 96: a gate/up tile (64 act columns) runs past I, so the masking of the last tile is tested."""
    g = torch.Generator().manual_seed(seed)
    counts, offsets, rows = regions(counts, gap)
    x = torch.randn(rows, d, generator=g) * torch.rand(rows, 1, generator=g) * 4  # per-row ranges differ
    x[:, :32] *= 1e-3  # blocks of very different scales along K
    wgu = torch.randn(len(counts), 2 * i, d, generator=g) / d**0.5
    wd = torch.randn(len(counts), d, i, generator=g) / i**0.5
    x_q, x_s = mxfp8_quantize(x)
    gu_q, gu_s = mxfp8_quantize(wgu)  # along D
    dn_q, dn_s = mxfp8_quantize(wd)  # along I
    return tuple(t.to(DEVICE) for t in (x_q, x_s, counts, offsets, gu_q, gu_s, dn_q, dn_s))


def _poisoned(rows, d, i):
    nan = dict(dtype=torch.bfloat16, device=DEVICE)
    return ExpertForwardQuantized(
        h=torch.full((rows, 2 * i), float("nan"), **nan),
        act_q=torch.full((rows, i), 0xFF, dtype=torch.uint8, device=DEVICE).view(FP8),
        act_scale=torch.full((rows, i // 32), 0xFE, dtype=torch.uint8, device=DEVICE),
        y=torch.full((rows, d), float("nan"), **nan),
    )


@pytest.mark.parametrize("load, activation", [("mixed", EVERY_KIND[0]), ("mixed", EVERY_KIND[1]),
                                              ("one-expert", EVERY_KIND[2]), ("no-rows", EVERY_KIND[3])])
def test_forward_matches_twin_and_writes_only_its_rows(load, activation):
    args = _problem(*LOADS[load])
    x_q, counts, offsets = args[0], args[2], args[3]
    rows, d = x_q.shape
    i = args[6].shape[2]
    out = expert_forward_mxfp8(*args, activation=activation, num_programs=3, out=_poisoned(rows, d, i))
    ref = expert_forward_mxfp8_reference(*args, activation=activation)
    inside = in_regions(counts, offsets, rows)
    assert not out.y[inside].isnan().any() and out.y[~inside].isnan().all()
    assert not out.h[inside].isnan().any() and out.h[~inside].isnan().all()
    assert (out.act_scale[inside] != 0xFE).all() and (out.act_scale[~inside] == 0xFE).all()
    q = out.act_q.view(torch.uint8)
    assert (q[inside] != 0xFF).all() and (q[~inside] == 0xFF).all()
    if not inside.any():
        return
    assert rel(out.y[inside], ref.y[inside]) <= 2e-2, rel(out.y[inside], ref.y[inside])
    assert rel(out.h[inside], ref.h[inside]) <= 1e-2
    got_act = mxfp8_dequantize(out.act_q[inside], out.act_scale[inside])
    want_act = mxfp8_dequantize(ref.act_q[inside], ref.act_scale[inside])
    assert rel(got_act, want_act) <= 2e-2, rel(got_act, want_act)
    # scales: equal up to an amax crossing a power of two by the fp32 summation order
    diff = (out.act_scale[inside].int() - ref.act_scale[inside].int()).abs()
    assert int(diff.max()) <= 1
    if DEVICE.type == "cpu":
        # The interpreter accumulates (exact E4M3 products, fp32 sums) like the twin: scales and bytes match
        # but for rare rounding ties. On the GPU only the tolerances above apply.
        same = out.act_scale[inside] == ref.act_scale[inside]
        assert float(same.float().mean()) >= 0.95, float(same.float().mean())
        blocks = same.repeat_interleave(32, dim=1)
        got_q, want_q = q[inside][blocks], ref.act_q.view(torch.uint8)[inside][blocks]
        assert float((got_q == want_q).float().mean()) >= 0.99


def test_tiles_programs_and_store_h_do_not_change_the_result():
    """Pinned tiles (BLOCK_K 32: one scale per K step), one program and no h give the planner's result up to the
    fp32 summation order."""
    args = _problem(*LOADS["mixed"], seed=3)
    rows = args[0].shape[0]
    inside = in_regions(args[2], args[3], rows)
    base = expert_forward_mxfp8(*args, num_programs=4)
    tiles = {"gate_up": TileConfig(16, 128, 32, num_warps=4, num_stages=1, group_m=3),
             "down": TileConfig(64, 32, 32, num_warps=4, num_stages=1, group_m=1)}
    o = expert_forward_mxfp8(*args, num_programs=1, tuning=Tuning(**tiles), store_h=False)
    assert o.h is None
    diff = (base.act_scale[inside].int() - o.act_scale[inside].int()).abs()
    assert int(diff.max()) <= 1
    if DEVICE.type == "cpu":
        same = (base.act_q.view(torch.uint8)[inside] == o.act_q.view(torch.uint8)[inside]).float().mean()
        assert float(same) >= 0.99, float(same)
    assert rel(o.y[inside], base.y[inside]) <= 1e-2, rel(o.y[inside], base.y[inside])


def test_nan_scale_block_poisons_its_row():
    """A NaN block (scale byte 255, the quantiser's NaN encoding) gives NaN in its row and nowhere else in its
    expert. (Rows 11..50 are expert 2's; the outputs start finite, so a NaN was written.)"""
    args = list(_problem(*LOADS["mixed"], seed=5))
    nan_row, clean_row = 20, 21
    x = mxfp8_dequantize(args[0].cpu(), args[1].cpu())
    x[nan_row, 40] = float("nan")
    args[0], args[1] = (t.to(DEVICE) for t in mxfp8_quantize(x))
    assert int(args[1][nan_row, 1]) == 255
    rows, d = args[0].shape
    i = args[6].shape[2]
    ref = expert_forward_mxfp8_reference(*args)
    out = _poisoned(rows, d, i)
    out.y.fill_(3.0)
    out = expert_forward_mxfp8(*args, out=out)
    assert out.y[nan_row].isnan().all()
    assert (out.act_scale[nan_row] == 255).all()
    assert not out.y[clean_row].isnan().any()
    assert rel(out.y[clean_row], ref.y[clean_row]) <= 1e-2


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.__setitem__(0, a[0].float()), "x_q must be"),
        (lambda a: a.__setitem__(1, a[1][:, :1]), "x_scale must be"),
        (lambda a: a.__setitem__(1, a[1].float()), "x_scale must be"),
        (lambda a: a.__setitem__(2, a[2][:-1]), "counts and offsets must be"),
        (lambda a: a.__setitem__(5, a[5][:, :, :1].contiguous()), "w_gate_up_scale must be"),
        (lambda a: a.__setitem__(7, a[7].transpose(1, 2).contiguous()), "w_down_scale must be"),
        (lambda a: a.__setitem__(6, a[6][:1]), "shapes disagree"),
    ],
)
def test_bad_arguments_raise_value_error(mutate, message):
    args = list(_problem(*LOADS["mixed"]))
    mutate(args)
    with pytest.raises(ValueError, match=message):
        expert_forward_mxfp8(*args)


def test_bad_shapes_and_tiles_raise_value_error():
    args = _problem(*LOADS["mixed"])
    # D not a multiple of 32
    x_q, gu_q, dn_q = args[0][:, :112], args[4][:, :, :112], args[6][:, :112]
    bad = (x_q.contiguous(), args[1][:, :3].contiguous(), args[2], args[3], gu_q.contiguous(),
           args[5][:, :, :3].contiguous(), dn_q.contiguous(), args[7][:, :112].contiguous())
    with pytest.raises(ValueError, match="multiples of 32"):
        expert_forward_mxfp8(*bad)
    with pytest.raises(ValueError, match="block_k"):
        expert_forward_mxfp8(*args, tuning=Tuning(down=TileConfig(32, 64, 16)))
    with pytest.raises(ValueError, match="block_n"):
        expert_forward_mxfp8(*args, tuning=Tuning(gate_up=TileConfig(32, 32, 64)))
    with pytest.raises(ValueError, match="num_programs"):
        expert_forward_mxfp8(*args, num_programs=0)


def test_mxfp8_kernels_compile_for_sm90_with_registers_and_spills():
    """Compiled on the CPU for Hopper at the planner's GPU tiles, forward and backward (dact, wgrad; dx is the
    down kernel): bf16 wgmma on the dequantised tiles, TMA loads; and the BF16 gate/ups with act rounded to the MX
    grid (MXFP8 run as the BF16 kernels, ``megamoe.ops.experts_mxfp8_bf16``), Triton and Gluon. Registers and ptxas
    spill bytes are printed (pytest -s); none spills but the Gluon gate/up's consumers, whose epilogue rounds a
    64 x 128 fp32 tile under the warp-specialised register budget (56 B, 200 B gathering x by token, where the BF16
    kernel spills 96: 2026-12-05), and no case uses local memory."""
    summary = sm90_report("mxfp8")
    for name, facts in summary.items():
        print(f"{name}: registers {facts['registers']}, spill (stack) bytes {facts['stack_bytes']}, "
              f"shared {facts['shared_bytes']}")
    gluon = {"forward_ws_kernel (gate/up, act on the MX grid)",
             "forward_ws_kernel (gate/up, x rows by token, act on the MX grid)"}
    assert set(summary) == {"gate_up_dequant", "down_dequant", "dact_dequant", "wgrad_dequant",
                            "wgrad_dequant (carry)", "gate_up_kernel (act on the MX grid)", *gluon}
    for name, facts in summary.items():
        assert facts["wgmma"] > 0 and facts["tma"], (name, facts)
        assert not facts["wgmma_fp8"] and facts["wgmma_bf16"], (name, facts)
        assert facts["shared_bytes"] <= 227 * 1024, (name, facts)
        assert not facts["local_memory"], (name, facts)
        assert facts["stack_bytes"] in (0, None) or (name in gluon and facts["stack_bytes"] <= 256), (name, facts)
