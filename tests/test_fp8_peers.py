"""The peers' FP8 experts (row-wise E4M3, torch._scaled_grouped_mm's recipe): the quantiser, the grouped product,
and nccl-torch / deepep-torch with FP8 experts against the oracle with the FP8 tolerances, on CPU ranks."""

from functools import partial

import pytest
import torch

from megamoe.baselines import deepep_torch as dt
from megamoe.baselines.fp8_grouped import E4M3_MAX, quantize_expert_weights, rowwise_e4m3, scaled_grouped_mm
from megamoe.baselines.nccl_torch import nccl_torch_moe
from megamoe.bench.accuracy import compare
from megamoe.bench.problem import make_problem
from megamoe.config import SWIGLU, MoEConfig
from megamoe.parallel.world import launch
from megamoe.reference.ep import ep_reference_forward_backward

CONFIG = MoEConfig(hidden=128, intermediate=64, num_experts=8, top_k=3, shared=(32,))


def test_rowwise_e4m3_scales_each_row_to_its_amax():
    g = torch.Generator().manual_seed(1)
    t = torch.randn(6, 5, 96, generator=g) * torch.logspace(-3, 3, 6)[:, None, None]
    t[0, 0] = 0
    q, scale = rowwise_e4m3(t)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 5)
    back = q.float() * scale[..., None]
    assert torch.equal(back[0, 0], torch.zeros(96))
    assert torch.allclose(q.float().abs().amax(-1)[1:], torch.full((5, 5), E4M3_MAX))  # the amax maps to 448
    assert float(((back - t).abs() / t.abs().amax(-1, keepdim=True).clamp_min(1e-30)).max()) <= 2 ** -4


def test_scaled_grouped_mm_is_the_quantised_product_of_each_group():
    g = torch.Generator().manual_seed(2)
    a, w = torch.randn(50, 64, generator=g).bfloat16(), torch.randn(3, 32, 64, generator=g).bfloat16()
    ends = torch.tensor([16, 16, 48], dtype=torch.int32)  # an empty group; rows past the last group are zero
    w_q, w_s = rowwise_e4m3(w)
    got = scaled_grouped_mm(a, w_q, w_s, ends)
    a_q, a_s = rowwise_e4m3(a)
    for start, end, e in ((0, 16, 0), (16, 48, 2)):
        want = (a_q[start:end].float() * a_s[start:end, None]) @ (w_q[e].float() * w_s[e][:, None]).T
        assert torch.equal(got[start:end], want.bfloat16())
        exact = a[start:end].float() @ w[e].float().T
        assert float((got[start:end].float() - exact).abs().sum() / exact.abs().sum()) < 6e-2
    assert not got[48:].any()


def _fp8_layers(world):
    p = make_problem(CONFIG, world.rank, world.size, (40, 17)[world.rank], dtype=torch.bfloat16, seed=9, drop=0.1)
    want = ep_reference_forward_backward(world, p, with_grads=False)[0]
    experts = quantize_expert_weights(p.w_gate_up, p.w_down)
    results = {}
    for impl, fn in (("nccl-torch", nccl_torch_moe),
                     ("deepep-torch", partial(dt.deepep_torch_moe, backend=dt.TorchTwin(world)))):
        args = (world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared, SWIGLU)
        out, bf16 = fn(*args, experts_fp8=experts), fn(*args)
        results[impl] = compare({"out": out}, {"out": want}, "fp8"), compare({"out": bf16.detach()}, {"out": want},
                                                                              "bf16")
    return results


def test_fp8_peers_match_the_oracle_within_fp8_tolerance():
    for rank, results in enumerate(launch(_fp8_layers, 2)):
        for impl, (fp8, bf16) in results.items():
            assert fp8["correct"] and bf16["correct"], (rank, impl, fp8, bf16)
            assert fp8["rel_err"] > 2 * bf16["rel_err"], (rank, impl, fp8, bf16)  # the FP8 path really ran


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_scaled_grouped_mm_matches_the_cpu_product():
    g = torch.Generator().manual_seed(4)
    a, w = torch.randn(300, 256, generator=g).bfloat16(), torch.randn(4, 128, 256, generator=g).bfloat16()
    ends = torch.tensor([64, 64, 192, 288], dtype=torch.int32)
    w_q, w_s = rowwise_e4m3(w)
    cpu = scaled_grouped_mm(a, w_q, w_s, ends)
    gpu = scaled_grouped_mm(a.cuda(), w_q.cuda(), w_s.cuda(), ends.cuda()).cpu()
    diff = gpu[:288].float() - cpu[:288].float()
    # FP8 products summed in another order (and the tensor cores' accumulator): the same product to ~1e-3 overall;
    # one element may sit a few bf16 ulps off, so the worst element gets a looser bound than the whole
    l2 = float(diff.norm() / cpu[:288].float().norm())
    worst = float(diff.abs().max() / cpu[:288].float().abs().max())
    assert l2 < 5e-3 and worst < 3e-2, (l2, worst)


def test_bench_runs_the_peers_fp8_experts_beside_megamoes_and_skips_deepep_with_its_reason(capfd):
    from megamoe.bench.harness import BenchOptions, run_rank

    opts = BenchOptions(preset="tiny", tokens=(8,), ep=2, device="cpu", impls=("nccl-torch", "deepep-torch"),
                        experts=("bf16", "fp8-block"), passes=("fwd",), iters=1, warmup=0)
    records = launch(run_rank, 2, opts)[0]
    by_impl = {r["impl"]: r for r in records}
    assert by_impl["nccl-torch (fp8-rowwise experts)"]["correct"] and by_impl["nccl-torch"]["correct"]
    assert by_impl["nccl-torch (fp8-rowwise experts)"]["weights_quantize_ms"] is not None
    if dt.unavailable() is not None:
        assert not any(name.startswith("deepep-torch") for name in by_impl)
        assert "deepep-torch skipped: deep_ep is not importable" in capfd.readouterr().err


def test_expert_weights_quantise_one_expert_at_a_time_with_the_whole_tensors_bits():
    """quantize_expert_weights goes expert by expert (bounded FP32 temporaries) and gives rowwise_e4m3's bits
    of the whole tensor."""
    g = torch.Generator().manual_seed(5)
    wgu = torch.randn(3, 64, 32, generator=g).bfloat16()
    wd = torch.randn(3, 32, 16, generator=g).bfloat16() * torch.tensor([0.0, 1.0, 300.0]).view(3, 1, 1).bfloat16()
    q = quantize_expert_weights(wgu, wd)
    for (got_q, got_s), w in (((q.w_gate_up, q.w_gate_up_scale), wgu), ((q.w_down, q.w_down_scale), wd)):
        want_q, want_s = rowwise_e4m3(w)
        assert got_q.dtype == torch.float8_e4m3fn and got_s.shape == w.shape[:-1]
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(got_s, want_s)
