"""The deepep-torch baseline: its permute against the layout's definition, and the whole layer (DeepEP's dispatch
layout played by the torch twin) against the reference, forward and backward, on CPU ranks."""

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from megamoe.baselines import deepep_torch as dt
from megamoe.bench.accuracy import _flatten, compare
from megamoe.bench.runners import _AutogradRunner
from megamoe.bench.problem import make_problem
from megamoe.config import MoEConfig
from megamoe.parallel.world import launch
from megamoe.reference.ep import ep_reference_forward_backward

from kinds import CLAMPED, SWIGLU  # tests/kinds.py

CONFIG = MoEConfig(hidden=128, intermediate=64, num_experts=8, top_k=3, shared=(32,))


def test_permute_plan_groups_every_route_by_expert_with_aligned_zeroed_padding():
    g = torch.Generator().manual_seed(3)
    experts, k, align = 5, 3, 8
    recv_idx = torch.randint(-1, experts, (41, k), generator=g)
    recv_idx[recv_idx == 2] = -1  # an expert with no routes
    counts = torch.bincount(recv_idx[recv_idx >= 0], minlength=experts).tolist()
    row_of, token, rows, pad_rows, ends, total = dt.permute_plan(recv_idx, counts, align)
    padded = [-(-c // align) * align for c in counts]
    assert ends.tolist() == torch.tensor(padded).cumsum(0).tolist() and total == sum(padded)
    valid = recv_idx >= 0
    assert bool((row_of[~valid] == -1).all())
    got = row_of[valid]
    assert got.unique().numel() == got.numel() == sum(counts)  # every route a row of its own
    starts = [e - p for e, p in zip(ends.tolist(), padded)]
    for t, j in valid.nonzero().tolist():  # each route inside its expert's group, in token order
        e, r = int(recv_idx[t, j]), int(row_of[t, j])
        assert starts[e] <= r < starts[e] + counts[e]
    for e in range(experts):
        group = [(t, j) for t, j in valid.nonzero().tolist() if recv_idx[t, j] == e]
        assert [int(row_of[t, j]) for t, j in group] == list(range(starts[e], starts[e] + counts[e]))
    assert sorted(set(range(total)) - set(got.tolist())) == sorted(pad_rows.tolist())
    token_at_row = torch.full((total,), -1, dtype=torch.long).index_put_((rows,), token)
    for t, j in valid.nonzero().tolist():  # the permute copies each route's own token into its row
        assert int(token_at_row[row_of[t, j]]) == t


def _twin_layer(world, tokens, precision, activation):
    cfg = MoEConfig(**{**CONFIG.__dict__, "activation": activation})
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    p = make_problem(cfg, world.rank, world.size, tokens[world.rank], dtype=dtype, seed=5, drop=0.15)
    want_out, want_grads = ep_reference_forward_backward(world, p)
    runner = _AutogradRunner(world, p, partial(dt.deepep_torch_moe, backend=dt.TorchTwin(world)))
    out = runner.forward()
    grads = runner.backward(out)
    return (compare({"out": out.detach()}, {"out": want_out}, precision),
            compare(_flatten(grads), _flatten(want_grads), precision))


@pytest.mark.parametrize("tokens, precision, activation", [((29, 0), "fp32", CLAMPED), ((40, 17), "bf16", SWIGLU)])
def test_layer_through_the_dispatch_twin_matches_the_reference(tokens, precision, activation):
    """Every gradient (x, router weights, routed and shared weights) against the oracle with a random upstream
    gradient; fp32 tightly: only summation order differs."""
    for rank, (fwd, bwd) in enumerate(launch(_twin_layer, len(tokens), tokens, precision, activation)):
        assert fwd["correct"] and bwd["correct"], (rank, fwd, bwd)
        if precision == "fp32":
            assert fwd["rel_err"] < 1e-5 and bwd["rel_err"] < 1e-5 and bwd["row_err"] < 1e-4, (rank, fwd, bwd)


def test_without_deep_ep_the_layer_says_why():
    reason = dt.unavailable()
    if reason is None:
        pytest.skip("deep_ep is importable here")
    assert "deep_ep is not importable" in reason and "build.sh" in reason
    p = make_problem(CONFIG, 0, 1, 4, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="deep_ep is not importable"):  # before any collective: no world needed
        dt.deepep_torch_moe(SimpleNamespace(size=1, device=p.x.device), p.x, p.top_experts, p.router_weights,
                            p.w_gate_up, p.w_down)


def _deepep_layer(world, tokens):
    p = make_problem(CONFIG, world.rank, world.size, tokens[world.rank], dtype=torch.bfloat16, device=world.device,
                     seed=6, drop=0.15)
    want_out, want_grads = ep_reference_forward_backward(world, p)
    backend = dt.DeepEPBackend(world)
    try:
        runner = _AutogradRunner(world, p, partial(dt.deepep_torch_moe, backend=backend))
        out = runner.forward()
        grads = runner.backward(out)
    finally:
        backend.free()
    return compare({"out": out.detach()}, {"out": want_out}, "bf16"), compare(_flatten(grads), _flatten(want_grads),
                                                                                "bf16")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2 or dt.unavailable() is not None,
                    reason="needs two GPUs and DeepEP built (benchmarks/deepep/build.sh)")
def test_gpu_layer_through_deepep_matches_the_reference():
    """DeepEP's own dispatch and combine (intranode kernels, one GPU per rank: its kernels wait on their peers),
    forward and every gradient against the oracle; one rank sends nothing to the other's experts' last one."""
    for rank, (fwd, bwd) in enumerate(launch(_deepep_layer, 2, (40, 23), device="cuda")):
        assert fwd["correct"] and bwd["correct"], (rank, fwd, bwd)
