"""MXFP8 as the BF16 expert kernels on operands rounded to its grid (``megamoe.ops.experts_mxfp8_bf16``, the
``AS_BF16`` switch): the rounding kernel against ``formats`` bit for bit, the forward and the backward against the
MXFP8 twins (and the MXFP8 tiles), every operand really rounded, the pack, and the layer with the switch on."""

import pytest
import torch

from megamoe.ops import experts_mxfp8
from megamoe.ops.comm import QuantRows
from megamoe.ops.expert_weights import PackCache, QuantizedExperts, quantize_experts, rounded_weights
from megamoe.ops.experts import ExpertForward, expert_forward
from megamoe.ops.experts_bwd import expert_backward
from megamoe.ops.experts_fp8_bwd import expert_backward_mxfp8, expert_backward_mxfp8_reference
from megamoe.ops.experts_mxfp8 import expert_forward_mxfp8_reference
from megamoe.ops.experts_mxfp8_bf16 import expert_backward_mxfp8_bf16, expert_forward_mxfp8_bf16
from megamoe.ops.quant import mx_round_activations, mx_round_weights, quantize_activations
from megamoe.reference.formats import mxfp8_dequantize, mxfp8_quantize

from kinds import EVERY_KIND  # tests/kinds.py
from loads import DEVICE, FP8_BACKWARD_LOADS, LOADS, in_regions, regions, rel  # tests/loads.py

#: Against its twin (the same operands on the grid, FP32 sums): the bf16 stores and the order of the sums only, as
#: the MXFP8 tiles (tests/test_experts_fp8_bwd.py: 4e-3; measured 1.4e-3 here).
TWIN = 4e-3
#: The plain BF16 kernels on the unrounded operands are E4M3's error off the twin (measured 4-8 %): an operand left
#: unrounded moves a result by about that much, far past TWIN.
UNROUNDED = 1e-2


def _round_ref(x, dim):
    return mxfp8_dequantize(*mxfp8_quantize(x, dim), dim, dtype=torch.bfloat16)


def _same_bits(got, want):
    """Equal bf16 bits, NaN where NaN (the kernel's NaN is the GPU's or the software cast's: any payload)."""
    got, want = got.cpu(), want.cpu()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), int((got.isnan() != nan).sum())
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)), int((got != want).sum())


def _special(rows, cols, dtype, seed):
    """Random rows of different ranges, and 32-blocks that are all zero, tiny (amax below 2**-116: bf16's
    subnormal grid, and E4M3's flush to zero), negative, huge, with a NaN, with an inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 8
    x[0, :32] = 0
    x[1, :32] *= 2.0**-120
    x[2, :32] *= 2.0**-128
    x[3, :] = -x[3, :].abs()
    x[4, 32:64] *= 2.0**100
    x[5, 7] = float("nan")
    x[6, 40] = float("-inf")
    x[7, 33] = 2.0**-140  # a lone subnormal in a block
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("axis", [1, 0])
def test_round_to_grid_is_quantise_then_dequantise_bit_for_bit(axis, dtype):
    """``mx_round_activations`` (quantize_kernel's ROUND) is ``formats``' MXFP8 quantise + dequantise cast to bf16,
    bit for bit: zeros, tiny blocks, negatives, a NaN or inf block NaN throughout as the quantiser makes it; from
    E4M3 rows too (dequantised on load), and gathering rows (the wgrads' token blocks, zero rows for -1)."""
    x = _special(96, 160, dtype, seed=1)
    xt = x if axis == 1 else x.T.contiguous()  # the special blocks along the axis rounded
    _same_bits(mx_round_activations(xt.to(DEVICE), axis), _round_ref(xt, axis))
    q, s = mxfp8_quantize(x)
    _same_bits(mx_round_activations(q.to(DEVICE), axis, x_scale=s.to(DEVICE)), _round_ref(mxfp8_dequantize(q, s), axis))
    if axis == 1:  # E4M3 rows along their own axis: their values (the one-rank forward's x)
        _same_bits(mx_round_activations(q.to(DEVICE), x_scale=s.to(DEVICE)), mxfp8_dequantize(q, s,
                                                                                              dtype=torch.bfloat16))
    rows = torch.tensor([5, -1, 0, 95, 3, 3] * 16, dtype=torch.int64)
    picked = torch.where(rows[:, None] >= 0, x.float()[rows.clamp(min=0)], 0.0).to(dtype)
    _same_bits(mx_round_activations(x.to(DEVICE), axis, rows=rows.to(DEVICE)), _round_ref(picked, axis))


def test_round_weights_along_either_axis_bit_for_bit():
    w = torch.stack([_special(64, 96, torch.bfloat16, seed=s) for s in (2, 3)])
    for axis in (-1, -2):
        _same_bits(mx_round_weights(w.to(DEVICE), axis), _round_ref(w, axis))
    _same_bits(mx_round_weights(w[0].to(DEVICE), -2), _round_ref(w[0], -2))


def _forward_problem(counts, gap, d=64, i=96, seed=0):
    """I = 96: the last gate/up tile runs past I (its masked 32-blocks)."""
    g = torch.Generator().manual_seed(seed)
    counts, offsets, rows = regions(counts, gap)
    x = (torch.randn(rows, d, generator=g) * torch.rand(rows, 1, generator=g) * 4).bfloat16()
    wgu = (torch.randn(len(counts), 2 * i, d, generator=g) / d**0.5).bfloat16()
    wd = (torch.randn(len(counts), d, i, generator=g) / i**0.5).bfloat16()
    return {k: v.to(DEVICE) for k, v in dict(x=x, counts=counts, offsets=offsets, wgu=wgu, wd=wd).items()}


@pytest.mark.parametrize("load, activation", [("mixed", EVERY_KIND[0]), ("one-expert", EVERY_KIND[2]),
                                              ("no-rows", EVERY_KIND[0])])
def test_forward_gives_the_mxfp8_twin_and_rounds_every_operand(load, activation):
    """The BF16 kernels on the dequantised E4M3 rows, the pack's rounded weights and act rounded in the gate/up
    epilogue: h and y within the twin's bf16 stores, act on the twin's grid (its bytes but for rounding ties of an
    fp32 h summed in another order); the BF16 kernels on the unrounded operands are far off (so is any of them left
    unrounded); only the regions' rows written."""
    p = _forward_problem(*LOADS[load])
    x_q, x_s = mxfp8_quantize(p["x"])
    rows, d = p["x"].shape
    i = p["wd"].shape[2]
    nan = dict(dtype=torch.bfloat16, device=DEVICE)
    out = ExpertForward(torch.full((rows, 2 * i), float("nan"), **nan), torch.full((rows, i), float("nan"), **nan),
                        torch.full((rows, d), float("nan"), **nan))
    expert_forward_mxfp8_bf16(x_q, x_s, p["counts"], p["offsets"], rounded_weights(p["wgu"], p["wd"]),
                              activation=activation, num_programs=3, out=out)
    twin = expert_forward_mxfp8_reference(x_q, x_s, p["counts"], p["offsets"], *mxfp8_quantize(p["wgu"]),
                                          *mxfp8_quantize(p["wd"]), activation=activation)
    inside = in_regions(p["counts"], p["offsets"], rows)
    for t in (out.h, out.act, out.y):
        assert not t[inside].isnan().any() and t[~inside].isnan().all()
    if not inside.any():
        return
    plain = expert_forward(p["x"], p["counts"], p["offsets"], p["wgu"], p["wd"], activation=activation)
    for name in ("h", "y"):
        got, want, bf16 = (getattr(o, name)[inside] for o in (out, twin, plain))
        assert rel(got, want) < TWIN, (name, rel(got, want))
        assert rel(bf16, want) > UNROUNDED, (name, rel(bf16, want))
    act = out.act[inside].float()
    assert torch.equal(_round_ref(act, 1).float(), act)  # on the grid
    want_act = mxfp8_dequantize(twin.act_q[inside], twin.act_scale[inside])
    assert float((act == want_act).float().mean()) > 0.99 and rel(act, want_act) < TWIN


def test_forward_from_bf16_tokens_gives_the_e4m3_rows_bits():
    """One rank's forward (``x_scale`` None): its BF16 tokens rounded to the grid in one launch, read by index, give
    the bits of the same tokens quantised to E4M3 rows first; a dtype that does not match ``x_scale`` is refused."""
    p = _forward_problem(*LOADS["mixed"])
    rows, d = p["x"].shape
    g = torch.Generator().manual_seed(5)
    tokens = (torch.randn(rows // 2 + 1, d, generator=g) * 3).bfloat16().to(DEVICE)
    index = torch.randint(0, tokens.shape[0], (rows,), generator=g).to(torch.int32).to(DEVICE)
    weights = rounded_weights(p["wgu"], p["wd"])
    outs = [expert_forward_mxfp8_bf16(*x, p["counts"], p["offsets"], weights, num_programs=3, x_index=index)
            for x in ((tokens, None), quantize_activations(tokens, "mxfp8"))]
    inside = in_regions(p["counts"], p["offsets"], rows)
    for name in ("h", "act", "y"):
        assert torch.equal(getattr(outs[0], name)[inside], getattr(outs[1], name)[inside]), name
    with pytest.raises(ValueError, match="x_q must be"):
        expert_forward_mxfp8_bf16(tokens, quantize_activations(tokens, "mxfp8")[1], p["counts"], p["offsets"],
                                  weights, x_index=index)


def _backward_problem(counts, gap, d=64, i=64, seed=3):
    g = torch.Generator().manual_seed(seed)
    counts, offsets, rows = regions(counts, gap)
    scale = torch.rand(rows, 1, generator=g) * 4
    t = dict(dy=(torch.randn(rows, d, generator=g) * scale).bfloat16(), w=torch.rand(rows, generator=g),
             x=(torch.randn(rows, d, generator=g) * scale).bfloat16(),
             h=(torch.randn(rows, 2 * i, generator=g) * 2).bfloat16(), counts=counts, offsets=offsets,
             wgu=(torch.randn(len(counts), 2 * i, d, generator=g) / d**0.5).bfloat16(),
             wd=(torch.randn(len(counts), d, i, generator=g) / i**0.5).bfloat16())
    return {k: v.to(DEVICE) for k, v in t.items()}


def _args(p):
    return p["dy"], p["w"], p["x"], p["h"], p["counts"], p["offsets"], p["wgu"], p["wd"]


def _grads(g, inside):
    return {"d_x": g.d_x[inside], "d_router": g.d_router[inside], "d_w_gate_up": g.d_w_gate_up,
            "d_w_down": g.d_w_down}


@pytest.mark.parametrize("rows_as", ["bf16", "e4m3"])
def test_backward_gives_the_mxfp8_twin_and_tiles_and_rounds_every_operand(rows_as):
    """The BF16 dact, dx and wgrads on operands rounded along each GEMM's reduction axis (the pulled E4M3 rows
    dequantised; the wgrads' along each expert's tokens in its zero-padded 128-row span; an expert of 140 rows, an
    empty one): every gradient within the twin's tolerance, the MXFP8 tiles' numbers but for the order of the sums,
    and far from the BF16 kernels on the unrounded operands; an empty expert's weight gradients zero."""
    p = _backward_problem(*FP8_BACKWARD_LOADS["mixed"])
    args = list(_args(p))
    if rows_as == "e4m3":
        args[0], args[2] = (QuantRows(*quantize_activations(p[k], "mxfp8"), "mxfp8") for k in ("dy", "x"))
    inside = in_regions(p["counts"], p["offsets"], p["x"].shape[0])
    fp8 = dict(bf16_wgrads=False)  # the MX-rounded wgrads (the BF16 wgrads, their default here: test_experts_fp8_bwd)
    got = _grads(expert_backward_mxfp8_bf16(*args, num_programs=3, **fp8), inside)
    twin = _grads(expert_backward_mxfp8_reference(*args, **fp8), inside)
    tiles = _grads(expert_backward_mxfp8(*args, num_programs=3, **fp8), inside)
    plain = _grads(expert_backward(*_args(p)), inside)
    for name, t in got.items():
        assert torch.isfinite(t).all(), name
        assert rel(t, twin[name]) < TWIN, (name, rel(t, twin[name]))
        assert rel(t, tiles[name]) < 1e-4, (name, rel(t, tiles[name]))  # measured <= 1e-7
        assert rel(plain[name], twin[name]) > UNROUNDED, (name, rel(plain[name], twin[name]))
    assert got["d_w_gate_up"][1].eq(0).all() and got["d_w_down"][1].eq(0).all()


def test_backward_reading_d_out_by_token_gives_the_routed_rows_bits():
    """``dy_index`` (one rank's composed backward: the staged d_out tokens, BF16 as the layer stages them or E4M3,
    put on the grid once and read by token) against the same tokens' routed E4M3 rows, with the BF16 wgrads of the
    tokens (the layer's default at one rank) and with the MX-rounded ones: every gradient the same bits. On Hopper
    the Gluon dact's producer gathers the token rows (128-row tiles); elsewhere one gather copies them first. A
    wrong index is refused."""
    from megamoe.ops.bf16_wgrads import TokenRows

    p = _backward_problem(*FP8_BACKWARD_LOADS["mixed"], d=128, i=128, seed=6)
    rows = p["x"].shape[0]
    g = torch.Generator().manual_seed(7)
    tokens_bf16 = (torch.randn(rows // 3 + 1, p["x"].shape[1], generator=g) * 3).bfloat16().to(DEVICE)
    index = torch.randint(0, tokens_bf16.shape[0], (rows,), generator=g).to(torch.int32).to(DEVICE)
    tokens = QuantRows(*quantize_activations(tokens_bf16, "mxfp8"), "mxfp8")
    routed = QuantRows(tokens.data[index.long()], tokens.scale[index.long()], "mxfp8")
    inside = in_regions(p["counts"], p["offsets"], rows)
    args = list(_args(p))
    for wgrads in ({"bf16_wgrads": True, "token_rows": TokenRows(tokens_bf16, p["x"], index)}, {"bf16_wgrads": False}):
        want = _grads(expert_backward_mxfp8_bf16(routed, *args[1:], **wgrads), inside)
        for staged in (tokens, tokens_bf16):
            got = _grads(expert_backward_mxfp8_bf16(staged, *args[1:], dy_index=index, **wgrads), inside)
            for name in want:
                assert torch.equal(got[name], want[name]), (wgrads["bf16_wgrads"], staged is tokens, name)
    with pytest.raises(ValueError, match="dy_index"):
        expert_backward_mxfp8_bf16(tokens, *args[1:], dy_index=index[:3])


def _dact_problem(seed):
    """A dact load whose d_h 32-blocks span many scales: rows' weights from 2**-130 (d_h below bf16's normal range)
    to 8, a zero-weight row (all-zero blocks), a partial n-tile (I 160), an empty expert, rows outside the
    regions."""
    p = _backward_problem([70, 0, 33, 5], 3, d=64, i=160, seed=seed)
    w = p["w"].clone()
    w[:4] = torch.tensor([0.0, 2.0**-130, 2.0**-120, 8.0])
    w[40:50] *= 2.0**-100
    return p, w


def test_dact_stores_d_h_on_the_grid_as_the_rounding_pass():
    """``dact(..., d_h_grid=)`` on a Triton tile 128 wide (column quarters of whole 32-blocks): the epilogue's d_h
    rounded to the MXFP8 grid along 2I, dx's operand, bit for bit ``mx_round_activations(d_h)`` and ``formats``'
    round trip in the regions' rows, untouched outside them; d_h, act_w and the router gradients the same bits as
    without it. A 64-wide tile (quarters of 16 columns) is refused: the caller rounds d_h in a pass instead."""
    import dataclasses

    from megamoe.config import SWIGLU
    from megamoe.ops.experts_bwd import dact, grid_in_epilogue
    from megamoe.planner.tiles import plan_tiles

    p, w = _dact_problem(seed=11)
    rows, i = p["h"].shape[0], p["wd"].shape[2]
    tile = dataclasses.replace(plan_tiles("dact", torch.device(DEVICE)), block_m=32, block_n=128)
    counts, offsets = p["counts"].to(torch.int32), p["offsets"].to(torch.int32)

    def run(grid, tile=tile):
        d_router = torch.full((rows,), float("nan"), device=DEVICE)
        d_h, act_w = dact(p["dy"], w, p["h"], counts, offsets, p["wd"], d_router, tile, 3, SWIGLU, False,
                          d_h_grid=grid)
        return d_h, act_w, d_router

    grid = torch.full((rows, 2 * i), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got, want = run(grid), run(None)
    inside = in_regions(p["counts"], p["offsets"], rows)
    for name, a, b in zip(("d_h", "act_w", "d_router"), got, want):
        assert torch.equal(a[inside], b[inside]), name
    d_h = got[0][inside]
    assert d_h.abs().max() > 1 and not (d_h != 0).any(1).all()  # large values and a zero row
    _same_bits(grid[inside], mx_round_activations(d_h))
    _same_bits(grid[inside], _round_ref(d_h.float(), 1))
    assert not torch.equal(grid[inside], d_h)  # rounded, not copied
    assert grid[~inside].isnan().all()
    narrow = dataclasses.replace(tile, block_n=64)
    assert grid_in_epilogue(tile, False) and not grid_in_epilogue(narrow, False) and grid_in_epilogue(narrow, True)
    for bad, bad_tile in ((grid[:, : 2 * i - 32], tile), (grid, narrow)):
        with pytest.raises(ValueError, match="d_h_grid"):
            run(bad, bad_tile)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("by_token", [False, True])
def test_gpu_gluon_dact_stores_d_h_on_the_grid_as_the_rounding_pass(by_token):
    """The Gluon dact's epilogue (Hopper) with ``d_h_grid`` (what ``GLUON_D_H_GRID`` turns on in the layer): bit for
    bit ``mx_round_activations(d_h)`` in the regions' rows, untouched outside them, and d_h, act_w and the router
    gradients the same bits as without it (also reading d_out by token, as one rank's backward does)."""
    from megamoe.config import SWIGLU
    from megamoe.ops.experts_bwd import dact
    from megamoe.planner.tiles import plan_tiles

    p, w = _dact_problem(seed=12)
    rows, i = p["h"].shape[0], p["wd"].shape[2]
    tile = plan_tiles("dact", torch.device("cuda"))
    counts, offsets = p["counts"].to(torch.int32), p["offsets"].to(torch.int32)
    dy, index = p["dy"], None
    if by_token:
        index = torch.randperm(rows, device="cuda").to(torch.int32)
        dy = torch.empty_like(dy).index_copy_(0, index.long(), dy)  # row index[r] of dy is routed row r's

    def run(grid):
        d_router = torch.full((rows,), float("nan"), device="cuda")
        return (*dact(dy, w, p["h"], counts, offsets, p["wd"], d_router, tile, 5, SWIGLU, True, index,
                      d_h_grid=grid), d_router)

    grid = torch.full((rows, 2 * i), float("nan"), dtype=torch.bfloat16, device="cuda")
    got, want = run(grid), run(None)
    torch.cuda.synchronize()
    inside = in_regions(p["counts"], p["offsets"], rows)
    for name, a, b in zip(("d_h", "act_w", "d_router"), got, want):
        assert torch.equal(a[inside], b[inside]), name
    _same_bits(grid[inside], mx_round_activations(got[0][inside]))
    assert grid[~inside].isnan().all()


def test_backward_refuses_other_rows_and_sizes():
    p = _backward_problem([3, 2], 0, d=128)
    args = list(_args(p))
    args[0] = QuantRows(*quantize_activations(p["dy"], "fp8-block"), "fp8-block")
    with pytest.raises(ValueError, match="fp8-block rows"):
        expert_backward_mxfp8_bf16(*args)
    q = _backward_problem([3, 2], 0, d=48)
    with pytest.raises(ValueError, match="multiples of 32"):
        expert_backward_mxfp8_bf16(*_args(q))


def test_pack_holds_the_rounded_weights_with_the_switch(monkeypatch):
    """With AS_BF16 the mxfp8 pack holds the weights rounded along each GEMM's K (with ``backward`` the dgrads' two,
    no E4M3 transposes), flattened and rebuilt by the custom ops' lists; a cache made without the switch is made
    again with it; fp8-block's pack is unchanged."""
    p = _backward_problem([3, 2], 0)
    wgu, wd = p["wgu"], p["wd"]
    monkeypatch.setattr(experts_mxfp8, "AS_BF16", True)
    q = quantize_experts(wgu, wd, "mxfp8", backward=True)
    assert q.transposed is None and q.rounded.backward and q.has_backward()
    r = q.rounded
    for got, w, axis in ((r.gate_up_along_d, wgu, -1), (r.down_along_i, wd, -1), (r.down_along_d, wd, -2),
                         (r.gate_up_along_2i, wgu, -2)):
        _same_bits(got, _round_ref(w, axis))
    back = QuantizedExperts.from_tensors("mxfp8", q.tensors(), wgu, wd)
    assert back.rounded is not None and back.transposed is None and len(q.tensors()) == 8
    assert all(a is b for a, b in zip(back.rounded.tensors(), r.tensors()))
    forward_only = quantize_experts(wgu, wd, "mxfp8")
    assert not forward_only.has_backward() and len(forward_only.tensors()) == 6
    assert quantize_experts(p["wgu"].repeat(1, 2, 2), p["wd"].repeat(1, 2, 2), "fp8-block").rounded is None
    cache = PackCache()
    monkeypatch.setattr(experts_mxfp8, "AS_BF16", False)
    off = cache.get(wgu, wd, "mxfp8", backward=True)
    assert off.rounded is None and off.transposed is not None
    monkeypatch.setattr(experts_mxfp8, "AS_BF16", True)
    assert cache.get(wgu, wd, "mxfp8", backward=True).rounded is not None


def _layer(world, tokens, as_bf16):
    """mxfp8 training gradients of one problem with the switch on and off on this rank; how often the BF16-kernel
    forward and backward (once per window) ran with it on."""
    from megamoe.autograd import moe
    from megamoe.bench.problem import make_problem
    from megamoe.config import MoEConfig
    from megamoe.megakernel import backward_composed, kernel
    from megamoe.ops import experts_mxfp8 as switch

    calls = {"forward": 0, "backward": 0}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return run

    kernel.expert_forward_mxfp8_bf16 = counted("forward", kernel.expert_forward_mxfp8_bf16)
    backward_composed.expert_backward_mxfp8_bf16 = counted("backward", backward_composed.expert_backward_mxfp8_bf16)
    cfg = MoEConfig(hidden=64, intermediate=64, num_experts=8, top_k=3)
    p = make_problem(cfg, world.rank, world.size, tokens[world.rank], dtype=torch.bfloat16, seed=1,
                     device=world.device)

    def grads(precision):
        leaves = {name: getattr(p, name).detach().clone().requires_grad_()
                  for name in ("x", "router_weights", "w_gate_up", "w_down")}
        out = moe(world, leaves["x"], p.top_experts, leaves["router_weights"], leaves["w_gate_up"],
                  leaves["w_down"], p.shared, cfg.activation, precision=precision)
        out.backward(p.d_out)
        return {"out": out.detach(), **{name: t.grad for name, t in leaves.items()}}

    runs, default = {}, switch.AS_BF16
    for flag in as_bf16:
        switch.AS_BF16 = flag
        runs[flag] = grads("mxfp8")
    switch.AS_BF16 = default
    return runs, calls


def _check_layer(ranks, tokens, as_bf16):
    for runs, calls in launch_ranks(_layer, ranks, tokens, as_bf16):
        # one rank: the forward and the composed backward; more: the backward (the forward megakernel's tiles stay)
        assert calls["forward"] == (1 if ranks == 1 else 0) and calls["backward"] >= 1, calls
        for name, t in runs[True].items():  # the MXFP8 tiles' numbers, up to the order of the FP32 sums
            assert torch.isfinite(t).all() and rel(t, runs[False][name]) < 1e-4, (name, rel(t, runs[False][name]))


def launch_ranks(fn, ranks, *args):
    from megamoe.parallel.world import launch

    return launch(fn, ranks, *args)


def test_layer_with_the_switch_gives_the_mxfp8_tiles_numbers_on_one_rank():
    """``AS_BF16`` on one rank (~8 s): the layer's forward runs the BF16 kernels on the dequantised staged rows (act
    rounded in the epilogue) and its composed backward the BF16 backward on MX-rounded operands; its output and
    every gradient are the MXFP8 tiles' (switch off) but for the order of the sums (which the tests above hold
    apart from BF16's)."""
    _check_layer(1, (19,), (True, False))


@pytest.mark.slow
def test_layer_with_the_switch_on_two_ranks():
    """Two ranks (~25 s): the forward megakernel keeps its MXFP8 tiles, the composed backward runs the BF16 kernels
    on the pulled E4M3 rows dequantised (QuantRows) and MX-rounded: the MXFP8 tiles' gradients but for the order of
    the sums."""
    _check_layer(2, (30, 23), (True, False))
