"""The oracle against a float64 hand loop, and its gradients against float64 autograd."""

import pytest
import torch

from megamoe.reference import moe_forward, moe_forward_backward

from kinds import EVERY_KIND, clamped  # tests/kinds.py


def _inputs(n=13, d=64, i=32, e=5, k=3, dtype=torch.float64, seed=0, shared=(16,)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=dtype)
    top = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(torch.int32)
    top[torch.rand(n, k, generator=g) < 0.2] = -1
    rw = torch.rand(n, k, generator=g, dtype=torch.float32)
    wgu = torch.randn(e, 2 * i, d, generator=g, dtype=dtype) / d**0.5
    wd = torch.randn(e, d, i, generator=g, dtype=dtype) / i**0.5
    sh = [(torch.randn(2 * s, d, generator=g, dtype=dtype) / d**0.5, torch.randn(d, s, generator=g, dtype=dtype) / s**0.5)
          for s in shared]
    return x, top, rw, wgu, wd, sh


def _hand_loop(x, top, rw, wgu, wd, sh, limit):
    """Token by token, route by route, in float64."""
    def ffn(v, a, b):
        h = a.double() @ v
        gate, up = h[: a.shape[0] // 2], h[a.shape[0] // 2:]
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return b.double() @ (gate * torch.sigmoid(gate) * up)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        v = x[t].double()
        for j in range(top.shape[1]):
            e = int(top[t, j])
            if e >= 0:
                out[t] += float(rw[t, j]) * ffn(v, wgu[e], wd[e])
        for a, b in sh:
            out[t] += ffn(v, a, b)
    return out


@pytest.mark.parametrize("limit", [None, 0.7])
def test_forward_matches_float64_hand_loop(limit):
    x, top, rw, wgu, wd, sh = _inputs()
    out = moe_forward(x, top, rw, wgu, wd, sh, activation=clamped(limit))
    torch.testing.assert_close(out, _hand_loop(x, top, rw, wgu, wd, sh, limit), rtol=1e-12, atol=1e-12)


def test_bf16_forward_is_fp32_accumulated_and_keeps_dtype():
    x, top, rw, wgu, wd, sh = _inputs(dtype=torch.float64)
    args = [t.to(torch.bfloat16) for t in (x, top, rw, wgu, wd)]
    args[1], args[2] = top, rw
    sh16 = [(a.bfloat16(), b.bfloat16()) for a, b in sh]
    out = moe_forward(*args, sh16)
    assert out.dtype == torch.bfloat16
    exact = _hand_loop(args[0], top, rw, args[3], args[4], sh16, None)
    rel = (out.double() - exact).abs().sum() / exact.abs().sum()
    assert rel < 4e-3  # only the final rounding to bf16


@pytest.mark.parametrize("limit", [None, 0.5])
def test_gradients_match_float64_autograd(limit):
    x, top, rw, wgu, wd, sh = _inputs(seed=1)
    rw = rw.double()  # autograd in float64 throughout
    leaves = [t.clone().requires_grad_() for t in (x, wgu, wd)]
    sh_leaves = [(a.clone().requires_grad_(), b.clone().requires_grad_()) for a, b in sh]
    rw_leaf = rw.clone().requires_grad_()
    # moe_forward wants float32 router weights; differentiate the float64 version through a hand loop.
    out = _hand_loop_autograd(leaves[0], top, rw_leaf, leaves[1], leaves[2], sh_leaves, limit)
    d_out = torch.randn_like(out)
    out.backward(d_out)
    _, grads = moe_forward_backward(x, top, rw.float(), wgu, wd, d_out, sh, clamped(limit))
    torch.testing.assert_close(grads["x"], leaves[0].grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads["router_weights"], rw_leaf.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads["w_gate_up"], leaves[1].grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads["w_down"], leaves[2].grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads["shared"][0][0], sh_leaves[0][0].grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads["shared"][0][1], sh_leaves[0][1].grad, rtol=1e-6, atol=1e-6)


def _hand_loop_autograd(x, top, rw, wgu, wd, sh, limit):
    rows = []
    for t in range(x.shape[0]):
        acc = 0
        for j in range(top.shape[1]):
            e = int(top[t, j])
            if e >= 0:
                h = wgu[e] @ x[t]
                gate, up = h.chunk(2)
                if limit is not None:
                    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                acc = acc + rw[t, j] * (wd[e] @ (torch.nn.functional.silu(gate) * up))
        for a, b in sh:
            h = a @ x[t]
            gate, up = h.chunk(2)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            acc = acc + b @ (torch.nn.functional.silu(gate) * up)
        rows.append(acc + 0 * x[t])
    return torch.stack(rows)


def test_moe_forward_is_differentiable_by_autograd():
    x, top, rw, wgu, wd, sh = _inputs(seed=2)
    leaves = [t.clone().requires_grad_() for t in (x, rw, wgu, wd)]
    out = moe_forward(leaves[0], top, leaves[1], leaves[2], leaves[3], sh)
    d_out = torch.randn_like(out)
    out.backward(d_out)
    _, grads = moe_forward_backward(x, top, rw, wgu, wd, d_out, sh)
    torch.testing.assert_close(leaves[0].grad, grads["x"])
    torch.testing.assert_close(leaves[2].grad, grads["w_gate_up"])
    torch.testing.assert_close(leaves[1].grad.double(), grads["router_weights"], rtol=1e-5, atol=1e-6)


def test_expert_slice_shares_sum_to_the_whole_layer():
    x, top, rw, wgu, wd, _ = _inputs(e=6, seed=3)
    whole = moe_forward(x, top, rw, wgu, wd)
    parts = sum(moe_forward(x, top, rw, wgu[s:s + 2], wd[s:s + 2], first_expert=s, num_experts=6) for s in (0, 2, 4))
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)


def test_empty_and_unrouted_tokens():
    x, top, rw, wgu, wd, _ = _inputs()
    assert moe_forward(x[:0], top[:0], rw[:0], wgu, wd).shape == (0, 64)
    out = moe_forward(x, torch.full_like(top, -1), rw, wgu, wd)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(x=a["x"][:, :48]), "multiple of 64"),
        (lambda a: a.update(x=a["x"][0]), "2-D"),
        (lambda a: a.update(top_experts=a["top_experts"].float()), "int32 or int64"),
        (lambda a: a.update(top_experts=a["top_experts"][:-1]), "rows but x has"),
        (lambda a: a.update(router_weights=a["router_weights"].double()), "float32"),
        (lambda a: a.update(router_weights=a["router_weights"][:, :1]), "router_weights must have shape"),
        (lambda a: a.update(top_experts=a["top_experts"].clone().fill_(5)), "allowed: -1"),
        (lambda a: a.update(top_experts=a["top_experts"].clone().fill_(-2)), "allowed: -1"),
        (lambda a: a.update(w_down=a["w_down"][:, :, :-1]), "w_down must have shape"),
        (lambda a: a.update(w_gate_up=a["w_gate_up"][:, :-1]), "w_gate_up must be"),
        (lambda a: a.update(shared=[(a["w_down"][0], a["w_down"][0])]), "shared[0]"),
    ],
)
def test_bad_input_raises_value_error_naming_the_problem(mutate, message):
    x, top, rw, wgu, wd, sh = _inputs()
    args = dict(x=x, top_experts=top, router_weights=rw, w_gate_up=wgu, w_down=wd, shared=sh)
    mutate(args)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        moe_forward(**args)


@pytest.mark.parametrize("activation", EVERY_KIND, ids=lambda a: a.kind)
def test_every_activation_is_its_published_formula_and_its_backward_is_autograds(activation):
    """``activate`` against each kind's published form (torchtitan's SwiGLU, HF gpt-oss's, ``F.gelu``), and
    ``activation_backward`` (the dact epilogue's twin) against autograd through ``activate``, in FP64."""
    import torch.nn.functional as F

    from megamoe.reference import activate, activation_backward

    g = torch.Generator().manual_seed(5)
    h = torch.randn(64, 96, generator=g, dtype=torch.float64) * 2
    gate, up = h.chunk(2, dim=-1)
    limit = activation.limit
    if activation.kind == "gpt-oss":
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        want = (up + 1) * (gate * torch.sigmoid(gate * activation.alpha))
    elif activation.kind == "geglu":
        want = F.gelu(gate) * up
    else:
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        want = F.silu(gate) * up
    torch.testing.assert_close(activate(h, activation), want, rtol=1e-12, atol=1e-12)
    assert (h.chunk(2, dim=-1)[0] > (limit or float("inf"))).any() or limit is None  # the clamp bites
    dy, w = torch.randn(64, 48, generator=g, dtype=torch.float64), torch.rand(64, generator=g, dtype=torch.float64)
    leaf = h.clone().requires_grad_()
    act = activate(leaf, activation)
    (act * dy * w[:, None]).sum().backward()
    d_h, act_twin, d_router = activation_backward(dy, h, w, activation)
    torch.testing.assert_close(d_h, leaf.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(act_twin, act.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(d_router, (dy * act.detach()).sum(1), rtol=1e-12, atol=1e-12)
