"""megamoe.MoEInputs: the layer's inputs as one bundle, its one validation refusing bad inputs by name, and the
layer functions taking it in place of x (CPU, no world: the reference and a stand-in world's size and device)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megamoe import MoEInputs
from megamoe.config import SWIGLU
from megamoe.inputs import LayerDims, gather_inputs
from megamoe.reference import moe_forward, moe_forward_backward

from kinds import clamped  # tests/kinds.py

N, D, I, E, K = 4, 128, 64, 4, 2


def _inputs(dtype=torch.bfloat16, **kw) -> MoEInputs:
    g = torch.Generator().manual_seed(0)
    fields = dict(
        x=torch.randn(N, D, generator=g).to(dtype),
        top_experts=torch.tensor([[0, 1], [2, 3], [1, -1], [3, 0]], dtype=torch.int32),
        router_weights=torch.rand(N, K, generator=g),
        w_gate_up=(torch.randn(E, 2 * I, D, generator=g) * D ** -0.5).to(dtype),
        w_down=(torch.randn(E, D, I, generator=g) * I ** -0.5).to(dtype),
        shared=[((torch.randn(64, D, generator=g) * D ** -0.5).to(dtype),
                 (torch.randn(D, 32, generator=g) * 32 ** -0.5).to(dtype))],
        b_gate_up=torch.randn(E, 2 * I, generator=g).to(dtype), b_down=torch.randn(E, D, generator=g).to(dtype))
    return MoEInputs(**{**fields, **kw})


WORLD = SimpleNamespace(size=1, device=torch.device("cpu"))


def test_good_inputs_give_their_dims_under_every_rule():
    for dtypes, world in (("float", None), ("same", WORLD), ("bf16", WORLD)):
        assert _inputs().validate(dtypes=dtypes, world=world) == LayerDims(N, D, K, E, I)
    assert _inputs(torch.float32).validate(dtypes="same", world=WORLD).experts == E
    assert isinstance(_inputs().shared, tuple)  # frozen all the way down to the sequence


def test_the_bundle_is_frozen():
    with pytest.raises(AttributeError):
        _inputs().x = None


@pytest.mark.parametrize("change, rule, message", [
    (dict(x=torch.zeros(N, D)), "bf16", "x must be bfloat16 (the expert kernels are BF16-only), got torch.float32"),
    (dict(x=torch.zeros(D, dtype=torch.bfloat16)), "float", "x must be 2-D [N, D]"),
    (dict(top_experts=torch.zeros(N, K)), "float", "top_experts must be int32 or int64"),
    (dict(router_weights=torch.zeros(N, K, dtype=torch.float64)), "float", "router_weights must be float32"),
    (dict(w_down=torch.zeros(E, D, 32, dtype=torch.bfloat16)), "float", "w_down must have shape (4, 128, 64)"),
    (dict(shared=[torch.zeros(64, D)]), "float", "shared[0] must be a pair"),
    (dict(shared=[(torch.zeros(64, D), torch.zeros(D, 32))]), "bf16", "shared[0] w_gate_up must be bfloat16"),
    (dict(shared=[(torch.zeros(64, D), torch.zeros(D, 32))]), "same", "shared[0] w_gate_up is torch.float32, x "
                                                                        "torch.bfloat16: the baselines compute"),
    (dict(activation=7.0), "float", "activation must be a megamoe.Activation, got 7.0; a SwiGLU clamp is"),
    (dict(w_gate_up=torch.zeros(E, 2 * I, D, dtype=torch.bfloat16, device="meta")), "float",
     "w_gate_up is on meta, x on cpu"),
    (dict(b_gate_up=torch.zeros(E, 3, dtype=torch.bfloat16)), "float", "b_gate_up must have shape (4, 128)"),
    (dict(b_down=torch.zeros(E, D)), "bf16", "b_down must be bfloat16, got torch.float32"),
    (dict(b_down=torch.zeros(E, D)), "same", "b_down is torch.float32, x torch.bfloat16"),
    (dict(b_gate_up=torch.zeros(2 * I, E, dtype=torch.bfloat16).t()), "bf16", "b_gate_up must be contiguous"),
    (dict(top_experts=torch.tensor([[0, 1], [2, 9], [1, -1], [3, 0]])), "float",
     "top_experts holds ids in [-1, 9]; allowed: -1 (no route) or 0..3"),
])
def test_validate_names_each_bad_input(change, rule, message):
    with pytest.raises(ValueError) as info:
        _inputs(**change).validate(dtypes=rule, world=None if rule == "float" else WORLD)
    assert str(info.value).startswith(message), str(info.value)
    assert rule != "float" or _inputs().validate(dtypes=rule)  # the same inputs unchanged pass


def test_validate_over_a_world():
    two = SimpleNamespace(size=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="holds 4 experts on each of the 2 ranks, 8 in all, not num_experts=4"):
        _inputs().validate(world=two, num_experts=4)
    with pytest.raises(ValueError, match="at least one local expert"):
        _inputs(w_gate_up=torch.zeros(0, 2 * I, D), w_down=torch.zeros(0, D, I), b_gate_up=None,
                b_down=None).validate(world=WORLD, check_ids=False)
    with pytest.raises(ValueError, match="I must be a multiple of 8, got 4"):
        _inputs(w_gate_up=torch.zeros(E, 8, D), w_down=torch.zeros(E, D, 4), b_gate_up=None,
                b_down=None).validate(world=WORLD)
    with pytest.raises(ValueError, match="x is on cpu, the world on meta"):
        _inputs().validate(world=SimpleNamespace(size=1, device=torch.device("meta")))
    with pytest.raises(ValueError, match="num_experts must be a positive int, got 0"):
        _inputs().validate(num_experts=0)
    with pytest.raises(ValueError, match="dtypes must be 'float', 'same' or 'bf16'"):
        _inputs().validate(dtypes="fp8")
    bad = _inputs(router_weights=torch.rand(N, K).index_fill(0, torch.tensor([2]), float("inf")))
    bad.validate()  # finite is asked for, not assumed
    with pytest.raises(ValueError, match="token 2 has a NaN or Inf in router_weights"):
        bad.validate(finite=True)


def test_the_layer_functions_take_the_bundle_in_place_of_x():
    inputs = _inputs(torch.float32, activation=clamped(7.0))
    one_by_one = moe_forward(inputs.x, inputs.top_experts, inputs.router_weights, inputs.w_gate_up, inputs.w_down,
                             inputs.shared, inputs.activation, b_gate_up=inputs.b_gate_up, b_down=inputs.b_down)
    assert torch.equal(moe_forward(inputs), one_by_one)
    d_out = torch.ones(N, D)
    out, grads = moe_forward_backward(inputs, d_out=d_out)
    assert torch.equal(out, one_by_one) and set(grads) >= {"x", "b_gate_up", "b_down"}
    with pytest.raises(ValueError, match="either as one MoEInputs or one by one: x is a MoEInputs and w_down, "
                                         "activation given too"):
        moe_forward(inputs, w_down=inputs.w_down, activation=clamped(1.0))
    assert gather_inputs(inputs, None, None, None, None, (), SWIGLU) is inputs
