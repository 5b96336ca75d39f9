"""The nccl-torch baseline equals the reference, forward and backward, on 1, 2 and 4 CPU ranks."""

import pytest
import torch

from megamoe.baselines.nccl_torch import nccl_torch_moe
from megamoe.bench.accuracy import _flatten, compare
from megamoe.bench.runners import _AutogradRunner
from megamoe.bench.problem import make_problem
from megamoe.config import MoEConfig
from megamoe.reference.ep import ep_reference_forward_backward
from megamoe.parallel.world import launch

from kinds import GPT_OSS, SWIGLU  # tests/kinds.py

CONFIG = MoEConfig(hidden=128, intermediate=64, num_experts=8, top_k=3, shared=(32,))
EMPTY_EXPERT = 5


def _check_against_reference(world, tokens, precision, activation, bias):
    cfg = MoEConfig(**{**CONFIG.__dict__, "activation": activation, "expert_bias": bias})
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    p = make_problem(cfg, world.rank, world.size, tokens[world.rank], dtype=dtype, seed=11, drop=0.15)
    # no token anywhere goes to EMPTY_EXPERT: that expert computes nothing and gets a zero gradient
    p.top_experts = torch.where(p.top_experts == EMPTY_EXPERT, -1, p.top_experts)
    want_out, want_grads = ep_reference_forward_backward(world, p)
    runner = _AutogradRunner(world, p, nccl_torch_moe)
    out = runner.forward()
    grads = runner.backward(out)
    fwd = compare({"out": out.detach()}, {"out": want_out}, precision)
    bwd = compare(_flatten(grads), _flatten(want_grads), precision)
    experts = p.w_gate_up.shape[0]
    local_empty = EMPTY_EXPERT - world.rank * experts
    empty_grad_zero = None
    if 0 <= local_empty < experts:
        empty_grad_zero = bool(grads["w_gate_up"][local_empty].eq(0).all() and grads["w_down"][local_empty].eq(0).all())
    return fwd, bwd, empty_grad_zero


@pytest.mark.parametrize(
    "tokens, precision, activation, bias",
    [
        ((37,), "fp32", SWIGLU, False),
        ((29, 0), "fp32", GPT_OSS, False),  # a rank with no tokens at all
        ((23, 5, 41, 1), "fp32", SWIGLU, False),
        ((40, 17), "bf16", SWIGLU, False),
        ((31, 9), "fp32", GPT_OSS, True),  # gpt-oss's expert biases, their gradients checked too
    ],
)
def test_matches_reference(tokens, precision, activation, bias):
    results = launch(_check_against_reference, len(tokens), tokens, precision, activation, bias)
    for rank, (fwd, bwd, empty_grad_zero) in enumerate(results):
        assert fwd["correct"], (rank, fwd)
        assert bwd["correct"], (rank, bwd)
        if precision == "fp32":  # tight: only summation order differs
            assert fwd["rel_err"] < 1e-5 and bwd["rel_err"] < 1e-5 and bwd["row_err"] < 1e-4, (rank, fwd, bwd)
        assert empty_grad_zero in (None, True)
    assert any(r[2] is True for r in results)  # the empty expert was checked on its rank


def _bad_call(world):
    p = make_problem(CONFIG, world.rank, world.size, 4, dtype=torch.float32)
    errors = []
    for args in (
        (p.x[:, :32], p.top_experts, p.router_weights, p.w_gate_up, p.w_down),
        (p.x, p.top_experts[:3], p.router_weights, p.w_gate_up, p.w_down),
        (p.x, p.top_experts, p.router_weights, p.w_gate_up[:, :, :64], p.w_down),
    ):
        try:
            nccl_torch_moe(world, *args)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_bad_input_raises_value_error():
    errors = launch(_bad_call, 1)[0]
    assert len(errors) == 3
    assert "multiple of 64" in errors[0] and "rows but x has" in errors[1] and "w_gate_up" in errors[2]


def test_compare_catches_one_wrong_row_that_relative_l1_misses():
    from megamoe.bench.accuracy import compare

    ref = torch.randn(4096, 64)
    bad = ref.clone()
    bad[17] = -bad[17]  # one route combined with the wrong sign
    result = compare({"d": bad}, {"d": ref}, "bf16")
    assert result["rel_err"] < 1e-2 * 0.1  # the L1 check alone would pass it
    assert not result["correct"] and result["row_err"] > 1.0
    assert compare({"d": ref.bfloat16()}, {"d": ref}, "bf16")["correct"]
    assert not compare({"d": ref[:-1]}, {"d": ref}, "bf16")["correct"]
    nan = ref.clone()
    nan[3, 3] = float("nan")
    assert not compare({"d": nan}, {"d": ref}, "bf16")["correct"]


def _no_tokens_anywhere(world):
    p = make_problem(MoEConfig(hidden=64, intermediate=32, num_experts=4, top_k=2, shared=(32,)), world.rank,
                     world.size, 0, dtype=torch.float32, seed=0)
    leaves = [t.clone().requires_grad_() for t in (p.w_gate_up, p.w_down, *p.shared[0])]
    out = nccl_torch_moe(world, p.x, p.top_experts, p.router_weights, leaves[0], leaves[1],
                         [(leaves[2], leaves[3])])
    out.backward(torch.zeros_like(out))
    return [None if t.grad is None else (tuple(t.grad.shape) == tuple(t.shape) and not t.grad.any().item())
            for t in leaves]


def test_no_tokens_on_any_rank_gives_zero_gradients_not_none():
    """With no rows at all the weights still get (zero) gradients: the empty GEMMs stay in the graph."""
    for grads in launch(_no_tokens_anywhere, 2):
        assert grads == [True, True, True, True], grads
