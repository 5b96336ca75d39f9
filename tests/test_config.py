"""MoEConfig, presets and bench options reject bad values with the field's name."""

import pytest

from megamoe.bench.harness import BenchOptions
from megamoe.config import ACTIVATIONS, PRESETS, SWIGLU, Activation, MoEConfig, preset


def test_presets_match_the_benchmark_shapes():
    kimi = preset("kimi-k2")
    assert (kimi.hidden, kimi.intermediate, kimi.num_experts, kimi.top_k, kimi.shared) == (7168, 2048, 384, 8, (2048,))
    assert preset("mixtral-8x7b").shared == ()
    assert set(PRESETS) == {"kimi-k2", "glm-5", "qwen3.5-397b", "deepseek-v4-pro", "mixtral-8x7b", "deepseek-v3",
                            "qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b", "sonic-7b", "sonic-d4096",
                            "sonic-120b", "tiny"}
    for cfg in PRESETS.values():
        assert cfg.hidden % 64 == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(hidden=100), "hidden .* multiple of 64, got 100"),
        (dict(hidden=0), "hidden must be a positive int, got 0"),
        (dict(intermediate=-1), "intermediate must be a positive int"),
        (dict(num_experts=2.5), "num_experts must be a positive int"),
        (dict(top_k=9), r"top_k \(9\) cannot exceed num_experts \(8\)"),
        (dict(shared=(0,)), "shared holds a bad intermediate size 0"),
        (dict(activation=-1.0), "MoEConfig.activation must be an Activation"),
        (dict(activation=None), "MoEConfig.activation"),
    ],
)
def test_bad_config_raises_value_error_naming_the_field(kwargs, message):
    base = dict(hidden=256, intermediate=128, num_experts=8, top_k=2)
    with pytest.raises(ValueError, match=message):
        MoEConfig(**{**base, **kwargs})


def test_experts_per_rank_and_mismatched_ranks():
    cfg = preset("tiny")
    assert cfg.experts_per_rank(4) == 2
    with pytest.raises(ValueError, match=r"num_experts \(8\) is not divisible by ep \(3\)"):
        cfg.experts_per_rank(3)
    with pytest.raises(ValueError, match="ep must be a positive int"):
        cfg.experts_per_rank(0)
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        preset("nope")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(ep=3), "not divisible by ep"),
        (dict(tokens=(4, 5, 6)), "one count or one per rank"),
        (dict(impls=("fast",)), "unknown impl 'fast'"),
        (dict(passes=("sideways",)), "unknown pass"),
        (dict(precision="fp4"), "precision 'fp4'"),
        (dict(iters=0), "iters must be >= 1"),
    ],
)
def test_bad_bench_options(kwargs, message):
    base = dict(preset="tiny", tokens=(16,), ep=2, device="cpu")
    with pytest.raises(ValueError, match=message):
        BenchOptions(**{**base, **kwargs})


def test_a_shape_as_text_is_a_layer_and_round_trips():
    """`--shape`'s text (megamoe.config.parse_shape) and back (shape_spec); bad text names the keys."""
    from megamoe.config import parse_shape, shape_spec

    cfg = parse_shape("hidden=2048, intermediate=768,experts=128,top_k=8")
    assert (cfg.hidden, cfg.intermediate, cfg.num_experts, cfg.top_k, cfg.shared, cfg.activation.limit) == (
        2048, 768, 128, 8, (), None)
    full = parse_shape("hidden=2880,intermediate=2880,experts=128,top_k=4,shared=1024+512,activation=swiglu-clamped:7")
    assert full.shared == (1024, 512) and full.activation == Activation("swiglu-clamped", limit=7.0)
    assert not full.expert_bias and parse_shape("hidden=64,intermediate=8,experts=4,top_k=2,bias=1").expert_bias
    assert PRESETS["gpt-oss-120b"].expert_bias
    for c in (cfg, full, *PRESETS.values()):
        assert parse_shape(shape_spec(c)) == c and preset(shape_spec(c)) == c
    for bad, message in (("hidden=64", "needs intermediate, experts, top_k"),
                         ("hidden=64,intermediate=8,experts=4,top_k=2,depth=3", "key=value pairs"),
                         ("hidden=64,hidden=64", "each once"),
                         ("hidden=x,intermediate=8,experts=4,top_k=2", "bad shape"),
                         ("hidden=100,intermediate=8,experts=4,top_k=2", "multiple of 64"),
                         ("hidden=64,intermediate=8,experts=4,top_k=2,bias=yes", "bias is 0 or 1")):
        with pytest.raises(ValueError, match=message):
            parse_shape(bad)
    with pytest.raises(ValueError, match="unknown preset 'gpt-5'; known: kimi-k2"):
        preset("gpt-5")


@pytest.mark.parametrize("config, want", [
    ({"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
      "num_experts": 128, "num_experts_per_tok": 8}, (2048, 768, 128, 8, (), None)),
    ({"model_type": "deepseek_v3", "hidden_size": 7168, "moe_intermediate_size": 2048, "n_routed_experts": 256,
      "num_experts_per_tok": 8, "n_shared_experts": 1}, (7168, 2048, 256, 8, (2048,), None)),
    ({"model_type": "qwen2_moe", "hidden_size": 3584, "moe_intermediate_size": 2560, "num_experts": 64,
      "num_experts_per_tok": 8, "shared_expert_intermediate_size": 20480}, (3584, 2560, 64, 8, (20480,), None)),
    ({"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8,
      "num_experts_per_tok": 2}, (4096, 14336, 8, 2, (), None)),
    ({"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_local_experts": 128,
      "num_experts_per_tok": 4, "swiglu_limit": 7.0}, (2880, 2880, 128, 4, (), 7.0)),
    ({"model_type": "llama4", "text_config": {"model_type": "llama4_text", "hidden_size": 5120,
                                              "intermediate_size": 8192, "intermediate_size_mlp": 16384,
                                              "num_local_experts": 16, "num_experts_per_tok": 1}},
     (5120, 8192, 16, 1, (8192,), None)),
])
def test_a_huggingface_config_gives_its_moe_layer(config, want):
    from megamoe.config import hf_config_shape

    cfg = hf_config_shape(config)
    assert (cfg.hidden, cfg.intermediate, cfg.num_experts, cfg.top_k, cfg.shared, cfg.activation.limit) == want
    assert cfg.activation.kind == ("gpt-oss" if config["model_type"] == "gpt_oss" else "swiglu")
    assert cfg.expert_bias == (config["model_type"] == "gpt_oss")  # gpt-oss's experts carry biases


def test_a_dense_config_is_refused_by_name():
    from megamoe.config import hf_config_shape

    with pytest.raises(ValueError, match="an expert count, num_experts_per_tok"):
        hf_config_shape({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008})


def test_an_activation_names_its_kind_and_checks_its_numbers():
    """Activation: the four kinds, their defaults (gpt-oss: limit 7, alpha 1.702), the text form round trip, the
    kernels' ids (megamoe.kernels.activation's ACT values) and a clear error for each bad input."""
    from megamoe.kernels import activation as act

    assert [getattr(act, name).value for name in ("SWIGLU", "SWIGLU_CLAMPED", "GPT_OSS", "GEGLU")] == \
        [Activation(kind, limit=1.0 if kind == "swiglu-clamped" else None).kernel_id for kind in ACTIVATIONS]
    oss = Activation("gpt-oss")
    assert (oss.limit, oss.alpha, oss.spec) == (7.0, 1.702, "gpt-oss:7:1.702")
    assert SWIGLU == Activation() and (SWIGLU.kernel_limit, SWIGLU.kernel_alpha) == (0.0, 1.0)
    for a in (SWIGLU, oss, Activation("gpt-oss", limit=0.8, alpha=2), Activation("swiglu-clamped", limit=0.6),
              Activation("geglu")):
        assert Activation.parse(a.spec) == a
    for bad, message in ((dict(kind="relu"), "must be one of swiglu, swiglu-clamped, gpt-oss, geglu"),
                         (dict(kind="swiglu-clamped"), "needs a positive finite limit"),
                         (dict(kind="swiglu", limit=7.0), "takes no limit"),
                         (dict(kind="geglu", alpha=1.0), "takes no alpha"),
                         (dict(kind="gpt-oss", alpha=float("nan")), "positive finite alpha"),
                         (dict(kind="gpt-oss", limit=True), "positive finite limit")):
        with pytest.raises(ValueError, match=message):
            Activation(**bad)
    for text in ("gpt-oss:7:1.7:3", "swiglu-clamped:x"):
        with pytest.raises(ValueError, match="kind\\[:limit"):
            Activation.parse(text)
