"""Property-based fuzz of the layer (megamoe.moe / megamoe_forward) against the FP32 oracle, forward and backward.

Hypothesis draws layer cases (:func:`cases`): R in 1..4 ranks with ragged token counts (0 included), k in 1..8,
E = R * L experts (k may exceed E: the routes past E are -1), D in {64, 128}, I in {32, 64} (fp8-block: both 128,
its 128-wide blocks), -1 holes, skewed routing (uniform, Zipf, every token to one rank, every token to one
expert), 0-2 shared experts, the SwiGLU clamp, the planner's config or a 64-row ring that wraps (forward and
backward minibatches of 32 or 64 rows), the fused backward megakernel or the composed kernels (on one rank in
BF16, reading d_out by token or from its routed copies: ``GATHER_BACKWARD``), zeroed router weights, and
each precision. Every case is checked on every rank against ``ep_reference_forward_backward``:

- bf16: the output (the bench's BF16 bounds and relative L1 < 1e-2, as tests/test_megakernel.py) and every
  gradient (x, router weights, routed experts, every shared expert) for a random upstream gradient, with
  tests/test_training.py's GRAD_TOLERANCE (CLAMP_TOLERANCE with the clamp: test_training says why); a hole's
  router-weight gradient is exactly 0.
- fp8-block / mxfp8 (forward only, under torch.no_grad()): the output within the bench's FP8 bounds.
- every output is finite.

Spawning ranks costs seconds and every interpreted pass a few more, so the examples are not run one by one:
Hypothesis draws the cases first (a fixed seed: the same cases every run), then each rank count's cases run in
ONE ``launch`` (one process group) and every failing case is reported with its parameters. There is no
shrinking: a failure message prints each failing case as a dict, which reruns alone with

    python tests/test_fuzz.py "{'ranks': 2, 'tokens': (3, 0), ...}"

Runs:

    python -m pytest -q tests/test_fuzz.py                # CI: 16 drawn cases + 2 wrapping ones (~50 s, 2 cores)
    python -m pytest -q -m slow tests/test_fuzz.py        # the long fuzz: 96 cases, other draws
    MEGAMOE_FUZZ_EXAMPLES=300 MEGAMOE_FUZZ_SEED=7 python -m pytest -q -m slow tests/test_fuzz.py

MEGAMOE_FUZZ_EXAMPLES sets the slow run's case count, MEGAMOE_FUZZ_SEED its Hypothesis seed (the CI run keeps
its own).
"""

from __future__ import annotations

import ast
import math
import os
import sys
from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from megamoe.autograd import moe
from megamoe.bench.accuracy import _flatten, error_stats
from megamoe.bench.accuracy import TOLERANCES
from megamoe.bench.problem import make_problem
from megamoe.config import MoEConfig
from megamoe.megakernel import megamoe_forward
from megamoe.megakernel.kernel import default_config
from megamoe.ops import experts as expert_ops
from megamoe.parallel.world import launch
from megamoe.planner import KernelConfig, LayerShape
from megamoe.reference.ep import ep_reference_forward_backward

from kinds import clamped  # tests/kinds.py

from test_training import CLAMP_TOLERANCE, GRAD_TOLERANCE  # tests/test_training.py: the gradients' bounds

#: The output's bounds (relative L1, worst row, max-abs): the bench's (megamoe.bench.harness.TOLERANCES), and
#: for BF16 relative L1 < 1e-2 as tests/test_megakernel.py and tests/test_training.py ask. FP8 against the BF16
#: oracle: the bench's 1e-1 (the recipe's own error without a shared expert is 6-7.5 %; a fuzz case's few rows of
#: D 64-128 reached 7.7 %). A lost, doubled or misrouted row still fails the row bound (its error is near 1); the
#: kernels are exact against the formats' torch twins in tests/test_megakernel.py.
FP8_OUT_TOLERANCE = TOLERANCES["fp8"]
OUT_TOLERANCE = {"bf16": (1e-2, TOLERANCES["bf16"][1], TOLERANCES["bf16"][2]), "fp8-block": FP8_OUT_TOLERANCE,
                 "mxfp8": FP8_OUT_TOLERANCE}
#: A gradient a rank holds fewer nonzero reference elements of than this (a rank with 2 tokens: its router weights'
#: gradient is 1-2 dot products, one of which may cancel to ~0.01 while its BF16 error is ~2e-3) is judged over
#: every rank's elements together (sum |err| / sum |ref|), not alone.
MIN_ELEMENTS = 32
#: Interpreter tiles are 32x32 on 4 programs: a 64-row ring wraps once a rank gets more than 64 routed rows.
CONFIGS = {
    "planner": None,
    "wrap": KernelConfig(num_sms=4, comm_sms=2, minibatch=32, ring_rows=64, tile_m=32, tile_n=32),
    "wrap-bwd64": KernelConfig(num_sms=4, comm_sms=1, minibatch=32, ring_rows=64, tile_m=32, tile_n=32,
                               backward_comm_sms=2, backward_minibatch=64),
}
ROUTINGS = ("uniform", "zipf", "one-rank", "one-expert")
MAX_TOKENS = 24
#: Cases per Hypothesis example.
BATCH = 16
#: Cases of the CI run and of the slow run (MEGAMOE_FUZZ_EXAMPLES), their Hypothesis seeds.
CI_CASES, CI_SEED = 12, 2025
SLOW_CASES = int(os.environ.get("MEGAMOE_FUZZ_EXAMPLES", "96"))
SLOW_SEED = int(os.environ.get("MEGAMOE_FUZZ_SEED", "1"))


# --------------------------------------------------------------------------- the cases


@st.composite
def cases(draw) -> dict:
    """One layer case: a picklable dict every rank builds its own share of (:func:`_problem`)."""
    ranks = draw(st.integers(1, 4))
    precision = draw(st.sampled_from(("bf16", "bf16", "fp8-block", "mxfp8")))  # bf16 has the backward
    if precision == "fp8-block":  # 128 x 128 weight blocks along D and I
        hidden, inter = 128, 128
    else:  # mxfp8: 32-element blocks
        hidden, inter = draw(st.sampled_from((64, 128))), draw(st.sampled_from((32, 64)))
    local = draw(st.integers(1, 3))
    routing = draw(st.sampled_from(ROUTINGS))
    experts = ranks * local
    case = {
        "ranks": ranks,
        "tokens": tuple(draw(st.integers(0, MAX_TOKENS)) if draw(st.integers(0, 5)) else 0 for _ in range(ranks)),
        "k": draw(st.integers(1, 8)),
        "experts": experts,
        "hidden": hidden,
        "intermediate": inter,
        "precision": precision,
        "routing": routing,
        "hot_expert": draw(st.integers(0, experts - 1)) if routing == "one-expert" else None,
        "drop": draw(st.sampled_from((0.0, 0.1, 0.4))),
        "shared": tuple(draw(st.lists(st.sampled_from((16, 32)), max_size=2))),
        "limit": draw(st.sampled_from((None, 0.8))),
        "config": draw(st.sampled_from(tuple(CONFIGS))),
        "fused_backward": draw(st.booleans()) if precision == "bf16" else False,
        "api": "moe" if precision == "bf16" else draw(st.sampled_from(("moe", "megamoe_forward"))),
        "zero_weights": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**20)),
    }
    # from the seed, not drawn: a new draw would change every case of the CI's fixed draw
    case["gather_backward"] = case["seed"] % 2 == 0
    return case


def draw_cases(count: int, hypothesis_seed: int) -> list[dict]:
    """``count`` cases from Hypothesis with a fixed seed (drawn only: running them is :func:`run_cases`).

    Hypothesis's first example is the simplest one (every case minimal) and it mutates examples it has seen into
    near copies; so each example is a batch of BATCH independently drawn cases and the first batch is left out.
    """
    batches = []

    @seed(hypothesis_seed)
    @settings(max_examples=1 + -(-count // BATCH), database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(cases(), min_size=BATCH, max_size=BATCH))
    def collect(batch):
        batches.append(batch)

    collect()
    return [case for batch in batches[1:] for case in batch][:count]


# --------------------------------------------------------------------------- on the ranks


def _problem(world, case):
    """This rank's share of ``case``: make_problem's inputs with the case's routing, -1 routes past E (or past
    the routes the routing can place), one column order per token, fresh router weights normalised over a
    token's routes (0.5 in the holes: a stale slot would show) and some exactly 0."""
    k, experts, ranks = case["k"], case["experts"], world.size
    placed = {"one-rank": min(k, experts // ranks), "one-expert": 1}.get(case["routing"], min(k, experts))
    routing = "uniform" if case["routing"] == "one-expert" else case["routing"]
    cfg = MoEConfig(hidden=case["hidden"], intermediate=case["intermediate"], num_experts=experts, top_k=placed,
                    shared=case["shared"], activation=clamped(case["limit"]))
    p = make_problem(cfg, world.rank, ranks, case["tokens"][world.rank], dtype=torch.bfloat16, seed=case["seed"],
                     routing=routing, drop=case["drop"], device=world.device)
    top = p.top_experts
    if case["routing"] == "one-expert":
        top = torch.where(top >= 0, case["hot_expert"], -1).to(torch.int32)
    n = top.shape[0]
    g = torch.Generator().manual_seed(case["seed"] * 7 + world.rank)
    top = torch.cat([top, top.new_full((n, k - placed), -1)], dim=1)
    order = torch.rand(n, k, generator=g).argsort(dim=1)
    top = top.gather(1, order).contiguous()
    logits = torch.randn(n, k, generator=g)
    weights = torch.where(top >= 0, logits, -math.inf).softmax(dim=1).nan_to_num(0.0)
    if case["zero_weights"]:  # a route whose weight is exactly 0 still has a gradient
        weights = torch.where(torch.rand(n, k, generator=g) < 0.25, 0.0, weights)
    p.top_experts = top
    p.router_weights = torch.where(top >= 0, weights, 0.5).float().contiguous()
    return p


def _grads(world, p, case, config):
    """(out, gradients) of megamoe.moe with x, the router weights and every weight requiring grad."""
    leaves = {name: getattr(p, name).detach().clone().requires_grad_()
              for name in ("x", "router_weights", "w_gate_up", "w_down")}
    shared = [(a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()) for a, b in p.shared]
    kept = expert_ops.GATHER_BACKWARD
    expert_ops.GATHER_BACKWARD = case.get("gather_backward", False)  # one rank, BF16: rows read by token
    try:
        out = moe(world, leaves["x"], p.top_experts, leaves["router_weights"], leaves["w_gate_up"],
                  leaves["w_down"], shared, clamped(case["limit"]), config=config,
                  fused_backward=case["fused_backward"])
        out.backward(p.d_out)
    finally:
        expert_ops.GATHER_BACKWARD = kept
    grads = {name: t.grad for name, t in leaves.items()}
    grads["shared"] = [(a.grad, b.grad) for a, b in shared]
    return out.detach(), _flatten(grads)


def _forward(world, p, case, config):
    """The forward alone, without autograd (the FP8 precisions have no backward)."""
    args = (world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared, clamped(case["limit"]))
    with torch.no_grad():
        if case["api"] == "megamoe_forward":
            return megamoe_forward(*args, config=config, precision=case["precision"])
        return moe(*args, config=config, precision=case["precision"], fused_backward=case["fused_backward"])


def _stats(got, want):
    e = error_stats(got, want)
    ref_sum = float(want.float().abs().sum(dtype=torch.float64))
    return {**{key: e[key] for key in ("rel", "row", "max_abs", "finite")}, "abs_sum": e["rel"] * ref_sum,
            "ref_sum": ref_sum, "nonzero": int((want != 0).sum())}


def _routed_rows(world, top_experts, local):
    """Rows this rank's experts get from every rank (its ring's rows)."""
    everyone = world.all_gather_object(top_experts.cpu())
    lo, hi = world.rank * local, (world.rank + 1) * local
    return sum(int(((t >= lo) & (t < hi)).sum()) for t in everyone)


def _run_case(world, case):
    p = _problem(world, case)
    config = CONFIGS[case["config"]]
    local = case["experts"] // world.size
    if config is None:
        shape = LayerShape(world.size, max(case["tokens"]), case["hidden"], case["intermediate"], local, case["k"],
                           sum(case["shared"]))
        ring = default_config(world, shape, case["precision"]).ring_rows
    else:
        ring = config.ring_rows
    rows = _routed_rows(world, p.top_experts, local)
    result = {"rows": rows, "wrapped": rows > ring, "errors": {}, "holes_grad": 0.0}
    if case["precision"] == "bf16":
        want_out, want = ep_reference_forward_backward(world, p)
        out, got = _grads(world, p, case, config)
        for name, ref in _flatten(want).items():
            if ref.numel():
                result["errors"][name] = _stats(got[name].detach(), ref)
        holes = p.top_experts < 0
        if bool(holes.any()):  # an unused weight's gradient is 0, as the oracle's
            result["holes_grad"] = float(got["router_weights"][holes].abs().max())
    else:
        want_out = ep_reference_forward_backward(world, p, with_grads=False)[0]
        out = _forward(world, p, case, config)
    result["shape_ok"] = out.dtype == torch.bfloat16 and tuple(out.shape) == tuple(p.x.shape)
    result["out"] = _stats(out, want_out) if out.numel() else None
    return result


def _suite(world, cases_of_r):
    results = []
    for case in cases_of_r:
        try:
            results.append(_run_case(world, case))
        except Exception as exc:  # the case names the failure (launch reports the rank that failed first)
            raise RuntimeError(f"case {case!r}: {type(exc).__name__}: {exc}") from exc
    return results


# --------------------------------------------------------------------------- checking


def problems(case, result) -> list[str]:
    """What is wrong with one rank's ``result`` for ``case`` (empty: within every bound)."""
    bad = []
    rel_tol, row_tol, abs_tol = OUT_TOLERANCE[case["precision"]]
    out = result["out"]
    if not result["shape_ok"]:
        bad.append("output dtype or shape")
    if out is not None and not (out["finite"] and out["rel"] <= rel_tol and out["row"] <= row_tol
                                and out["max_abs"] <= abs_tol):
        bad.append(f"out {out}")
    rel_tol, row_tol = CLAMP_TOLERANCE if case["limit"] is not None else GRAD_TOLERANCE
    for name, e in result["errors"].items():
        alone = _alone(case, e)
        if not (e["finite"] and (not alone or e["rel"] <= rel_tol and e["row"] <= row_tol)):
            bad.append(f"d {name} {e}")
    if result["holes_grad"] != 0.0:
        bad.append(f"router-weight gradient in a -1 slot: {result['holes_grad']}")
    return bad


def _alone(case, e) -> bool:
    """Whether one rank's gradient is judged alone: enough elements, and no clamp (with the clamp one element of
    h within a BF16 ulp of the limit flips its gradient and moves a whole row of d x: measured 0.39 of a row, 6 %
    of a 7-token rank's d x, in the long fuzz; test_training's CLAMP_TOLERANCE says why) — else over every rank."""
    return e["nonzero"] >= MIN_ELEMENTS and case["limit"] is None


def pooled_problems(case, results) -> list[str]:
    """The gradients some rank cannot be judged alone on (:func:`_alone`), over every rank's elements together."""
    rel_tol = (CLAMP_TOLERANCE if case["limit"] is not None else GRAD_TOLERANCE)[0]
    bad = []
    for name in sorted({name for r in results for name in r["errors"]}):
        per_rank = [r["errors"].get(name) for r in results]
        if all(e is not None and _alone(case, e) for e in per_rank):
            continue
        errs, refs = (sum(e[key] for e in per_rank if e is not None) for key in ("abs_sum", "ref_sum"))
        if not errs <= rel_tol * refs:
            bad.append(f"d {name} over every rank: relative L1 {errs / max(refs, 1e-30):.3g}")
    return bad


def run_cases(all_cases: list[dict]) -> tuple[list[str], list[tuple[dict, list[dict]]]]:
    """Run every case, one launch per rank count; (failures, [(case, per-rank results)])."""
    by_ranks = defaultdict(list)
    for case in all_cases:
        by_ranks[case["ranks"]].append(case)
    failures, done = [], []
    for ranks, group in sorted(by_ranks.items()):
        try:
            per_rank = launch(_suite, ranks, group)
        except RuntimeError as exc:  # a crash: the message names the case
            failures.append(f"R={ranks}: {str(exc)[:3000]}")
            continue
        for i, case in enumerate(group):
            results = [per_rank[rank][i] for rank in range(ranks)]
            done.append((case, results))
            for rank, result in enumerate(results):
                bad = problems(case, result)
                if bad:
                    failures.append(f"{case!r} rank {rank}: {'; '.join(bad)}")
            pooled = pooled_problems(case, results)
            if pooled:
                failures.append(f"{case!r}: {'; '.join(pooled)}")
    return failures, done


def _check(all_cases):
    failures, done = run_cases(all_cases)
    assert not failures, f"{len(failures)} failing (case, rank):\n" + "\n".join(failures)
    return done


#: Beside the CI draw: every token to the next rank's three experts (~80 and ~110 rows into 64-row rings), through
#: the backward megakernel and the composed kernels: a BF16 backward that replays lost minibatches, every run.
WRAPPING_CASES = [
    {"ranks": 2, "tokens": (30, 40), "k": 4, "experts": 6, "hidden": 64, "intermediate": 32, "precision": "bf16",
     "routing": "one-rank", "hot_expert": None, "drop": 0.1, "shared": (16,), "limit": None,
     "config": config, "fused_backward": fused, "api": "moe", "zero_weights": True, "seed": 77}
    for config, fused in (("wrap", True), ("wrap-bwd64", False))]


def test_fuzz_layer_against_the_oracle():
    """CI: a fixed draw of 16 cases over every rank count, precision, routing and ring, and two wrapping BF16
    cases; each within bounds."""
    all_cases = draw_cases(CI_CASES, CI_SEED) + WRAPPING_CASES
    done = _check(all_cases)
    # the draw covers what it is for (fixed: the same cases every run)
    assert {c["ranks"] for c in all_cases} == {1, 2, 3, 4}
    assert {c["precision"] for c in all_cases} == {"bf16", "fp8-block", "mxfp8"}
    assert any(any(r["wrapped"] for r in results) for case, results in done if case["precision"] == "bf16"), \
        "no bf16 case wrapped its ring: the backward's replay went unfuzzed"


@pytest.mark.slow
def test_fuzz_layer_against_the_oracle_long():
    """The long fuzz: MEGAMOE_FUZZ_EXAMPLES cases (default 96) from MEGAMOE_FUZZ_SEED (default 1)."""
    _check(draw_cases(SLOW_CASES, SLOW_SEED))


if __name__ == "__main__":  # rerun cases printed by a failure: python tests/test_fuzz.py "<case dict>" ...
    os.environ.setdefault("TRITON_INTERPRET", "1")
    failed, ran = run_cases([ast.literal_eval(arg) for arg in sys.argv[1:]])
    for case, results in ran:
        print(case)
        for rank, result in enumerate(results):
            print(f"  rank {rank}: {result}")
    print("\n".join(failed) or "every case within bounds")
    sys.exit(1 if failed else 0)
