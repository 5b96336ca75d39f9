"""The FP8 weight pack made once per optimizer step: its transposed weights are the ones the backward would make,
the layer gives the same bits with and without it, it spares the backward's quantisation, and megamoe.MoE keeps
one per step (a pack the layer cannot use: docs/errors.md, tests/test_bad_inputs.py)."""

import pytest
import torch

from megamoe.autograd import moe
from megamoe.bench.problem import make_problem
from megamoe.config import MoEConfig
from megamoe.ops import expert_weights, experts_mxfp8
from megamoe.ops.expert_weights import PackCache, QuantizedExperts, quantize_experts, transposed_weights
from megamoe.parallel.world import launch
from megamoe.planner import KernelConfig

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONFIG = MoEConfig(hidden=128, intermediate=128, num_experts=4, top_k=2, shared=(32,))
#: a ring of 64 rows: the backward replays the rows past it with the forward's FP8 gate/up
WRAPPING = KernelConfig(num_sms=4, comm_sms=2, minibatch=32, ring_rows=64, tile_m=32, tile_n=32, backward_minibatch=64)


def _weights(experts=3, i=128, d=256, seed=0):
    """(w_gate_up, w_down); d=128 gives one 128-column block, whose scales have a size-1 dim."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, 2 * i, d, generator=g).bfloat16().to(DEVICE),
            torch.randn(experts, d, i, generator=g).bfloat16().to(DEVICE))


@pytest.mark.parametrize("fmt, i, d", [("fp8-block", 128, 256), ("fp8-block", 256, 128), ("mxfp8", 96, 256)])
def test_pack_transposes_are_the_backwards_own(fmt, i, d, monkeypatch):
    """fp8-block's transposes come from the forward pack (the same 128x128 blocks transposed), mxfp8's from the
    masters (its tiles' backward: AS_BF16 off): bit for bit what the backward made for itself before."""
    monkeypatch.setattr(experts_mxfp8, "AS_BF16", False)
    gu, dn = _weights(i=i, d=d)
    q = quantize_experts(gu, dn, fmt, backward=True)
    want = transposed_weights(gu, dn, fmt)
    for got, ref in zip(q.transposed.tensors(), want.tensors()):
        assert got.shape == ref.shape and got.stride() == ref.stride()
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), fmt
    forward_only = quantize_experts(gu, dn, fmt)
    assert forward_only.transposed is None
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(forward_only.tensors(), q.tensors()[:4]))
    for got, ref in zip(forward_only.backward_weights(gu, dn).tensors(), want.tensors()):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


def test_flattened_pack_round_trips_and_refuses_other_lengths():
    gu, dn = _weights()
    q = quantize_experts(gu, dn, "fp8-block", backward=True)
    back = QuantizedExperts.from_tensors("fp8-block", q.tensors(), gu, dn)
    assert back.source == q.source and back.transposed is not None
    assert all(a is b for a, b in zip(back.tensors(), q.tensors()))
    assert QuantizedExperts.from_tensors("fp8-block", [], gu, dn) is None
    with pytest.raises(ValueError, match="4 or 8 tensors"):
        QuantizedExperts.from_tensors("fp8-block", q.tensors()[:5], gu, dn)


def test_cache_keeps_the_pack_until_the_weights_change():
    gu, dn = _weights()
    cache = PackCache()
    first = cache.get(gu, dn, "fp8-block", backward=False)
    assert cache.get(gu, dn, "fp8-block", backward=False) is first
    with_t = cache.get(gu, dn, "fp8-block", backward=True)  # a backward needs the transposes the pack lacks
    assert with_t is not first and with_t.transposed is not None
    assert cache.get(gu, dn, "fp8-block", backward=False) is with_t  # a forward-only call takes it as it is
    with torch.no_grad():
        gu.mul_(-2.0)  # an optimizer step: in place, the version moves
    fresh = cache.get(gu, dn, "fp8-block", backward=True)
    assert fresh is not with_t
    want = quantize_experts(gu, dn, "fp8-block", backward=True)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fresh.tensors(), want.tensors()))
    assert cache.get(gu, dn, "mxfp8", backward=False).precision == "mxfp8"


def test_cache_refreshes_after_any_optimizer_step():
    """A step whose update the stamps cannot see (FSDP2 gathers the weights into a parameter of version 0 that
    may sit at the same address) still makes a new pack; clear() drops it too."""
    gu, dn = _weights()
    cache = PackCache()
    first = cache.get(gu, dn, "fp8-block", backward=False)
    other = torch.nn.Parameter(torch.zeros(1, device=DEVICE))
    opt = torch.optim.SGD([other], lr=1.0)
    other.grad = torch.ones(1, device=DEVICE)
    opt.step()
    second = cache.get(gu, dn, "fp8-block", backward=False)
    assert second is not first
    assert cache.get(gu, dn, "fp8-block", backward=False) is second
    cache.clear()
    assert cache.pack is None and cache.get(gu, dn, "fp8-block", backward=False) is not second


def test_a_cache_owns_its_step_hook_and_a_copy_is_a_new_cache():
    """The step hook is the cache's own: it goes with the cache (no hook left behind, no module state), and a
    deep copy (a model copied with its layers) starts empty with a hook of its own."""
    import copy
    import gc

    from torch.optim.optimizer import _global_optimizer_post_hooks

    gu, dn = _weights()
    before = len(_global_optimizer_post_hooks)
    cache = PackCache()
    assert len(_global_optimizer_post_hooks) == before + 1
    cache.get(gu, dn, "fp8-block", backward=False)
    twin = copy.deepcopy(cache)
    assert twin.pack is None and len(_global_optimizer_post_hooks) == before + 2
    twin.get(gu, dn, "fp8-block", backward=False)
    other = torch.nn.Parameter(torch.zeros(1, device=DEVICE))
    opt = torch.optim.SGD([other], lr=1.0)
    other.grad = torch.ones(1, device=DEVICE)
    opt.step()
    assert cache.pack is None and twin.pack is None  # each hook dropped its own cache's pack
    del cache, twin
    gc.collect()
    assert len(_global_optimizer_post_hooks) == before


def _layer(world, precision, config):
    """Out and every gradient with no pack, with a forward-only pack and with the whole pack; the quantiser
    launches of weights each backward made."""
    p = make_problem(CONFIG, world.rank, world.size, 37 - 6 * world.rank, dtype=torch.bfloat16, seed=4,
                     device=world.device)
    launches = []
    real = {name: getattr(expert_weights, name) for name in ("quantize_weights", "mx_round_weights")}

    def counting(name):
        def counted(*args, **kwargs):
            launches[-1] += 1
            return real[name](*args, **kwargs)
        return counted

    results = []
    for backward in (None, False, True):
        leaves = {name: getattr(p, name).detach().clone().requires_grad_()
                  for name in ("x", "router_weights", "w_gate_up", "w_down")}
        q = None if backward is None else quantize_experts(leaves["w_gate_up"], leaves["w_down"], precision,
                                                           backward=backward)
        out = moe(world, leaves["x"], p.top_experts, leaves["router_weights"], leaves["w_gate_up"], leaves["w_down"],
                  p.shared, precision=precision, config=config, experts_q=q)
        launches.append(0)
        for name in real:
            setattr(expert_weights, name, counting(name))
        try:
            out.backward(p.d_out)
        finally:
            for name, fn in real.items():
                setattr(expert_weights, name, fn)
        results.append({"out": out.detach(), **{name: t.grad for name, t in leaves.items()}})
    same = [all(torch.equal(r[k], results[0][k]) for k in results[0]) for r in results[1:]]
    return same, launches


@pytest.mark.parametrize("ranks, precision, config", [
    pytest.param(1, "fp8-block", None, marks=pytest.mark.slow),  # the two-rank case covers it, and the replay
    (2, "fp8-block", WRAPPING),
    pytest.param(2, "mxfp8", WRAPPING, marks=pytest.mark.slow),
])
def test_layer_gives_the_same_bits_with_the_pack_and_skips_the_backwards_quantisation(ranks, precision, config):
    for same, launches in launch(_layer, ranks, precision, config):
        assert all(same), same
        # without a pack the backward quantises the transposes (2 launches; 2 more where a wrapped ring's replay
        # quantised the forward's weights); mxfp8's dgrad weights are made from the masters unless the pack holds
        # them (as the BF16 kernels, the default: the four rounded weights, 4 launches; as its tiles the two E4M3
        # transposes), fp8-block's come from the pack by transposition
        mxfp8 = 4 if experts_mxfp8.runs_as_bf16("mxfp8") else 2
        assert launches[0] >= 2 and launches[1:] == [mxfp8 if precision == "mxfp8" else 0, 0], launches


def _module_steps(world):
    """megamoe.MoE in fp8-block over two optimizer steps: its pack, and its outputs and gradients against moe()
    without a pack on the same weights."""
    from megamoe.nn import MoE

    m = MoE(CONFIG, world, precision="fp8-block", seed=3)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    p = make_problem(CONFIG, world.rank, world.size, 21, dtype=torch.bfloat16, seed=6, device=world.device)
    packs, same = [], []
    for _ in range(2):
        opt.zero_grad()
        out = m(p.x, p.top_experts, p.router_weights)
        out.backward(p.d_out)
        packs.append(m.weights_q.pack)
        assert m(p.x, p.top_experts, p.router_weights) is not None and m.weights_q.pack is packs[-1]
        w = {name: getattr(m, name).detach().clone().requires_grad_() for name in ("w_gate_up", "w_down")}
        ref = moe(world, p.x, p.top_experts, p.router_weights, w["w_gate_up"], w["w_down"], list(
            zip(m.shared_gate_up, m.shared_down)), precision="fp8-block")
        ref.backward(p.d_out)
        same.append(torch.equal(out, ref) and all(torch.equal(getattr(m, n).grad, w[n].grad) for n in w))
        opt.step()
    m.load_state_dict(m.state_dict())
    return packs[0] is not packs[1] and packs[0].transposed is not None and m.weights_q.pack is None, same


def test_module_makes_one_pack_per_optimizer_step():
    for fresh, same in launch(_module_steps, 1):
        assert fresh and all(same), (fresh, same)
