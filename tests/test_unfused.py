"""The unfused forward (standalone kernels in sequence) equals the EP reference on 1, 2 and 4 CPU ranks.

Each `launch` costs seconds, so one launch per rank count runs a table of
cases on the same process group (and so on the same cached workspaces).
"""

import pytest
import torch

from megamoe.bench.harness import compare
from megamoe.bench.problem import make_problem
from megamoe.config import MoEConfig
from megamoe.reference.ep import ep_reference_forward_backward
from megamoe.baselines.unfused import unfused_moe_forward
from megamoe.parallel.world import launch

from kinds import CLAMPED, SWIGLU  # tests/kinds.py

from raised import raised  # tests/raised.py

CONFIG = MoEConfig(hidden=128, intermediate=64, num_experts=8, top_k=3, shared=(32,))
EMPTY_EXPERT = 5

# (name, tokens per rank, routing, drop, seed, activation). Consecutive cases with the same
# largest N reuse one workspace: a later case with more -1 routes would pick up stale slots.
CASES = {
    1: [
        ("uniform", (37,), "uniform", 0.0, 1, SWIGLU),
        ("drops-limit", (37,), "uniform", 0.4, 2, CLAMPED),
        ("one-rank", (20,), "one-rank", 0.1, 3, SWIGLU),
        ("no-tokens", (0,), "uniform", 0.0, 4, SWIGLU),
    ],
    2: [
        ("uneven", (29, 0), "uniform", 0.15, 1, SWIGLU),
        ("uneven-again", (29, 3), "uniform", 0.6, 2, CLAMPED),
        ("one-rank", (17, 23), "one-rank", 0.1, 3, SWIGLU),
        ("swap", (0, 29), "uniform", 0.2, 4, SWIGLU),
    ],
    4: [
        ("uneven", (13, 5, 21, 0), "uniform", 0.15, 1, SWIGLU),
        ("same-ws-new-routing", (21, 0, 7, 12), "zipf", 0.5, 2, SWIGLU),
    ],
}


def _problem(world, cfg, tokens, routing, drop, seed):
    p = make_problem(cfg, world.rank, world.size, tokens[world.rank], dtype=torch.bfloat16, seed=seed,
                     routing=routing, drop=drop)
    p.top_experts = torch.where(p.top_experts == EMPTY_EXPERT, -1, p.top_experts)  # an expert with no tokens
    # weights of -1 routes are ignored by the layer: make them nonzero so a stale or unmasked slot shows
    p.router_weights = torch.where(p.top_experts >= 0, p.router_weights, 0.5)
    return p


def _call(world, p):
    return unfused_moe_forward(world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down,
                               p.shared, p.config.activation)


def _suite(world, cases):
    results = []
    for c, (name, tokens, routing, drop, seed, activation) in enumerate(cases):
        cfg = MoEConfig(**{**CONFIG.__dict__, "activation": activation})
        p = _problem(world, cfg, tokens, routing, drop, seed)
        want = ep_reference_forward_backward(world, p, with_grads=False)[0]
        out = _call(world, p)
        again = _call(world, p) if c == 0 else out  # determinism: one repeat per launch
        fwd = compare({"out": out.float()}, {"out": want.float()}, "bf16")
        results.append({
            "case": name,
            "correct": fwd["correct"],
            "rel_err": fwd["rel_err"],
            "row_err": fwd["row_err"],
            "dtype_ok": out.dtype == torch.bfloat16 and out.shape == p.x.shape,
            "deterministic": torch.equal(out, again),
        })
    if world.size == 1:
        results.append(_bad_calls(world))
    return results


@pytest.mark.parametrize("ranks", sorted(CASES))
def test_matches_reference(ranks):
    results = launch(_suite, ranks, CASES[ranks])
    if ranks == 1:
        _check_bad_calls(results[0].pop())
    for rank, per_case in enumerate(results):
        assert len(per_case) == len(CASES[ranks])
        for r in per_case:
            assert r["correct"] and r["rel_err"] < 1e-2, (ranks, rank, r)
            assert r["dtype_ok"] and r["deterministic"], (ranks, rank, r)


def _bad_calls(world):
    p = make_problem(CONFIG, world.rank, world.size, 4, dtype=torch.bfloat16)
    bad = [
        (p.x[:, :32], p.top_experts, p.router_weights, p.w_gate_up, p.w_down),
        (p.x, p.top_experts[:3], p.router_weights, p.w_gate_up, p.w_down),
        (p.x, p.top_experts, p.router_weights, p.w_gate_up[:, :, :64], p.w_down),
        (p.x.float(), p.top_experts, p.router_weights, p.w_gate_up, p.w_down),
        (p.x, torch.full_like(p.top_experts, CONFIG.num_experts), p.router_weights, p.w_gate_up, p.w_down),
    ]
    return raised(lambda args=args: unfused_moe_forward(world, *args) for args in bad)


def _check_bad_calls(errors):
    """Bad inputs raise ValueError (run inside the 1-rank launch)."""
    assert all(errors), errors
    assert "multiple of 64" in errors[0] and "rows but x has" in errors[1] and "w_gate_up" in errors[2]
    assert "bfloat16" in errors[3] and "top_experts holds ids" in errors[4]


def _odd_shapes(world):
    """k = E, a prime E, D not a multiple of 256, fewer tokens than a tile: unfused and nccl-torch."""
    from megamoe.baselines.nccl_torch import nccl_torch_moe

    cfg = MoEConfig(hidden=192, intermediate=64, num_experts=7, top_k=7, shared=())
    p = make_problem(cfg, world.rank, world.size, 5, dtype=torch.bfloat16, seed=21)
    want, _ = ep_reference_forward_backward(world, p, with_grads=False)
    args = (p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared, cfg.activation)
    return [compare({"out": fn(world, *args).detach()}, {"out": want}, "bf16")
            for fn in (unfused_moe_forward, nccl_torch_moe)]


def test_odd_shapes_k_equals_prime_e():
    for check in launch(_odd_shapes, 1)[0]:
        assert check["correct"] and check["rel_err"] < 1e-2, check
