"""megamoe.adapters.torchtitan: torchtitan's MoE layer (its router, shared experts and load-balancing bias)
with its routed experts swapped for megamoe's on 2 CPU ranks gives the unswapped layer's output and gradients
within BF16 tolerance, and its state_dict keeps torchtitan's keys both ways."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist

from megamoe.bench.accuracy import error_stats
from megamoe.parallel.world import launch
from raised import raised  # tests/raised.py

titan = pytest.importorskip("torchtitan.models.common.moe", reason="torchtitan is not installed")

D, F, E, K = 64, 32, 8, 3
#: torchtitan's experts run torch._grouped_mm in BF16 as megamoe's do; the orders of their sums differ.
OUT_TOLERANCE = 1e-2
GRAD_TOLERANCE = 2e-2


def _layer(seed: int):
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    lin = lambda i, o: Linear.Config(in_features=i, out_features=o)  # noqa: E731
    config = titan.MoE.Config(
        num_experts=E,
        routed_experts=titan.RoutedExperts.Config(
            inner_experts=titan.GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K)),
        # DeepSeek-V3's routing: sigmoid scores, node-limited groups, normalised and scaled weights, a bias
        router=titan.TokenChoiceTopKRouter.Config(num_experts=E, gate=lin(D, E), top_k=K, score_func="sigmoid",
                                                  num_expert_groups=4, num_limited_groups=2, route_norm=True,
                                                  route_scale=2.5),
        shared_experts=FeedForward.Config(w1=lin(D, F), w2=lin(F, D), w3=lin(D, F)))
    torch.manual_seed(seed)
    layer = config.build()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
        layer.expert_bias_E.normal_(0.0, 0.05)
    return layer.train()


def _x(world, seed: int) -> torch.Tensor:
    return torch.randn(2, 9 + 4 * world.rank, D, generator=torch.Generator().manual_seed(seed + world.rank))


def _rel(got, want) -> float:
    return error_stats(got, want)["rel"]


def _parity(world):
    from megamoe.adapters.torchtitan import TitanRoutedExperts, patch

    layer = _layer(seed=1)
    patched = patch(copy.deepcopy(layer), world)
    x = _x(world, seed=2)
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(3 + world.rank))
    xs = [x.clone().requires_grad_() for _ in range(2)]
    want, got = layer(xs[0]), patched(xs[1])
    want.backward(d_out)
    got.backward(d_out)
    errors = {"out": _rel(got.detach(), want.detach()), "x": _rel(xs[1].grad, xs[0].grad)}
    mine = dict(patched.named_parameters())
    inner = layer.routed_experts.inner_experts
    for name, p in layer.named_parameters():
        if name.startswith("routed_experts."):
            continue
        errors[name] = _rel(mine[name].grad, p.grad)
    # the experts: torchtitan's per-rank gradients summed over the ranks, this rank's slice, as [w1 | w3] and w2
    L = E // world.size
    rows = slice(world.rank * L, (world.rank + 1) * L)
    summed = {}
    for key in ("w1_EFD", "w3_EFD", "w2_EDF"):
        g = getattr(inner, key).grad.clone()
        dist.all_reduce(g, group=world.group)
        summed[key] = g[rows]
    experts = patched.routed_experts
    errors["w_gate_up"] = _rel(experts.w_gate_up.grad, torch.cat([summed["w1_EFD"], summed["w3_EFD"]], dim=1))
    errors["w_down"] = _rel(experts.w_down.grad, summed["w2_EDF"])
    counted = torch.equal(patched.tokens_per_expert_E, layer.tokens_per_expert_E)
    return errors, isinstance(experts, TitanRoutedExperts), tuple(experts.w_gate_up.shape), counted


def _both(world):
    return _parity(world), _round_trip(world)


@functools.cache
def _runs() -> list[tuple]:
    """Both checks in one launch of 2 CPU ranks (a launch costs seconds)."""
    return launch(_both, 2)


def test_swapped_layer_gives_torchtitans_output_and_gradients():
    for rank, ((errors, swapped, shape, counted), _) in enumerate(_runs()):
        assert swapped and shape == (E // 2, 2 * F, D), (rank, shape)
        assert errors.pop("out") < OUT_TOLERANCE, (rank, errors)
        bad = {k: e for k, e in errors.items() if not e < GRAD_TOLERANCE}
        assert not bad, (rank, bad)
        assert counted, "the load-balancing token counts differ: the router is not torchtitan's own"


def _round_trip(world):
    from megamoe.adapters.torchtitan import patch

    layer = _layer(seed=4).eval()
    patched = patch(copy.deepcopy(layer), world).eval()
    x = _x(world, seed=5)
    state = patched.state_dict()  # collective: torchtitan's keys, full experts
    other = _build_other(6)
    other.load_state_dict(state, strict=True)
    again = patch(_build_other(7), world).eval()
    again.load_state_dict(layer.state_dict(), strict=True)
    with torch.no_grad():
        same_back = torch.equal(other(x), layer(x))
        same_again = torch.equal(again(x), patched(x))
    keys = set(state) == set(layer.state_dict()) and all(state[k].shape == v.shape
                                                         for k, v in layer.state_dict().items())
    return keys, same_back, same_again


def _build_other(seed: int):
    return _layer(seed).eval()


def test_state_dict_keeps_torchtitans_keys_both_ways():
    for rank, (_, (keys, back, again)) in enumerate(_runs()):
        assert keys, f"rank {rank}: a swapped layer's state_dict is not torchtitan's keys and shapes"
        assert back, f"rank {rank}: an unswapped layer loading a swapped state_dict differs from the original"
        assert again, f"rank {rank}: a swapped layer loading torchtitan's state_dict differs from the first"


def _refusals(world):
    from megamoe.adapters.torchtitan import patch

    return raised([lambda: patch(torch.nn.Linear(4, 4), world)])[0]


def test_patch_refuses_a_model_without_a_torchtitan_moe():
    (message,) = launch(_refusals, 1)
    assert message is not None and "no torchtitan MoE layer" in message, message
