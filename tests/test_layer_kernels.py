"""The MegaKernels a world keeps, and the no-overlap mode (`unfused`): the same steps, the same bits."""

from dataclasses import replace

import pytest
import torch

from megamoe.bench.problem import make_problem
from megamoe.config import MoEConfig
from megamoe.megakernel import default_config, megamoe_forward
from megamoe.megakernel.forward import layer_kernel
from megamoe.parallel.world import launch
from megamoe.planner import LayerShape

CONFIG = MoEConfig(hidden=128, intermediate=128, num_experts=4, top_k=2, shared=(32,))


def _kernels(world):
    shape = LayerShape.of(CONFIG, world.size, 16)
    planned = default_config(world, shape)
    bf16 = layer_kernel(world, shape, None, "bf16")
    unfused = layer_kernel(world, shape, replace(planned, overlap=False), "bf16")
    fp8 = layer_kernel(world, shape, None, "fp8-block")
    kept = [layer_kernel(world, shape, None, "bf16") is bf16, layer_kernel(world, shape, None, "fp8-block") is fp8,
            layer_kernel(world, shape, replace(planned, overlap=False), "bf16") is unfused]
    other = replace(planned, overlap=False, minibatch=planned.minibatch * 2, ring_rows=planned.ring_rows * 2)
    replaced = layer_kernel(world, shape, other, "bf16")
    return kept, len({id(bf16), id(unfused), id(fp8)}), replaced is not unfused, layer_kernel(
        world, shape, None, "bf16") is bf16


def test_precisions_and_overlap_modes_keep_their_own_kernels_and_a_new_config_replaces_its_own():
    """A bench interleaves megamoe in BF16 and FP8 and unfused: each call must find its kernel (a rebuilt one
    reallocates symmetric memory, collectively); a sweep over configs of one mode holds one kernel at a time."""
    kept, distinct, replaced, still = launch(_kernels, 1)[0]
    assert all(kept) and distinct == 3 and replaced and still


def _same_bits(world):
    p = make_problem(CONFIG, world.rank, world.size, (20, 9)[world.rank], dtype=torch.bfloat16, device=world.device,
                     seed=4)
    shape = LayerShape.of(CONFIG, world.size, 20)
    planned = default_config(world, shape)
    args = (world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared)
    with_overlap = megamoe_forward(*args, max_tokens=20, config=planned)
    without = megamoe_forward(*args, max_tokens=20, config=replace(planned, overlap=False))
    return torch.equal(with_overlap, without)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_the_forward_without_overlap_gives_the_same_bits():
    """unfused's forward runs the megakernel's steps one launch after another: the same tiles, the same bits
    (two ranks: on one GPU they share it; the steps need no co-residency)."""
    assert all(launch(_same_bits, 2, device="cuda"))


def test_bench_unfused_forward_and_backward_match_the_oracle():
    """The bench's unfused (megamoe's steps without overlap: its config string through the training op) on two CPU
    ranks, every gradient checked against the oracle."""
    from megamoe.bench.harness import BenchOptions, run_rank

    opts = BenchOptions(preset="tiny", tokens=(8,), ep=2, device="cpu", impls=("unfused",), passes=("fwd", "bwd"),
                        iters=1, warmup=0)
    records = launch(run_rank, 2, opts)[0]
    assert [(r["impl"], r["pass"]) for r in records] == [("unfused", "fwd"), ("unfused", "bwd")]
    assert all(r["correct"] for r in records), records


def test_home_sums_are_the_fp32_sum_of_the_valid_slots_bit_for_bit():
    """The backward's home sums (one weighted-sum launch, weights 1) against the plain FP32 sum in slot order:
    the same bits; slots of -1 routes (never pushed: NaN here) are not read."""
    from megamoe.megakernel.saved import home_sums

    g = torch.Generator().manual_seed(1)
    for n, k, D, with_shared in ((37, 3, 128, True), (20, 8, 96, False), (1, 2, 64, True)):
        slots = (torch.randn(n * k + 1, D, generator=g) * 10).bfloat16()
        top = torch.randint(-1, 4, (n, k), generator=g)
        slots[: n * k][top.view(-1) < 0] = float("nan")
        d_router_slots = torch.randn(n * k + 1, generator=g)
        shared_dx = torch.randn(n, D, generator=g).bfloat16() if with_shared else None
        want = torch.zeros(n, D)
        for j in range(k):
            want += torch.where(top[:, j, None] >= 0, slots[: n * k].view(n, k, D)[:, j].float(), 0.0)
        if shared_dx is not None:
            want += shared_dx.float()
        d_x, d_router = home_sums(slots, d_router_slots, top, n, k, D, shared_dx)
        assert torch.equal(d_x.view(torch.int16), want.bfloat16().view(torch.int16)), (n, k, D)
        assert torch.equal(d_router, torch.where(top >= 0, d_router_slots[: n * k].view(n, k), 0.0))
