"""megamoe.adapters.hf: tiny transformers models (built from their configs, nothing downloaded) patched onto megamoe
on CPU ranks give the unpatched model's outputs and gradients within BF16 tolerance, and their state_dicts load
into unpatched models and back."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist

from megamoe.bench.accuracy import error_stats
from megamoe.parallel.world import launch
from raised import raised  # tests/raised.py

transformers = pytest.importorskip("transformers")

#: The experts run in BF16 against the model's FP32 ones: relative L1 of the logits, of every gradient.
LOGITS_TOLERANCE = 1e-2
GRAD_TOLERANCE = 3e-2
VOCAB, SEQ, BATCH = 96, 12, 2


def _qwen3():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64, attn_implementation="eager"))


def _deepseek_v3():
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=0,
        q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=64, attn_implementation="eager"))
    for block in model.modules():  # a selection bias that matters (it is zeros at init)
        if type(block).__name__ == "DeepseekV3TopkRouter":
            block.e_score_correction_bias.copy_(torch.randn(block.e_score_correction_bias.shape) * 0.1)
    return model


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        attn_implementation="eager"))


def _qwen2():
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=64,
        attn_implementation="eager"))


def _olmoe():
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, pad_token_id=0,
        eos_token_id=1, max_position_embeddings=64, attn_implementation="eager"))


def _glm4_moe():
    # layer 0 dense (first_k_dense_replace), layer 1 sparse: sigmoid, grouped top-k, bias, scale, a shared expert
    model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        use_qk_norm=True, max_position_embeddings=64, attn_implementation="eager"))
    for block in model.modules():  # a selection bias that matters (it is zeros at init)
        if type(block).__name__ == "Glm4MoeTopkRouter":
            block.e_score_correction_bias.copy_(torch.randn(block.e_score_correction_bias.shape) * 0.1)
    return model


def _llama4(top_k: int):
    return transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=4, num_experts_per_tok=top_k,
        max_position_embeddings=64, attention_chunk_size=8, attn_implementation="eager"))


MODELS = {"qwen3-moe": _qwen3, "deepseek-v3": _deepseek_v3, "mixtral": _mixtral, "qwen2-moe": _qwen2,
          "olmoe": _olmoe, "glm4-moe": _glm4_moe, "llama4": functools.partial(_llama4, 1),
          "llama4-top2": functools.partial(_llama4, 2)}


def _build(name: str, seed: int):
    torch.manual_seed(seed)
    return MODELS[name]().float().train()


def _batch(world, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 31 + world.rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach()


def _rel(got, want) -> float:
    return error_stats(got, want)["rel"]


def _parity(world, name: str):
    """(logits error, {parameter: gradient error}, the patched experts' shapes) of a patched model against the
    unpatched one on this rank's tokens."""
    from megamoe.adapters.hf import ExpertParallelExperts, patch

    model = _build(name, seed=3)
    patched = patch(copy.deepcopy(model), world)
    ids = _batch(world, seed=5)
    want_logits, _ = _step(model, ids)
    got_logits, _ = _step(patched, ids)
    errors = {}
    patched_params = dict(patched.named_parameters())
    llama4 = name.startswith("llama4")
    for pname, p in model.named_parameters():
        want = p.grad
        routed = pname.endswith(("experts.gate_up_proj", "experts.down_proj"))
        if routed:
            # a routed expert's gradient covers every rank's tokens: the sum of the unpatched per-rank ones
            dist.all_reduce(want, group=world.group)
            L = want.shape[0] // world.size
            want = want[world.rank * L:(world.rank + 1) * L]
        if routed and llama4:  # held in megamoe's layout: transformers' transposed
            want = want.transpose(1, 2)
        got = patched_params[pname].grad
        errors[pname] = float("inf") if got is None or got.shape != want.shape else _rel(got, want)
    shapes = {n: tuple(m.gate_up_proj.shape) for n, m in patched.named_modules()
              if isinstance(m, ExpertParallelExperts)}
    return _rel(got_logits, want_logits), errors, shapes


def _parities(world, names):
    return {name: _parity(world, name) for name in names}


@functools.cache
def _parity_runs() -> list[dict]:
    """Every family's parity in one launch of 2 CPU ranks (a launch costs seconds)."""
    return launch(_parities, 2, tuple(MODELS))


@pytest.mark.parametrize("name", ["qwen3-moe", "deepseek-v3"])
def test_patched_model_gives_hf_outputs_and_gradients(name):
    """On 2 CPU ranks: the logits and every parameter's gradient (the routed experts' summed over the ranks'
    tokens) within BF16 tolerance of the unpatched FP32 model's; each rank holds half the experts of each of the
    two layers (the second reads the first's output: each layer's backward its own context)."""
    for rank, per_model in enumerate(_parity_runs()):
        logits, errors, shapes = per_model[name]
        assert logits < LOGITS_TOLERANCE, (rank, logits)
        bad = {p: e for p, e in errors.items() if not e < GRAD_TOLERANCE}
        assert not bad, (rank, bad)
        assert len(shapes) == 2 and all(s[0] == 4 for s in shapes.values()), shapes


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe", "olmoe", "glm4-moe", "llama4", "llama4-top2"])
def test_patched_model_gives_hf_outputs_more_families(name):
    """Mixtral (softmax, renormalised always), Qwen2-MoE (a gated shared expert), OLMoE (softmax then top-k, not
    renormalised), GLM-4.5 (a dense layer, then sigmoid scores, grouped top-k over a nonzero selection bias,
    renormalised and scaled, a shared expert) and Llama-4 (its sigmoid score scales the expert's input; a shared
    expert; top-1 as the model ships, and top-2), one MoE layer each."""
    for rank, per_model in enumerate(_parity_runs()):
        logits, errors, shapes = per_model[name]
        assert logits < LOGITS_TOLERANCE, (rank, logits)
        bad = {p: e for p, e in errors.items() if not e < GRAD_TOLERANCE}
        assert not bad, (rank, bad)
        assert len(shapes) == 1, shapes


def _round_trip(world, name: str):
    from megamoe.adapters.hf import patch

    ids = _batch(world, seed=9)
    model = _build(name, seed=4).eval()
    patched = patch(copy.deepcopy(model), world).eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        first = patched(input_ids=ids).logits
    state = patched.state_dict()  # collective: the experts gathered
    # patched -> unpatched: an unpatched model of other weights loads it and gives the original's outputs
    other = _build(name, seed=11).eval()
    other.load_state_dict(state, strict=True)
    # unpatched -> patched: a patched model of other weights loads the HF state_dict and gives the first's bits
    again = patch(_build(name, seed=12), world).eval()
    again.load_state_dict(model.state_dict(), strict=True)
    # and a patched model's own (gathered) state_dict round trips too
    third = patch(_build(name, seed=13), world).eval()
    third.load_state_dict(state, strict=True)
    with torch.no_grad():
        back = other(input_ids=ids).logits
        second = again(input_ids=ids).logits
        third_logits = third(input_ids=ids).logits
    keys_equal = set(state) == set(model.state_dict())
    shapes_equal = all(state[k].shape == v.shape for k, v in model.state_dict().items())
    return (torch.equal(back, want), torch.equal(second, first), torch.equal(third_logits, first), keys_equal,
            shapes_equal, _rel(first, want))


def _round_trips(world, names):
    return {name: _round_trip(world, name) for name in names}


#: Every family (Llama-4 once: its top-2 twin has the same experts' layout).
ROUND_TRIPS = ("qwen3-moe", "deepseek-v3", "mixtral", "qwen2-moe", "olmoe", "glm4-moe", "llama4")


@functools.cache
def _round_trip_runs() -> list[dict]:
    return launch(_round_trips, 2, ROUND_TRIPS)


@pytest.mark.parametrize("name", ROUND_TRIPS)
def test_state_dict_round_trips_between_patched_and_unpatched(name):
    """patched -> unpatched, unpatched -> patched and patched -> patched: the same outputs, bit for bit."""
    for rank, per_model in enumerate(_round_trip_runs()):
        back, second, third, keys, shapes, rel = per_model[name]
        assert keys and shapes, rank
        assert back, f"rank {rank}: the unpatched model loading a patched state_dict differs from the original"
        assert second and third, f"rank {rank}: a patched model loading a state_dict differs from the first"
        assert rel < LOGITS_TOLERANCE, (rank, rel)


def _refusals(world):
    from megamoe.adapters.hf import patch

    gelu = _build("qwen3-moe", 0)
    gelu.model.layers[0].mlp.experts.config.hidden_act = "gelu"  # experts not SwiGLU
    glm_gelu = _build("glm4-moe", 0)
    glm_gelu.model.layers[1].mlp.experts.config.hidden_act = "gelu"
    normed = _build("olmoe", 0)
    normed.model.layers[0].mlp.experts.has_post_expert_norm = True  # a norm after each expert: not megamoe's
    llama_gelu = _build("llama4", 0)
    llama_gelu.model.layers[0].feed_forward.experts.act_fn = torch.nn.GELU()  # Llama-4's experts keep no config
    twice = patch(patch(_build("llama4", 0), world), world)  # patching twice is patching once
    return raised([lambda: patch(torch.nn.Linear(4, 4), world), lambda: patch(gelu, world),
                   lambda: patch(glm_gelu, world), lambda: patch(normed, world),
                   lambda: patch(llama_gelu, world)]), type(twice.model.layers[0].feed_forward)


def test_patch_refuses_what_it_cannot_run():
    """A model without a supported block, and experts that are not SwiGLU or that norm their outputs, are named;
    a patched model patches as it is."""
    (no_block, gelu, glm_gelu, normed, llama_gelu), twice = launch(_refusals, 1)[0]
    assert no_block is not None and "no MoE block megamoe patches" in no_block, no_block
    assert "OlmoeSparseMoeBlock" in no_block and "Llama4TextMoe" in no_block, no_block
    assert gelu is not None and "hidden_act='gelu'" in gelu, gelu
    assert glm_gelu is not None and "hidden_act='gelu'" in glm_gelu, glm_gelu
    assert normed is not None and "has_post_expert_norm=True" in normed, normed
    assert llama_gelu is not None and "act_fn=GELU" in llama_gelu, llama_gelu
    assert twice.__name__ == "Llama4ExpertParallelMoe", twice
