"""The FP8 expert backwards (fp8-block and mxfp8: dact on E4M3 with the BF16 epilogue, dx on the forward's down
kernel, token-axis-quantised wgrads) against their torch twins, and against the FP32 oracle of the BF16 math."""

import pytest
import torch

from megamoe.ops.experts_bwd import expert_backward_reference
from megamoe.ops.experts_fp8_bwd import (expert_backward_fp8_block, expert_backward_fp8_block_reference,
                                         expert_backward_mxfp8, expert_backward_mxfp8_reference, quantize_tokens,
                                         token_blocks)
from megamoe.ops.comm import QuantRows
from megamoe.ops.quant import quantize_activations
from megamoe.reference.formats import fp8_block_quantize

from kinds import EVERY_KIND, clamped  # tests/kinds.py
from loads import DEVICE, FP8_BACKWARD_LOADS, in_regions, regions, rel  # tests/loads.py

#: format -> (the launches, their twin)
FORMATS = {"fp8-block": (expert_backward_fp8_block, expert_backward_fp8_block_reference),
           "mxfp8": (expert_backward_mxfp8, expert_backward_mxfp8_reference)}


def _problem(counts, gap, d=256, i=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts, offsets, rows = regions(counts, gap)
    scale = torch.rand(rows, 1, generator=g) * 4  # rows of different ranges
    t = dict(
        dy=(torch.randn(rows, d, generator=g) * scale).bfloat16(),
        w=torch.rand(rows, generator=g),
        x=(torch.randn(rows, d, generator=g) * scale).bfloat16(),
        h=(torch.randn(rows, 2 * i, generator=g) * 2).bfloat16(),
        counts=counts, offsets=offsets,
        wgu=(torch.randn(len(counts), 2 * i, d, generator=g) / d**0.5).bfloat16(),
        wd=(torch.randn(len(counts), d, i, generator=g) / i**0.5).bfloat16(),
    )
    return {k: v.to(DEVICE) for k, v in t.items()}


def _args(p):
    return p["dy"], p["w"], p["x"], p["h"], p["counts"], p["offsets"], p["wgu"], p["wd"]


def _inside(p):
    return in_regions(p["counts"], p["offsets"], p["x"].shape[0])


def test_token_blocks_start_each_expert_at_a_block_and_pad_with_zeros():
    counts, offsets = torch.tensor([5, 0, 140, 33]), torch.tensor([0, 8, 8, 151])
    b = token_blocks(counts, offsets, 190)
    assert b.block0.tolist() == [0, 1, 1, 3] and b.src.shape[0] % 128 == 0
    for e, (c, o) in enumerate(zip(counts.tolist(), offsets.tolist())):
        start = int(b.block0[e]) * 128
        assert b.src[start: start + c].tolist() == list(range(o, o + c))
        assert (b.src[start + c: start + -(-c // 128) * 128] == -1).all()
    assert int((b.src >= 0).sum()) == sum(counts.tolist())
    a = torch.randn(190, 128).bfloat16().to(DEVICE)
    a_t, a_s = quantize_tokens(a, token_blocks(counts.to(DEVICE), offsets.to(DEVICE), 190))
    want_q, want_s = fp8_block_quantize(torch.nn.functional.pad(a[151:184], (0, 0, 0, 95)), (128, 1))
    assert torch.equal(a_t[:, 384:512].T.contiguous().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(a_s[3], want_s[0])


#: each format on every load, the mixed one with and without the clamp (mxfp8's clamped case slow: ~20 s)
CASES = ([("fp8-block", "mixed", clamped(0.8)), pytest.param("mxfp8", "mixed", clamped(0.8), marks=pytest.mark.slow)]
         + [("fp8-block", "mixed", a) for a in EVERY_KIND[2:]]  # gpt-oss, geglu: one epilogue (dact_epilogue)
         + [(fmt, load, EVERY_KIND[0]) for fmt in FORMATS for load in FP8_BACKWARD_LOADS])  # serves both formats


@pytest.mark.parametrize("fmt, load, activation", CASES)
def test_fp8_backward_matches_its_twin_and_the_oracle(fmt, load, activation):
    p = _problem(*FP8_BACKWARD_LOADS[load], seed=3)
    launch, reference = FORMATS[fmt]
    got = launch(*_args(p), activation=activation)
    twin = reference(*_args(p), activation=activation)
    oracle = expert_backward_reference(*_args(p), activation=activation)
    inside = _inside(p)
    if not inside.any():
        assert got.d_w_gate_up.eq(0).all() and got.d_w_down.eq(0).all()
        return
    pairs = {"d_x": (got.d_x[inside], twin.d_x[inside], oracle.d_x[inside]),
             "d_router": (got.d_router[inside], twin.d_router[inside], oracle.d_router[inside]),
             "d_w_gate_up": (got.d_w_gate_up, twin.d_w_gate_up, oracle.d_w_gate_up),
             "d_w_down": (got.d_w_down, twin.d_w_down, oracle.d_w_down)}
    for name, (kernel, tw, fp32) in pairs.items():
        assert torch.isfinite(kernel).all(), name
        # the twin quantises alike: only the 128-term block sums' fp32 rounding and the bf16 stores differ (~1e-3)
        assert rel(kernel, tw) < 4e-3, (fmt, name, rel(kernel, tw))
        # E4M3 operands against the BF16 math: a few % (3 mantissa bits); a wrong scale is off by far more
        assert 1e-3 < rel(kernel, fp32) < 8e-2, (fmt, name, rel(kernel, fp32))
    # experts without rows get zero weight gradients
    for e, c in enumerate(p["counts"].tolist()):
        if c == 0:
            assert got.d_w_gate_up[e].eq(0).all() and got.d_w_down[e].eq(0).all()


def test_fp8_block_backward_is_bitwise_deterministic():
    """(mxfp8's bits across reruns and configs: tests/test_training_fp8.py)"""
    p = _problem(*FP8_BACKWARD_LOADS["mixed"], seed=4)
    a, b = (expert_backward_fp8_block(*_args(p), activation=clamped(0.8)) for _ in range(2))
    inside = _inside(p)  # rows outside every region are not written
    for name in ("d_x", "d_router"):
        assert torch.equal(getattr(a, name)[inside], getattr(b, name)[inside]), name
    for name in ("d_w_gate_up", "d_w_down"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def _slots_of(p, seed):
    """A slot for every routed row in a set twice as large (rows outside regions and every 7th inside: -1)."""
    g = torch.Generator().manual_seed(seed)
    rows = p["x"].shape[0]
    inside = _inside(p).cpu()
    index = torch.randperm(2 * rows, generator=g)[:rows].to(torch.int32)
    index[~inside] = -1
    index[torch.nonzero(inside)[::7, 0]] = -1
    return index


def _d_x_into_slots(p, index, **kwargs):
    """(the backward with rows in order, the one storing d_x into NaN-poisoned slots, the slots)."""
    from dataclasses import replace

    from megamoe.ops.experts_bwd import new_grads

    rows = p["x"].shape[0]
    want = expert_backward_fp8_block(*_args(p), **kwargs)
    slots = torch.full((2 * rows, p["x"].shape[1]), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = replace(new_grads(rows, p["wgu"], p["wd"]), d_x=slots, d_x_index=index.to(DEVICE))
    return want, expert_backward_fp8_block(*_args(p), out=out, **kwargs), slots


def _check_slots(want, got, slots, index, inside):
    stored = index >= 0
    assert torch.equal(slots[index[stored].long()].cpu(), want.d_x[stored.to(DEVICE)].cpu())
    untouched = torch.ones(slots.shape[0], dtype=torch.bool)
    untouched[index[stored].long()] = False
    assert bool(slots[untouched.to(DEVICE)].isnan().all())
    assert torch.equal(got.d_router[inside], want.d_router[inside])
    assert torch.equal(got.d_w_gate_up, want.d_w_gate_up) and torch.equal(got.d_w_down, want.d_w_down)


def test_fp8_block_backward_stores_d_x_rows_into_their_slots_with_the_same_bits():
    """``out.d_x_index`` (one rank's composed backward: each row's d_x straight into its route's slot) gives the
    in-order rows' bits there and touches no other slot; mxfp8's own tiles refuse it."""
    from dataclasses import replace

    from megamoe.ops.experts_bwd import new_grads

    p = _problem(*FP8_BACKWARD_LOADS["mixed"], seed=5)
    index = _slots_of(p, 6)
    _check_slots(*_d_x_into_slots(p, index), index, _inside(p))
    rows = p["x"].shape[0]
    out = replace(new_grads(rows, p["wgu"], p["wd"]), d_x_index=index.to(DEVICE))
    with pytest.raises(ValueError, match="mxfp8 tiles' d_x writes rows in order"):
        expert_backward_mxfp8(*_args(p), out=out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
def test_gpu_fp8_block_d_x_into_slots_gives_the_rows_bits():
    """The Gluon dx (``forward_fp8_ws_kernel``'s SCATTER) stores each row's d_x into its slot with the bits of the
    rows in order, on the Hopper load of the test below."""
    p = _problem([70, 0, 300, 129, 5, 200, 131], 3, d=384, i=384, seed=9)
    index = _slots_of(p, 11)
    _check_slots(*_d_x_into_slots(p, index, num_programs=5), index, _inside(p))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("activation", EVERY_KIND[1:], ids=lambda a: a.kind)
@pytest.mark.parametrize("skip_empty_half", [False, True], ids=["whole halves", "empty halves skipped"])
def test_gpu_fp8_block_backward_ws_gives_the_triton_tiles_bits(activation, skip_empty_half, monkeypatch):
    """On Hopper the dact, dx and wgrads run warp-specialised in Gluon
    (``dact_fp8_ws_kernel``, ``forward_fp8_ws_kernel``, ``wgrad_fp8_ws_kernel``):
    every gradient bit for bit as ``warp_specialized=False`` (the Triton kernels), on a load with an empty expert,
    partial and several token blocks per expert (1-3 K steps), more blocks than programs (D 384, I 384: wgrad
    blocks 3 x 3 and 6 x 3 per expert, dx's K 768 in pairs), row tiles of at most 64 rows (one warpgroup's with
    ``SKIP_EMPTY_HALF``). The Gluon run goes first, so a row it left unwritten cannot match by reusing the Triton
    run's memory."""
    from megamoe.ops import experts as expert_ops

    monkeypatch.setattr(expert_ops, "SKIP_EMPTY_HALF", skip_empty_half)
    p = _problem([70, 0, 300, 129, 5, 200, 131], 3, d=384, i=384, seed=9)
    got = [expert_backward_fp8_block(*_args(p), activation=activation, num_programs=5, warp_specialized=ws)
           for ws in (True, False)][::-1]
    inside = _inside(p)
    for name in ("d_x", "d_router", "d_w_gate_up", "d_w_down"):
        a, b = (getattr(g, name) for g in got)
        if name in ("d_x", "d_router"):
            a, b = a[inside], b[inside]
        assert torch.equal(a, b), f"{name}: {int((a != b).sum())} elements differ"
    assert got[1].d_w_down[1].eq(0).all() and got[1].d_w_gate_up[1].eq(0).all()  # the empty expert
    ref = expert_backward_fp8_block_reference(*_args(p), activation=activation)
    assert rel(got[1].d_w_gate_up, ref.d_w_gate_up) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("knobs", [{}, {"stages": 4}, {"stages": 2}])
def test_gpu_fp8_wgrad_ws_knobs_give_the_triton_bits(knobs):
    """The Gluon FP8 wgrad at its ring depths (2: a slot reused every other step):
    ``wgrad_fp8_kernel``'s bits on a load with an empty expert and 1-3 token blocks per expert, outputs
    of 256 x 384, more blocks than programs."""
    from megamoe.ops.experts_fp8_bwd import wgrad_fp8
    from megamoe.planner.tiles import plan_tiles_fp8_bwd

    p = _problem([70, 0, 300, 129, 5, 200, 131], 3, d=384, i=128, seed=10)
    blocks = token_blocks(p["counts"], p["offsets"], p["x"].shape[0])
    a_t, a_s = quantize_tokens(p["h"], blocks)  # [2I = 256, R_pad]
    b_t, b_s = quantize_tokens(p["x"], blocks)  # [D = 384, R_pad]
    tile = plan_tiles_fp8_bwd("wgrad", DEVICE)
    outs = [torch.full((7, 256, 384), float("nan"), dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    for out, ws in zip(outs, (False, True)):
        wgrad_fp8(a_t, a_s, b_t, b_s, out, blocks, p["counts"], tile, 5, warp_specialized=ws, **(knobs if ws else {}))
    torch.cuda.synchronize()
    assert not outs[1].isnan().any() and outs[1][1].eq(0).all()
    assert torch.equal(outs[0], outs[1]), f"{int((outs[0] != outs[1]).sum())} elements differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
def test_gpu_fp8_wgrad_ws_carry_gives_the_triton_bits_and_the_unsplit_ones():
    """The backward's windows (``megamoe.kernels.wgrad_carry``): expert 2's rows cut after two token blocks into two
    launches, each window's operands quantised from its own rows (the cut on a 128-row block, so the same blocks
    and scales), the first leaving the FP32 carry (CARRY_OUT), the second promoting onto it (CARRY_IN | STORE),
    beside experts stored in one window (STORE; an empty one in the first) and skipped in the other (mode 0, no
    rows). The Gluon FP8 wgrad gives ``wgrad_fp8_kernel``'s bits, gradients and carry, and the unsplit launch's
    gradients; nothing is written that a mode leaves out (NaN-poisoned); every expert STORE in one launch with
    CARRY is the launch without it."""
    from megamoe.ops.experts_fp8 import warp_specialized_fp8
    from megamoe.ops.experts_fp8_bwd import wgrad_fp8
    from megamoe.planner.tiles import plan_tiles_fp8_bwd
    from megamoe.routing.windows import CARRY_IN, CARRY_OUT, STORE

    p = _problem([70, 0, 300, 129, 5, 200, 131], 3, d=384, i=128, seed=11)
    tile = plan_tiles_fp8_bwd("wgrad", DEVICE)
    assert warp_specialized_fp8(DEVICE, tile)
    rows, experts, split, cut = p["x"].shape[0], 7, 2, 256  # expert 2's 300 rows: 256 in the first window, 44 after

    def operands(counts, offsets):
        """(a_t, a_s, b_t, b_s, blocks) of these rows: dW_gate_up's `[2I = 256, D = 384]` per expert."""
        blocks = token_blocks(counts, offsets, rows)
        return (*quantize_tokens(p["h"], blocks), *quantize_tokens(p["x"], blocks), blocks)

    windows = []  # (operands, counts, modes) of each window: the split expert's second part from its row 256
    for counts, skip, modes in (([70, 0, 256, 0, 0, 0, 0], 0, [STORE, STORE, CARRY_OUT, 0, 0, 0, 0]),
                                ([0, 0, 44, 129, 5, 200, 131], cut, [0, 0, CARRY_IN | STORE] + [STORE] * 4)):
        offsets = p["offsets"].clone()
        offsets[split] += skip
        counts = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
        windows.append((operands(counts, offsets), counts, torch.tensor(modes, dtype=torch.int32, device=DEVICE)))
    whole_ops = operands(p["counts"], p["offsets"])
    nan = lambda *shape, dtype=torch.float32: torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)  # noqa: E731

    def launch(ws, ops, out, counts, carry=None):
        wgrad_fp8(*ops[:4], out, ops[4], counts, tile, 5, warp_specialized=ws, carry=carry)

    got = {}
    for ws in (False, True):
        whole, stored, out = (nan(experts, 256, 384, dtype=torch.bfloat16) for _ in range(3))
        launch(ws, whole_ops, whole, p["counts"])
        every = torch.full((experts,), STORE, dtype=torch.int32, device=DEVICE)
        launch(ws, whole_ops, stored, p["counts"], (every, nan(256, 384), nan(256, 384)))
        carry_in, carry, carry_end = nan(256, 384), nan(256, 384), nan(256, 384)
        (ops0, counts0, modes0), (ops1, counts1, modes1) = windows
        launch(ws, ops0, out, counts0, (modes0, carry_in, carry))  # carry_in unread: no CARRY_IN
        torch.cuda.synchronize()
        after_first = out.clone()
        launch(ws, ops1, out, counts1, (modes1, carry, carry_end))
        got[ws] = dict(whole=whole, stored=stored, after_first=after_first, out=out, carry=carry, carry_end=carry_end)
    torch.cuda.synchronize()
    for ws, run in got.items():
        assert not run["whole"].isnan().any() and run["whole"][1].eq(0).all(), ws
        assert run["after_first"][split:].isnan().all() and not run["after_first"][:split].isnan().any(), ws
        assert not run["carry"].isnan().any() and run["carry_end"].isnan().all(), ws
        for name in ("stored", "out"):
            differ = (run[name] != run["whole"]).flatten(1).any(1).nonzero().flatten().tolist()
            assert torch.equal(run[name], run["whole"]), f"ws={ws} {name}: experts differing {differ}"
    for name, t in got[False].items():  # bit patterns: the NaN left where nothing is written compares too
        bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype]
        differ = int((t.view(bits) != got[True][name].view(bits)).sum())
        assert differ == 0, f"{name}: {differ} elements differ from wgrad_fp8_kernel's"


@pytest.mark.parametrize("fmt", ["fp8-block", pytest.param("mxfp8", marks=pytest.mark.slow)])  # mxfp8: ~1 min
def test_fp8_backward_takes_e4m3_rows(fmt):
    """dy and x as E4M3 rows quantised along D (the pulled upstream gradient, the forward ring's x): the same
    d_x and router gradients as from their BF16 rows (dact quantises dy that way), weight gradients that
    match the twin on the same rows and stay within FP8 error of the BF16-row ones; a format mismatch is
    refused."""
    p = _problem(*FP8_BACKWARD_LOADS["mixed"], seed=6)
    launch, reference = FORMATS[fmt]
    quant = quantize_activations
    dy_q, x_q = (QuantRows(*quant(p[k], fmt), fmt) for k in ("dy", "x"))
    args = list(_args(p))
    base = launch(*args)
    args[0], args[2] = dy_q, x_q
    got, twin = launch(*args), reference(*args)
    inside = _inside(p)
    for name in ("d_x", "d_router"):
        assert torch.equal(getattr(got, name)[inside], getattr(base, name)[inside]), name
    for name in ("d_w_gate_up", "d_w_down"):
        assert rel(getattr(got, name), getattr(twin, name)) < 4e-3, name
        assert rel(getattr(got, name), getattr(base, name)) < 6e-2, name
        assert not torch.equal(getattr(got, name), getattr(base, name)), name  # re-quantised: not the same bits
    other = "mxfp8" if fmt == "fp8-block" else "fp8-block"
    args[0] = QuantRows(*quant(p["dy"], other), other)
    with pytest.raises(ValueError, match="rows"):
        launch(*args)


def _as_bf16_kernels(*args, **kwargs):
    from megamoe.ops.experts_mxfp8_bf16 import expert_backward_mxfp8_bf16

    return expert_backward_mxfp8_bf16(*args, **kwargs)


#: the FP8 backwards with BF16 wgrads: (label, launch, twin, format); mxfp8's tiles slow under the interpreter
BF16_WGRAD_BACKWARDS = [("fp8-block", expert_backward_fp8_block, expert_backward_fp8_block_reference, "fp8-block"),
                        ("mxfp8 as bf16", _as_bf16_kernels, expert_backward_mxfp8_reference, "mxfp8"),
                        pytest.param("mxfp8 tiles", expert_backward_mxfp8, expert_backward_mxfp8_reference, "mxfp8",
                                     marks=pytest.mark.slow)]


@pytest.mark.parametrize("label, launch, reference, fmt", BF16_WGRAD_BACKWARDS)
def test_bf16_wgrads_match_their_twin_from_every_kind_of_rows(label, launch, reference, fmt):
    """``bf16_wgrads``: the weight gradients BF16 wgrads of BF16 rows -- the rows as given (BF16), E4M3 rows
    dequantised, or one rank's tokens read by index (``TokenRows``: here the rows shuffled into token order) -- each
    within BF16's rounding of its twin, closer to the FP32 oracle than the FP8 wgrads' (nothing quantised along the
    tokens), d_x and the router gradients the FP8 backward's bits (the wgrads leave them alone); token rows without
    the BF16 wgrads are refused."""
    from megamoe.ops.bf16_wgrads import TokenRows

    p = _problem(*FP8_BACKWARD_LOADS["mixed"], seed=7)
    args = list(_args(p))
    inside = _inside(p)
    fp8 = launch(*args, bf16_wgrads=False)
    oracle = expert_backward_reference(*args)
    rows = p["x"].shape[0]
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    tokens = TokenRows(p["dy"][order].contiguous(), p["x"][order].contiguous(),
                       torch.argsort(order).to(torch.int32))  # row r is token index[r]: order[index[r]] == r
    pulled = [QuantRows(*quantize_activations(p[k], fmt), fmt) for k in ("dy", "x")]
    for rows_as, (dy, x, token_rows) in {"bf16 rows": (p["dy"], p["x"], None),
                                         "e4m3 rows": (*pulled, None),
                                         "token rows": (pulled[0], pulled[1], tokens)}.items():
        run = [dy, args[1], x, *args[3:]]
        got = launch(*run, bf16_wgrads=True, token_rows=token_rows)
        twin = reference(*run, bf16_wgrads=True, token_rows=token_rows)
        for name in ("d_w_gate_up", "d_w_down"):
            kernel = getattr(got, name)
            assert torch.isfinite(kernel).all(), (rows_as, name)
            assert rel(kernel, getattr(twin, name)) < 4e-3, (rows_as, name, rel(kernel, getattr(twin, name)))
            if rows_as != "e4m3 rows":  # the E4M3 rows' dequantised values carry FP8's error themselves
                assert rel(kernel, getattr(oracle, name)) < rel(getattr(fp8, name), getattr(oracle, name)), (
                    rows_as, name)
        if rows_as == "bf16 rows":
            for name in ("d_x", "d_router"):
                assert torch.equal(getattr(got, name)[inside], getattr(fp8, name)[inside]), name
    with pytest.raises(ValueError, match="bf16_wgrads"):
        launch(*args, bf16_wgrads=False, token_rows=tokens)
