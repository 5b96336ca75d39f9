"""megamoe.adapters.hf on gpt-oss (tests/test_hf.py's checks, for the family whose experts need mapping): a tiny
``GptOssForCausalLM`` built from its config, patched on 2 CPU ranks, gives the unpatched FP32 model's logits and
every gradient (the experts' interleaved, transposed weights and both biases included) within BF16 tolerance, and
its state_dict round trips in gpt-oss's own layout."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist

from megamoe.parallel.world import launch

transformers = pytest.importorskip("transformers")

# tests/test_hf.py's bounds (the experts run in BF16 against the model's FP32 ones), batches and steps
from test_hf import GRAD_TOLERANCE, LOGITS_TOLERANCE, VOCAB, _batch, _rel, _step  # noqa: E402
#: The routed experts' parameters: their gradients cover every rank's tokens (summed over the ranks).
ROUTED = ("experts.gate_up_proj", "experts.down_proj", "experts.gate_up_proj_bias", "experts.down_proj_bias")


def _build(seed: int):
    """Two layers (sliding and full attention), 8 experts top-2, at gpt-oss's own limit and alpha; the expert and
    router biases random (their init may be zeros: a bias that is not added would go unseen)."""
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=64, attn_implementation="eager")).float().train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("_proj_bias", "router.bias")):
                p.copy_(torch.randn(p.shape) * 0.5)
    return model


def _to_model_layout(pname: str, grad: torch.Tensor) -> torch.Tensor:
    """A patched expert parameter's gradient in gpt-oss's layout (this rank's slice)."""
    from megamoe.adapters.hf_gpt_oss import interleave_columns

    if pname.endswith("gate_up_proj"):
        return interleave_columns(grad.transpose(1, 2))
    if pname.endswith("down_proj"):
        return grad.transpose(1, 2)
    return interleave_columns(grad) if pname.endswith("gate_up_proj_bias") else grad


def _parity(world):
    from megamoe.adapters.hf import patch
    from megamoe.adapters.hf_gpt_oss import GptOssExpertParallelExperts

    model = _build(seed=3)
    patched = patch(copy.deepcopy(model), world)
    ids = _batch(world, seed=5)
    (want_logits, _), (got_logits, _) = _step(model, ids), _step(patched, ids)
    errors, params = {}, dict(patched.named_parameters())
    for pname, p in model.named_parameters():
        want = p.grad
        if pname.endswith(ROUTED):
            dist.all_reduce(want, group=world.group)
            L = want.shape[0] // world.size
            want = want[world.rank * L:(world.rank + 1) * L]
        got = params[pname].grad
        if got is not None and pname.endswith(ROUTED):
            got = _to_model_layout(pname, got)
        errors[pname] = float("inf") if got is None or got.shape != want.shape else _rel(got, want)
    patched_experts = [m for m in patched.modules() if isinstance(m, GptOssExpertParallelExperts)]
    activations = {m.activation for m in patched_experts}
    return _rel(got_logits, want_logits), errors, len(patched_experts), activations


def _round_trip(world):
    from megamoe.adapters.hf import patch

    ids = _batch(world, seed=9)
    model = _build(seed=4).eval()
    patched = patch(copy.deepcopy(model), world).eval()
    with torch.no_grad():
        want, first = model(input_ids=ids).logits, patched(input_ids=ids).logits
    state = patched.state_dict()  # collective: the experts gathered, in gpt-oss's layout
    other = _build(seed=11).eval()
    other.load_state_dict(state, strict=True)  # patched -> unpatched
    again = patch(_build(seed=12), world).eval()
    again.load_state_dict(model.state_dict(), strict=True)  # unpatched -> patched
    with torch.no_grad():
        back, second = other(input_ids=ids).logits, again(input_ids=ids).logits
    reference = model.state_dict()
    same_tensors = set(state) == set(reference) and all(torch.equal(state[k], v) for k, v in reference.items())
    return torch.equal(back, want), torch.equal(second, first), same_tensors, _rel(first, want)


def _both(world):
    return _parity(world), _round_trip(world)


@functools.cache
def _runs() -> list:
    return launch(_both, 2)


def test_patched_gpt_oss_gives_hf_outputs_and_gradients():
    """On 2 CPU ranks: the logits and every parameter's gradient (the routed experts' and their biases' summed
    over the ranks' tokens, in gpt-oss's layout) within BF16 tolerance of the unpatched FP32 model's; both layers'
    experts patched, with gpt-oss's activation."""
    from megamoe.config import Activation

    for rank, (parity, _) in enumerate(_runs()):
        logits, errors, patched, activations = parity
        assert logits < LOGITS_TOLERANCE, (rank, logits)
        bad = {p: e for p, e in errors.items() if not e < GRAD_TOLERANCE}
        assert not bad, (rank, bad)
        assert any(p.endswith("gate_up_proj_bias") for p in errors) and any(p.endswith("down_proj_bias")
                                                                           for p in errors), errors
        assert patched == 2 and activations == {Activation("gpt-oss", limit=7.0, alpha=1.702)}, activations


def test_gpt_oss_state_dict_round_trips_in_its_own_layout():
    """patched -> unpatched and unpatched -> patched give the same outputs bit for bit, and the patched model's
    state_dict is the unpatched one's tensors exactly (the columns interleaved and transposed back)."""
    for rank, (_, (back, second, same_tensors, rel)) in enumerate(_runs()):
        assert same_tensors, f"rank {rank}: the patched state_dict is not the model's own"
        assert back and second, (rank, back, second)
        assert rel < LOGITS_TOLERANCE, (rank, rel)
