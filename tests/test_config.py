"""MoEConfig, presets and bench options reject bad values with the field's name."""

import pytest

from megamoe.bench.harness import BenchOptions
from megamoe.config import PRESETS, MoEConfig, preset


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
        (dict(swiglu_limit=-1.0), "swiglu_limit must be a positive finite number"),
        (dict(swiglu_limit=float("inf")), "swiglu_limit"),
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
