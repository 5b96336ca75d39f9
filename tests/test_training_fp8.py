"""Training with FP8 experts (fp8-block, mxfp8) on CPU ranks: every gradient against the FP32 oracle within FP8
bounds, the same bits across reruns, a wrapping ring and other knobs, the bench's checks, the API's refusal."""

import pytest
import torch

from megamoe.autograd import moe
from megamoe.bench.accuracy import _flatten, error_stats
from megamoe.bench.problem import make_problem
from megamoe.config import MoEConfig
from megamoe.parallel.world import launch
from megamoe.planner import KernelConfig
from megamoe.reference.ep import ep_reference_forward_backward

from kinds import GEGLU, GPT_OSS, SWIGLU  # tests/kinds.py

from raised import raised  # tests/raised.py

#: fp8-block needs D and I multiples of 128 (mxfp8: 32)
CONFIG = MoEConfig(hidden=128, intermediate=128, num_experts=8, top_k=3, shared=(32,))
WRAPPING = KernelConfig(num_sms=4, comm_sms=2, minibatch=32, ring_rows=64, tile_m=32, tile_n=32, backward_minibatch=64)
OTHER = KernelConfig(num_sms=5, comm_sms=1, minibatch=96, ring_rows=1056, tile_m=32, tile_n=32, backward_comm_sms=3,
                     backward_minibatch=32)
#: FP8 gradients against the FP32 oracle of the BF16 math: relative L1 and the worst row's relative L2.
#: E4M3 keeps 3 mantissa bits: the expert kernels alone measure 3-5 % L1 (tests/test_experts_fp8_bwd.py), the
#: layer (its FP8 forward's act too) 4-7 % L1 and rows up to 0.22 here; the shared experts (BF16) 0.2-0.3 %. A
#: lost route, a wrong scale or a stale context gives errors near 1.
GRAD_TOLERANCE = (0.1, 0.3)
#: With the SwiGLU clamp, elements whose FP8 h and FP32 h lie on either side of the limit get the gradient on one
#: side and 0 on the other (the BF16 suite's CLAMP_TOLERANCE, wider as FP8's h is ~3 % off): measured 11 % L1.
CLAMP_TOLERANCE = (0.15, float("inf"))
#: The routed experts' weight gradients in BF16 are 0.3-0.6 % off the oracle: above this, FP8 really ran.
FP8_RAN = 2e-2

# (name, tokens per rank, routing, drop, seed, activation)
CASES = {
    1: [("uniform", (37,), "uniform", 0.0, 1, SWIGLU)],
    2: [("uneven-wraps", (40, 33), "uniform", 0.1, 5, GEGLU), ("one-rank-gpt-oss", (17, 23), "one-rank", 0.1, 3, GPT_OSS)],
}


def _grads(world, p, activation, precision, config=None):
    leaves = {name: getattr(p, name).detach().clone().requires_grad_()
              for name in ("x", "router_weights", "w_gate_up", "w_down")}
    shared = [(a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()) for a, b in p.shared]
    out = moe(world, leaves["x"], p.top_experts, leaves["router_weights"], leaves["w_gate_up"], leaves["w_down"],
              shared, activation, precision=precision, config=config)
    out.backward(p.d_out)
    grads = {name: t.grad for name, t in leaves.items()}
    grads["shared"] = [(a.grad, b.grad) for a, b in shared]
    return out.detach(), _flatten(grads)


def _suite(world, cases, precision, knobs):
    """Each case's errors against the oracle, and whether its gradients are the same bits again: rerun (None),
    and under each config of ``knobs`` for the first case."""
    results = []
    for index, (name, tokens, routing, drop, seed, activation) in enumerate(cases):
        cfg = MoEConfig(**{**CONFIG.__dict__, "activation": activation})
        p = make_problem(cfg, world.rank, world.size, tokens[world.rank], dtype=torch.bfloat16, seed=seed,
                         routing=routing, drop=drop, device=world.device)
        want_out, want = ep_reference_forward_backward(world, p)
        want = _flatten(want)
        out, got = _grads(world, p, activation, precision)
        runs = [_grads(world, p, activation, precision, config)[1] for config in (knobs if index == 0 else [None])]
        results.append({
            "case": name,
            "out_rel": error_stats(out, want_out)["rel"] if out.numel() else 0.0,
            "errors": {k: (e["rel"], e["row"], e["finite"]) for k, v in want.items() if v.numel()
                       for e in [error_stats(got[k].detach(), v)]},
            "same_bits": [all(torch.equal(run[k], got[k]) for k in got) for run in runs],
        })
    return results


#: (ranks, precision, cases, knobs): fp8-block on every case, rerun and under the wrapping ring (two ranks: and
#: the other config too); mxfp8 (slower
#: under the interpreter) on the two-rank case that wraps, under the wrapping ring (the replay in MXFP8)
SUITES = [(1, "fp8-block", CASES[1], [None, WRAPPING]), (2, "fp8-block", CASES[2], [None, WRAPPING, OTHER]),
          pytest.param(2, "mxfp8", CASES[2][:1], [WRAPPING], marks=pytest.mark.slow)]  # 18 s: -m slow (CI's 15 min)


@pytest.mark.parametrize("ranks, precision, cases, knobs", SUITES)
def test_fp8_gradients_match_the_oracle_and_are_bitwise_stable(ranks, precision, cases, knobs):
    for rank, per_case in enumerate(launch(_suite, ranks, cases, precision, knobs)):
        for r, case in zip(per_case, cases):
            rel_tol, row_tol = CLAMP_TOLERANCE if case[5].limit is not None else GRAD_TOLERANCE
            assert r["out_rel"] < 8e-2, (ranks, rank, r)
            for name, (rel, row, finite) in r["errors"].items():
                assert finite and rel <= rel_tol and row <= row_tol, (ranks, rank, r["case"], name, rel, row)
            assert r["errors"]["w_gate_up"][0] > FP8_RAN and r["errors"]["w_down"][0] > FP8_RAN, r
            assert all(r["same_bits"]), (ranks, rank, r)



def _filled_ring_grads(world, precision):
    """Each config's output and gradients with the kept E4M3 ring (rows and scales, allocated unfilled) filled
    with zero bytes, then with NaN bytes (E4M3 0x7F, FP32 / E8M0 0xFF) before the forward writes it; and how many
    forwards each fill reached."""
    from megamoe.megakernel import kernel as K

    real = K.MegaKernel.training_buffers
    p = make_problem(CONFIG, world.rank, world.size, 37, dtype=torch.bfloat16, seed=4, routing="uniform", drop=0.1,
                     device=world.device)
    runs, filled, rings = {}, {}, []
    for byte in (0x00, 0x7F):
        def fill(self, byte=byte):
            b = real(self)
            filled[byte] = filled.get(byte, 0) + 1
            b.ring_x.view(torch.uint8).fill_(byte)
            b.ring_scale.view(torch.uint8).fill_(0xFF if byte else 0)
            rings.append(b.ring_x)
            return b
        K.MegaKernel.training_buffers = fill
        try:
            runs[byte] = [_grads(world, p, SWIGLU, precision, config) for config in (None, WRAPPING)]
        finally:
            K.MegaKernel.training_buffers = real
    untouched = [bool((ring.view(torch.uint8) == 0x7F).all()) for ring in rings[2:]]  # the poisoned ones, after
    return runs, filled, untouched


@pytest.mark.parametrize("precision", ["fp8-block", pytest.param("mxfp8", marks=pytest.mark.slow)])
def test_the_kept_e4m3_ring_needs_no_zero_fill(precision):
    """The ring's rows no route writes (between expert regions, past the last) never reach a result: NaN bytes
    there give the zero bytes' outputs and gradients, bit for bit, with the planner's ring and one that wraps (one
    rank's mxfp8 writes none of it: its backward reads x by token)."""
    runs, filled, untouched = launch(_filled_ring_grads, 1, precision)[0]
    assert filled == {0x00: 2, 0x7F: 2}, filled
    # one rank's mxfp8 as the BF16 kernels with BF16 wgrads reads x by token: its forward gathers no E4M3 x rows
    # (the planner's config); the wrapping ring runs the megakernel, whose pulls land in the ring
    assert untouched == [precision == "mxfp8", False], untouched
    for (out0, grads0), (out1, grads1) in zip(runs[0x00], runs[0x7F]):
        assert torch.equal(out0, out1) and bool(torch.isfinite(out1.float()).all())
        assert all(torch.equal(grads0[k], grads1[k]) and bool(torch.isfinite(grads1[k].float()).all())
                   for k in grads0), [k for k in grads0 if not torch.equal(grads0[k], grads1[k])]

def _api(world):
    cfg = MoEConfig(**{**CONFIG.__dict__})
    p = make_problem(cfg, world.rank, world.size, 9, dtype=torch.bfloat16, seed=2, device=world.device)
    x = p.x.clone().requires_grad_()
    args = (world, x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared)
    return raised([lambda: moe(*args, precision=fmt, fused_backward=True) for fmt in ("fp8-block", "mxfp8")])


def test_api_says_the_fp8_backward_runs_the_composed_kernels():
    errors = launch(_api, 2)[0]
    assert all("fused_backward=True runs BF16 experts" in e for e in errors), errors


@pytest.mark.parametrize("experts, passes", [
    (("fp8-block",), ("bwd", "step")),
    pytest.param(("fp8-block", "mxfp8"), ("fwd", "bwd", "step"), marks=pytest.mark.slow),  # ~2 min on 2 cores
])
def test_bench_checks_every_fp8_gradient(experts, passes):
    """`megamoe bench --experts fp8-block,mxfp8 --passes fwd,bwd,step` on two CPU ranks: every pass checked
    against the oracle (the FP8 bounds). CI runs fp8-block's gradients (its forward and mxfp8's: tests/test_cli.py;
    mxfp8's layer gradients: the suite above), the slow run the whole command."""
    from megamoe.bench.harness import BenchOptions, run_rank

    opts = BenchOptions(preset="tiny", tokens=(16,), ep=2, device="cpu", impls=("megamoe",), experts=experts,
                        passes=passes, iters=1, warmup=0)
    records = launch(run_rank, 2, opts)[0]
    got = sorted((r["impl"], r["pass"]) for r in records)
    assert got == sorted((f"megamoe ({fmt} experts)", name) for fmt in experts for name in passes), got
    assert all(r["correct"] for r in records), records
    assert all(r["rel_err"] > 1e-2 for r in records), records  # FP8 really ran


TRAIN_MODEL = MoEConfig(hidden=128, intermediate=128, num_experts=8, top_k=2, shared=(32,))
#: The FP8 models' loss against the BF16 model's, per step (same weights, data, AdamW):
#: |fp8 - bf16| <= TRAIN_LOSS_TOLERANCE * bf16 + TRAIN_LOSS_FLOOR * the first step's loss. Measured on 2 CPU ranks:
#: over 4 steps the gap is 1.0e-2 (fp8-block) and 2.6e-2 (mxfp8) of the BF16 loss; over 50 steps the loss falls
#: 1300x (0.66 -> 5e-4) and the FP8 models settle on a floor ~1e-4 above BF16's (the relative gap then reaches
#: 0.17; the gap never exceeds 5 % of the BF16 loss plus 1.0e-4 of the first: benchmarks/results/
#: 2026-12-03-fp8-train-50-steps). AdamW normalises each step, so the gradient tests above are the sharp ones;
#: this one shows the FP8 models train alike, and a drift of a few % anywhere above the floor fails it.
TRAIN_LOSS_TOLERANCE = 5e-2
TRAIN_LOSS_FLOOR = 5e-4


class _TwoBlocks(torch.nn.Module):
    """test_training's two-block model (``y = b1(x); out = y + b2(y)``) at an FP8-sized shape."""

    def __init__(self, world, precision):
        super().__init__()
        from megamoe.nn import MoEBlock

        torch.manual_seed(0)  # the routers alike on every rank and in every model
        self.b1 = MoEBlock(TRAIN_MODEL, world, seed=1, precision=precision)
        self.b2 = MoEBlock(TRAIN_MODEL, world, seed=2, precision=precision)

    def forward(self, x):
        y = self.b1(x)
        return y + self.b2(y)


def _train(world, precisions, steps):
    g = torch.Generator().manual_seed(100 + world.rank)
    x = torch.randn(16, TRAIN_MODEL.hidden, generator=g)
    target = torch.randn(16, TRAIN_MODEL.hidden, generator=g) * 0.1
    curves = {}
    for precision in precisions:
        model = _TwoBlocks(world, precision)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).float(), target)
            loss.backward()
            for name, p in model.named_parameters():  # replicated: the router and the shared experts
                if "router" in name or "shared" in name:
                    torch.distributed.all_reduce(p.grad, group=world.group)
            opt.step()
            total = loss.detach().clone()
            torch.distributed.all_reduce(total, group=world.group)
            losses.append(float(total) / world.size)
        curves[precision] = losses
    return curves


def _check_curves(curves):
    bf16 = curves["bf16"]
    gaps = {}
    for precision, losses in curves.items():
        assert losses[-1] < 0.9 * losses[0], (precision, losses)  # it learns
        # each step's gap in units of its allowance: <= 1 passes
        gaps[precision] = max(abs(a - b) / (TRAIN_LOSS_TOLERANCE * b + TRAIN_LOSS_FLOOR * bf16[0])
                              for a, b in zip(losses, bf16))
    assert all(gap <= 1.0 for gap in gaps.values()), (gaps, curves)
    return gaps


@pytest.mark.slow  # 42 s on 2 cores (CI's 15 minutes); the FP8 gradients' oracle tests above stay in CI
def test_fp8_block_model_trains_like_the_bf16_model():
    """The two-block model trained 3 steps on 2 CPU ranks in bf16 and fp8-block (a step takes ~9 s under the
    interpreter at this shape): the FP8 loss curve within TRAIN_LOSS_TOLERANCE of BF16's at every step, and
    both learn. 50 steps with mxfp8 too: the slow test below."""
    gaps = _check_curves(launch(_train, 2, ("bf16", "fp8-block"), 3)[0])
    assert gaps["fp8-block"] > 0, gaps  # the FP8 model really ran FP8


@pytest.mark.slow
@pytest.mark.timeout(3600)  # past the suite's 15 minutes: 150 interpreter steps (it timed out at 900 s, 2 cores)
def test_fp8_models_train_like_the_bf16_model():
    """50 steps in bf16, fp8-block and mxfp8 (python -m pytest -m slow)."""
    gaps = _check_curves(launch(_train, 2, ("bf16", "fp8-block", "mxfp8"), 50)[0])
    assert gaps["fp8-block"] > 0 and gaps["mxfp8"] > 0, gaps


def _bf16_wgrads(world, case, precision):
    """One case with ``planner.wgrads.BF16_WGRADS`` on (one rank: the staged BF16 tokens read by index; two: the
    pulled E4M3 rows dequantised) and off: each run's errors against the oracle, and whether the gradients with the
    switch on are the same bits under the wrapping ring."""
    from megamoe.planner import wgrads

    name, tokens, routing, drop, seed, activation = case
    cfg = MoEConfig(**{**CONFIG.__dict__, "activation": activation})
    p = make_problem(cfg, world.rank, world.size, tokens[world.rank], dtype=torch.bfloat16, seed=seed,
                     routing=routing, drop=drop, device=world.device)
    want = _flatten(ep_reference_forward_backward(world, p)[1])
    kept = wgrads.BF16_WGRADS
    try:
        runs = {}
        for switch, config in ((False, None), (True, None), (True, WRAPPING)):
            wgrads.BF16_WGRADS = switch
            runs.setdefault(switch, []).append(_grads(world, p, activation, precision, config)[1])
    finally:
        wgrads.BF16_WGRADS = kept
    errors = {switch: {k: error_stats(got[0][k].detach(), v)["rel"] for k, v in want.items() if v.numel()}
              for switch, got in runs.items()}
    on = runs[True]
    same = all(torch.equal(run[k], on[0][k]) for run in on[1:] for k in on[0])
    return errors, same


# two ranks (the pulled rows dequantised: tests/test_experts_fp8_bwd.py's E4M3 rows in CI) and mxfp8 (85 s on 2
# cores; its BF16 wgrads against their twin and the FP8 wgrads: tests/test_experts_fp8_bwd.py, its layer against the
# MXFP8 tiles: tests/test_experts_mxfp8_bf16.py) under -m slow: CI time
@pytest.mark.parametrize("ranks, precision", [(1, "fp8-block"), pytest.param(2, "fp8-block", marks=pytest.mark.slow),
                                              pytest.param(1, "mxfp8", marks=pytest.mark.slow)])
def test_fp8_bf16_wgrads_train_within_the_oracle_and_repeat(ranks, precision):
    """With the BF16 wgrads (``MEGAMOE_FP8_BF16_WGRADS``; mxfp8 as the BF16 kernels, its default) every gradient
    stays within the FP8 bounds, the routed weight gradients come closer to the oracle than the FP8 wgrads' (one
    rank: BF16 rows, nothing quantised along the tokens; two: the pulled E4M3 rows' values, quantised once, not
    twice), and they are the same bits under the wrapping ring."""
    for rank, (errors, same) in enumerate(launch(_bf16_wgrads, ranks, CASES[ranks][0], precision)):
        assert same, (ranks, rank)
        for name, rel in errors[True].items():
            assert rel <= GRAD_TOLERANCE[0], (ranks, rank, name, rel)
        for name in ("w_gate_up", "w_down"):
            assert errors[True][name] < errors[False][name], (ranks, rank, name, errors)
