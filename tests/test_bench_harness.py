"""megamoe.bench.harness without launching ranks: the percentiles of the timings and the options' checks."""

import random

import numpy as np
import pytest
import torch

from megamoe.bench.accuracy import FP8_WEIGHT_GRAD_GROUP_TOL, ROW_GROUP, compare, error_stats, parked_on_host
from megamoe.bench.harness import BenchOptions, percentile


@pytest.mark.parametrize("values, q, want", [
    ([3.0], 0.5, 3.0),
    ([3.0], 0.1, 3.0),
    ([1.0, 2.0], 0.5, 1.5),  # the mean of the two middle samples (was: the lower one)
    ([2.0, 1.0], 0.1, 1.1),
    ([2.0, 1.0], 0.9, 1.9),
    ([4.0, 1.0, 3.0, 2.0], 0.5, 2.5),
    ([4.0, 1.0, 3.0, 2.0], 0.1, 1.3),
    ([4.0, 1.0, 3.0, 2.0], 0.9, 3.7),
    ([5.0, 1.0, 3.0], 0.5, 3.0),
    ([5.0, 1.0, 3.0], 0.1, 1.4),
    ([5.0, 1.0, 3.0], 0.9, 4.6),
    ([10.0, 20.0, 30.0, 40.0, 50.0], 0.0, 10.0),
    ([10.0, 20.0, 30.0, 40.0, 50.0], 1.0, 50.0),
])
def test_percentile_of_known_lists(values, q, want):
    assert percentile(values, q) == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_percentile_is_numpys_linear_default():
    rng = random.Random(0)
    for n in range(1, 12):
        values = [rng.uniform(0, 100) for _ in range(n)]
        for q in (0.0, 0.1, 0.25, 0.5, 0.9, 1.0):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, 100 * q)), rel=1e-12)


def test_percentile_refuses_no_values_and_q_out_of_range():
    with pytest.raises(ValueError, match="no values"):
        percentile([], 0.5)
    with pytest.raises(ValueError, match="q must be in"):
        percentile([1.0], 1.5)


@pytest.mark.parametrize("kwargs, match", [
    ({"ep": 0}, "ep must be a positive int"),
    ({"routing": "foo"}, "routing must be one of uniform, zipf, one-rank"),
    ({"routing": "zipf-0"}, "zipf-A .A > 0"),
    ({"routing": "zipf-nan"}, "zipf-A .A > 0"),
    ({"routing": "zipf-"}, "zipf-A .A > 0"),
    ({"routing": "zipf--1"}, "zipf-A .A > 0"),
    ({"routing": "one-rank", "ep": 8}, "k <= experts per rank"),
    ({"device": "tpu"}, "device must be one of cpu, cuda"),
    ({"tokens": (-5,)}, r"tokens must be >= 0"),
    ({"tokens": (1, 2, 3)}, r"tokens must be one count or one per rank \(ep=2\)"),
])
def test_bench_options_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BenchOptions(**{"preset": "tiny", "tokens": (8,), "ep": 2, "device": "cpu", **kwargs})


def test_zipf_routing_takes_an_exponent_and_zipf_is_its_default():
    """``zipf-A``: expert popularity ~ rank^-A; ``zipf`` is ``zipf-1.2`` (the same draw), a smaller exponent a less
    skewed load (the heaviest expert's rows over the mean: qwen3-30b-a3b's 128 experts at 4096 tokens), and the
    options take it."""
    from megamoe.bench.problem import _route
    from megamoe.config import preset

    cfg = preset("qwen3-30b-a3b")

    def heaviest_over_mean(routing):
        g = torch.Generator().manual_seed(0)
        counts = torch.bincount(_route(cfg, 4096, 0, 1, routing, 0.0, g, "cpu").flatten().long(),
                                minlength=cfg.num_experts).float()
        return float(counts.max() / counts.mean())

    g0, g1 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(_route(cfg, 512, 0, 1, "zipf", 0.0, g0, "cpu"),
                       _route(cfg, 512, 0, 1, "zipf-1.2", 0.0, g1, "cpu"))
    skews = [heaviest_over_mean(r) for r in ("uniform", "zipf-0.2", "zipf-0.5", "zipf")]
    assert skews == sorted(skews) and skews[0] < 1.5 < skews[1] and skews[3] > 10, skews
    BenchOptions(preset="tiny", tokens=(8,), ep=2, device="cpu", routing="zipf-0.35")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs no visible GPU")
def test_bench_options_on_cuda_without_a_gpu():
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        BenchOptions(preset="tiny", tokens=(8,), ep=1, device="cuda")


def _weight_grads(rows=1024, cols=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(rows, cols, generator=g)
    return ref, ref + 0.06 * torch.randn(rows, cols, generator=g)  # FP8's typical row error


def test_fp8_weight_gradients_are_judged_by_groups_of_rows():
    """One amplified row (an outlier token's quantisation error) passes in a routed weight gradient and fails a
    per-token gradient; a group of rows off together (a missing wgrad block) fails."""
    ref, got = _weight_grads()
    assert error_stats(got, ref)["row_group"] < 0.1
    lone = got.clone()
    typical = ref.norm(dim=1).pow(2).mean().sqrt()
    lone[70] = ref[70] + 0.6 * torch.maximum(ref[70].norm(), typical) * torch.ones(ref.shape[1]) / ref.shape[1] ** 0.5
    st = error_stats(lone, ref)
    assert st["row"] > 0.5 > FP8_WEIGHT_GRAD_GROUP_TOL > st["row_group"]
    assert compare({"w_gate_up": lone}, {"w_gate_up": ref}, "fp8-grads")["correct"]
    assert not compare({"x": lone}, {"x": ref}, "fp8-grads")["correct"]  # per-token rows keep the row bound
    assert not compare({"w_gate_up": lone}, {"w_gate_up": ref}, "bf16")["correct"]
    block = got.clone()
    block[ROW_GROUP: 2 * ROW_GROUP] *= 0.6  # a tile of rows missing 40 % of their tokens
    st = error_stats(block, ref)
    assert st["row_group"] > FP8_WEIGHT_GRAD_GROUP_TOL and st["rel"] < 0.1  # L1 alone would not see it
    result = compare({"w_down": block}, {"w_down": ref}, "fp8-grads")
    assert not result["correct"] and result["worst_tensor"] == "w_down"
    assert result["failed"].startswith("w_down: median row err of 64 rows ") and "> 0.25" in result["failed"]


def test_compare_names_the_check_that_failed():
    """What `megamoe bench` prints after NO: the tensor, the check and its bound (the first one failed)."""
    ref = torch.ones(4, 64)
    assert compare({"out": ref.clone()}, {"out": ref}, "bf16")["failed"] is None
    off = ref.clone()
    off[0, 0] = 1.6  # rel 2.3e-3 and the row 0.075 within bounds; max abs 0.6 > 0.5 (the output's own bound)
    assert compare({"out": off}, {"out": ref}, "bf16")["failed"] == "out: max abs 6.00e-01 > 0.5"
    assert compare({"dx": off}, {"dx": ref}, "bf16")["failed"] is None  # no max-abs bound on a gradient
    assert compare({"out": ref * 1.02}, {"out": ref}, "bf16")["failed"] == "out: rel err 2.00e-02 > 0.01"
    assert compare({"out": ref[:2]}, {"out": ref}, "bf16")["failed"] == "out: shape (2, 64), want shape (4, 64)"
    assert compare({}, {"out": ref}, "bf16")["failed"] == "out: missing, want shape (4, 64)"
    nan = ref.clone()
    nan[1, 1] = float("nan")
    assert compare({"out": nan}, {"out": ref}, "bf16")["failed"] == "out: not finite"


def test_row_groups_never_straddle_chunks():
    ref, got = _weight_grads(rows=200)
    got[128:192] = 0  # the third group of 64 rows, cut by 100-row chunks were they not rounded to groups
    assert error_stats(got, ref, chunk_rows=100)["row_group"] == error_stats(got, ref)["row_group"] > 0.9


def test_errors_in_chunks_of_bounded_bytes_are_the_one_chunk_numbers(monkeypatch):
    """By default a chunk holds :data:`CHUNK_BYTES` of FP32 rows (wide rows: fewer of them, so the check's
    temporaries stay small beside a model's gradients): the same errors as one chunk of every row (the sums in
    another order: within 1e-12)."""
    from megamoe.bench import accuracy

    ref, got = _weight_grads(rows=1000)
    whole = error_stats(got, ref, chunk_rows=1 << 20)
    monkeypatch.setattr(accuracy, "CHUNK_BYTES", 64 * 4 * ref.shape[-1] * 3)  # 192 rows a chunk
    chunked = error_stats(got, ref)
    assert chunked["finite"] and whole["finite"]
    for name in ("max_abs", "rel", "row", "row_group"):  # the row norms' typical size: a float64 sum of its own
        assert chunked[name] == pytest.approx(whole[name], rel=1e-12), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the oracle's large gradients parked on host)")
def test_errors_against_a_reference_parked_on_host_are_the_same():
    """The bench parks the oracle's weights-sized gradients in host memory and compares a chunk at a time on the
    GPU: the same numbers as with both on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(5)
    ref = torch.randn(3000, 256, generator=g, device="cuda")
    got = (ref + 1e-2 * torch.randn(3000, 256, generator=g, device="cuda")).bfloat16()
    parked = parked_on_host({"w": ref, "small": ref[:2]}, min_bytes=ref.numel() * 4)
    assert parked["w"].device.type == "cpu" and parked["small"].is_cuda
    assert error_stats(got, parked["w"], chunk_rows=1024) == error_stats(got, ref, chunk_rows=1024)
