"""The forward megakernel (impl megamoe) on CPU ranks: correct, bitwise deterministic, strict about configs.

Under the interpreter the kernel runs in phases (docs/megakernel.md); the GPU
run of the same code is benchmarks/megakernel_sweep.py and `megamoe bench`.
One launch per rank count runs a table of cases on one process group.
"""

from dataclasses import replace

import pytest
import torch

from megamoe.bench.accuracy import compare
from megamoe.bench.problem import make_problem
from megamoe.config import MoEConfig, preset
from megamoe.reference.ep import ep_reference_forward_backward
from megamoe.planner import LayerShape
from megamoe.megakernel import MegaKernel, default_config, fuse_shared, megamoe_forward
from megamoe.planner import KernelConfig
from megamoe.ops.expert_weights import quantize_experts
from megamoe.planner.tiles import FEW_ROWS_PER_EXPERT, MAX_TILE_STAGES, tile_stages
from megamoe.reference import moe_forward
from megamoe.parallel.world import launch

from kinds import GEGLU, GPT_OSS, SWIGLU  # tests/kinds.py

from raised import raised  # tests/raised.py
from sm90 import sm90_report  # tests/sm90.py

CONFIG = MoEConfig(hidden=128, intermediate=64, num_experts=8, top_k=3, shared=(32,))
EMPTY_EXPERT = 5
#: Interpreter tiles are 32 rows: a 32-row minibatch in a 64-row ring wraps for any case with > 64 rows.
WRAPPING = KernelConfig(num_sms=4, comm_sms=2, minibatch=32, ring_rows=64, tile_m=32, tile_n=32)
OTHERS = (KernelConfig(num_sms=5, comm_sms=1, minibatch=96, ring_rows=192, tile_m=32, tile_n=32),
          KernelConfig(num_sms=3, comm_sms=2, minibatch=64, ring_rows=1024, tile_m=32, tile_n=32))

# (name, tokens per rank, routing, drop, seed, activation, shared experts)
CASES = {
    1: [("uniform", (37,), "uniform", 0.0, 1, SWIGLU, (32,)),
        ("no-tokens", (0,), "uniform", 0.0, 4, SWIGLU, (32,))],
    2: [("uneven", (29, 0), "uniform", 0.15, 1, SWIGLU, (32,)),
        ("one-rank-limit", (17, 23), "one-rank", 0.1, 3, GPT_OSS, (32,)),
        ("two-shared", (40, 33), "uniform", 0.0, 5, SWIGLU, (32, 16))],
    3: [("zipf", (13, 31, 7), "zipf", 0.2, 2, GEGLU, ())],
    4: [("uneven", (13, 5, 21, 0), "uniform", 0.15, 1, SWIGLU, (32,))],
    8: [("uneven", (9, 0, 14, 3, 7, 11, 2, 6), "uniform", 0.1, 2, SWIGLU, (32,))],
}


def _problem(world, cfg, tokens, routing, drop, seed):
    p = make_problem(cfg, world.rank, world.size, tokens[world.rank], dtype=torch.bfloat16, seed=seed,
                     routing=routing, drop=drop, device=world.device)
    p.top_experts = torch.where(p.top_experts == EMPTY_EXPERT, -1, p.top_experts)  # an expert with no tokens
    p.router_weights = torch.where(p.top_experts >= 0, p.router_weights, 0.5)  # a stale slot would show
    return p


def _pulled_rows(world, x, max_tokens, schedule, rows):
    """The x rows the first ``rows`` schedule rows name, gathered from every rank (x padded to max_tokens)."""
    padded = torch.cat([x, x.new_zeros(max_tokens - x.shape[0], x.shape[1])])
    x_all = [torch.empty_like(padded) for _ in range(world.size)]
    torch.distributed.all_gather(x_all, padded, group=world.group)
    k = schedule.top_k
    return torch.stack([x_all[r][i // k] for r, i in zip(schedule.src_rank[:rows].tolist(),
                                                          schedule.src_index[:rows].tolist())])


def _suite(world, cases):
    results = []
    for name, tokens, routing, drop, seed, activation, shared in cases:
        experts = 9 if world.size == 3 else CONFIG.num_experts
        cfg = MoEConfig(**{**CONFIG.__dict__, "activation": activation, "shared": shared, "num_experts": experts})
        p = _problem(world, cfg, tokens, routing, drop, seed)
        want = ep_reference_forward_backward(world, p, with_grads=False)[0]
        args = (world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared, activation)
        out = megamoe_forward(*args)
        again = megamoe_forward(*args)
        wrapped = megamoe_forward(*args, config=WRAPPING)
        others = [megamoe_forward(*args, config=c) for c in OTHERS]
        fwd = compare({"out": out.float()}, {"out": want.float()}, "bf16")
        results.append({
            "case": name, "correct": fwd["correct"], "rel_err": fwd["rel_err"],
            "dtype_ok": out.dtype == torch.bfloat16 and out.shape == p.x.shape,
            "same_bits": [torch.equal(out, o) for o in (again, wrapped, *others)],
        })
    return results


# 8 ranks under -m slow (17 s of the 2-core suite; 4 ranks cover uneven multi-rank runs in CI)
@pytest.mark.parametrize("ranks", [pytest.param(r, marks=pytest.mark.slow) if r == 8 else r for r in sorted(CASES)])
def test_matches_reference_and_is_bitwise_stable(ranks):
    """Every case equals the EP oracle; reruns, a wrapping ring and other comm_sms / minibatch / ring sizes
    give the same bits."""
    results = launch(_suite, ranks, CASES[ranks])
    for rank, per_case in enumerate(results):
        assert len(per_case) == len(CASES[ranks])
        for r in per_case:
            assert r["correct"] and r["rel_err"] < 1e-2, (ranks, rank, r)
            assert r["dtype_ok"] and all(r["same_bits"]), (ranks, rank, r)


def _ring_wraps(world):
    """The wrapping config really wraps (more routed rows than ring rows) and leaves the first minibatches."""
    p = _problem(world, CONFIG, (40, 40), "uniform", 0.0, 7)
    fused = fuse_shared(p.shared)
    kernel = MegaKernel(world, LayerShape.of(CONFIG, world.size, 40), WRAPPING)
    out, ctx = kernel.forward(p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, fused)
    rows = int(ctx.schedule.num_rows)
    resident = ctx.resident_minibatches() * WRAPPING.minibatch
    # rows of the first minibatches still in the ring are the pulled x rows
    expect = _pulled_rows(world, p.x, 40, ctx.schedule, resident)
    return rows, resident, torch.equal(ctx.buffers.ring_x[:resident], expect)


def test_tile_ring_depth_follows_the_rows_per_expert():
    """One more stage where experts hold more rows than the few-rows plan's bound (kimi-k2 at EP 2 and up: 341
    rows), the plan's three below it (EP 1: 170 rows), and the launch takes it."""
    kimi = preset("kimi-k2")
    assert [tile_stages(LayerShape.of(kimi, ranks, 8192)) for ranks in (1, 2, 4, 8)] == [3, 4, 4, 4]
    assert tile_stages(LayerShape.of(kimi, 2, 2048)) == 3  # 85 rows per expert
    edge = LayerShape.of(kimi, 2, FEW_ROWS_PER_EXPERT * 192 // kimi.top_k)  # exactly the bound: the plan's depth
    assert tile_stages(edge) == 3 and MAX_TILE_STAGES == 4
    for tokens, depth in ((40, 3), (1024, 4)):  # CONFIG: 15 and 384 rows per expert
        assert launch(_launch_stages, 1, tokens) == [(depth, depth)]


def _launch_stages(world, tokens):
    shape = LayerShape.of(CONFIG, world.size, tokens)
    return MegaKernel(world, shape, ROOMY, one_rank_megakernel=True).launcher.consts["num_stages"], tile_stages(shape)


def test_ring_wraps_and_keeps_first_minibatches():
    for rows, resident, same in launch(_ring_wraps, 2):
        assert rows > resident and same


def _two_layers(world):
    """Two layers of one shape on one kernel, forward then forward: the first context is untouched by the second."""
    tokens = (24, 19)
    shape = LayerShape.of(CONFIG, world.size, max(tokens))
    kernel = MegaKernel(world, shape, WRAPPING)
    layers = [_problem(world, CONFIG, tokens, "uniform", 0.1, seed) for seed in (11, 12)]
    fused = [fuse_shared(p.shared) for p in layers]
    first = layers[0]
    out1, ctx1 = kernel.forward(first.x, first.top_experts, first.router_weights, first.w_gate_up, first.w_down,
                                fused[0])
    s = ctx1.schedule
    kept = [t.clone() for t in (*ctx1.buffers.tensors(), s.src_rank, s.src_index, s.num_rows,
                                ctx1.row_tiles.tile_row0, ctx1.row_tiles.minibatch_tiles) if t is not None]
    second = layers[1]
    out2, ctx2 = kernel.forward(second.x, second.top_experts, second.router_weights, second.w_gate_up,
                                second.w_down, fused[1])
    s = ctx1.schedule
    now = [t for t in (*ctx1.buffers.tensors(), s.src_rank, s.src_index, s.num_rows,
                       ctx1.row_tiles.tile_row0, ctx1.row_tiles.minibatch_tiles) if t is not None]
    rows = int(s.num_rows)
    resident = min(rows, ctx1.resident_minibatches() * WRAPPING.minibatch)
    return {
        # bytes, not values: rows no tile writes (h's padding) may hold NaN, which never equals itself
        "intact": all(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
                      for a, b in zip(kept, now)),
        "own_buffers": all(a.data_ptr() != b.data_ptr() for a, b in zip(ctx1.buffers.tensors(),
                                                                          ctx2.buffers.tensors()) if a is not None),
        # what the first context keeps is the first layer's: its ring rows are the first layer's pulled x rows
        "first_rows": torch.equal(ctx1.buffers.ring_x[:resident],
                                  _pulled_rows(world, first.x, max(tokens), s, resident)),
        "outputs_differ": not torch.equal(out1, out2[: out1.shape[0]]) if out1.numel() else True,
    }


def test_two_layers_keep_their_own_contexts():
    """A model runs every layer's forward before any backward: the first layer's context (ring rows, h, act,
    shared activations, schedule, row tiles) must survive the second layer's forward on the same kernel."""
    for result in launch(_two_layers, 2):
        assert all(result.values()), result


def _bad(world):
    p = make_problem(CONFIG, world.rank, world.size, 4, dtype=torch.bfloat16)
    args = (world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared)
    calls = [
        lambda: megamoe_forward(*args, precision="fp4"),
        lambda: megamoe_forward(*args, config=KernelConfig(4, 1, 64, 64, tile_m=64, tile_n=32)),
        lambda: megamoe_forward(world, p.x.float(), *args[2:]),
        lambda: megamoe_forward(*args, max_tokens=2),
        lambda: KernelConfig(4, 4, 32, 64, tile_m=32),
        lambda: KernelConfig(4, 1, 64, 32, tile_m=32),
    ]
    return raised(calls)


def test_bad_inputs_and_configs_raise_value_error():
    errors = launch(_bad, 1)[0]
    assert all(errors), errors
    assert "precision" in errors[0] and "tile_m" in errors[1] and "bfloat16" in errors[2]
    assert "max_tokens" in errors[3] and "comm_sms" in errors[4] and "larger than the ring" in errors[5]


def _tiny_minibatches(world):
    from megamoe.config import preset

    cfg = preset("tiny")
    p = make_problem(cfg, world.rank, world.size, 64, dtype=torch.bfloat16, seed=0)
    return [megamoe_forward(world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared,
                            config=KernelConfig(4, 1, minibatch, 1024, 32, 32)) for minibatch in (64, 128)]


def test_tiny_preset_same_bits_for_two_minibatches():
    """A row's down-projection once differed by its place in the row tile (numpy's FP32 matmul)."""
    for a, b in launch(_tiny_minibatches, 2):
        assert torch.equal(a, b)


FP8_CONFIG = MoEConfig(hidden=256, intermediate=128, num_experts=8, top_k=3, shared=(64,))
ROOMY = KernelConfig(num_sms=4, comm_sms=1, minibatch=64, ring_rows=1024, tile_m=32, tile_n=32)  # nothing wraps


def _quantized(world, precision):
    from megamoe.ops.experts_fp8 import expert_forward_fp8_block_reference
    from megamoe.ops.experts_mxfp8 import expert_forward_mxfp8_reference
    from megamoe.reference.formats import fp8_block_quantize, mxfp8_quantize
    from megamoe.ops.quant import quantize_weights

    quantize = {"mxfp8": mxfp8_quantize, "fp8-block": fp8_block_quantize}[precision]
    twin = {"mxfp8": expert_forward_mxfp8_reference, "fp8-block": expert_forward_fp8_block_reference}[precision]
    p = _problem(world, FP8_CONFIG, (41, 23), "uniform", 0.1, 9)
    want = ep_reference_forward_backward(world, p, with_grads=False)[0]
    args = (world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared)
    out = megamoe_forward(*args, precision=precision)
    wrapped = megamoe_forward(*args, precision=precision, config=WRAPPING)
    once = megamoe_forward(*args, precision=precision, experts_q=quantize_experts(p.w_gate_up, p.w_down, precision))
    bf16 = megamoe_forward(*args)
    fused = fuse_shared(p.shared)
    shape = LayerShape.of(FP8_CONFIG, world.size, 41)
    kernel = MegaKernel(world, shape, ROOMY, precision=precision)
    _, ctx = kernel.forward(p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, fused)
    rows, s, b = int(ctx.schedule.num_rows), ctx.schedule, ctx.buffers
    # 1. the ring's rows are the pulled x rows quantised, bit for bit (by their owners, copied as they are)
    data, scale = quantize(_pulled_rows(world, p.x, 41, s, rows))
    ring_exact = (torch.equal(b.ring_x[:rows].view(torch.uint8), data.view(torch.uint8))
                  and torch.equal(b.ring_scale[:rows], scale))
    # 2. the expert outputs are the twin's on those rows and the same quantised weights
    (wgu, wgu_s), (wdn, wdn_s) = (quantize_weights(w, precision) for w in (p.w_gate_up, p.w_down))
    ref = twin(b.ring_x[:rows], b.ring_scale[:rows], s.tokens_per_expert, s.offsets, wgu, wgu_s, wdn, wdn_s)
    return {
        "out": compare({"out": out.float()}, {"out": want.float()}, "bf16"),
        "bf16": compare({"out": bf16.float()}, {"out": want.float()}, "bf16"),
        "y": compare({"y": kernel.y[:rows].float()}, {"y": ref.y}, "bf16"),
        "same_bits": torch.equal(out, wrapped) and torch.equal(out, once),
        "ring_exact": ring_exact,
    }


# mxfp8's (34 s on 2 cores) under -m slow: CI's 15 minutes; fp8-block's runs the same pull with quantised rows
@pytest.mark.parametrize("precision", [pytest.param("mxfp8", marks=pytest.mark.slow), "fp8-block"])
def test_quantized_formats_quantise_in_the_pull_and_match_their_twin(precision):
    """The ring holds exactly formats' quantisation of the pulled rows (quantised by their owners); the expert
    outputs equal the format's torch twin on them; the layer output is within E4M3's error of the BF16 oracle
    (and farther than the BF16 path); a wrapping ring and weights quantised before the pass (quantize_experts)
    give the same bits."""
    for r in launch(_quantized, 2, precision):
        assert r["ring_exact"] and r["same_bits"], r
        assert r["y"]["correct"], r["y"]
        assert r["out"]["rel_err"] < 6e-2 and r["bf16"]["rel_err"] < r["out"]["rel_err"], r


def _stale_experts_q(world):
    p = _problem(world, FP8_CONFIG, (16,), "uniform", 0.0, 3)
    args = (world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared)
    q = quantize_experts(p.w_gate_up, p.w_down, "fp8-block")
    calls = [
        lambda: megamoe_forward(*args, experts_q=q),  # bf16 pass
        lambda: megamoe_forward(*args, precision="mxfp8", experts_q=q),
        lambda: megamoe_forward(world, *args[1:4], p.w_gate_up.clone(), *args[5:], precision="fp8-block",
                                experts_q=q),
        lambda: quantize_experts(p.w_gate_up.float(), p.w_down, "fp8-block"),
        lambda: quantize_experts(p.w_gate_up, p.w_down, "bf16"),
    ]
    early = raised(calls)
    p.w_down.mul_(2.0)  # an optimizer step, in place
    late = raised([lambda: megamoe_forward(*args, precision="fp8-block", experts_q=q)])
    return early + late


def test_experts_q_refuses_other_weights_precisions_and_stale_packs():
    errors = launch(_stale_experts_q, 1)[0]
    assert all(errors), errors
    assert "bf16" in errors[0] and "mxfp8" in errors[1] and "changed since" in errors[2]
    assert "bfloat16" in errors[3] and "precision" in errors[4] and "changed since" in errors[5]


def _own_routes_stay(world):
    """Per config: which of this rank's combine slots a pass wrote (NaN-filled before), by the routes'
    expert rank, and the output."""
    p = _problem(world, CONFIG, (40, 33), "uniform", 0.0, 11)
    fused = fuse_shared(p.shared)
    L = CONFIG.num_experts // world.size
    routed = p.top_experts.reshape(-1) >= 0
    own = routed & (p.top_experts.reshape(-1) // L == world.rank)
    results = {}
    roomy = replace(WRAPPING, ring_rows=1024)
    for name, config in (("roomy", roomy), ("wraps", WRAPPING)):
        kernel = MegaKernel(world, LayerShape.of(CONFIG, world.size, 40), config)
        kernel.sym.local("combine").fill_(float("nan"))
        world.barrier()
        out, ctx = kernel.forward(p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, fused)
        written = ~kernel.sym.local("combine")[: own.numel()].isnan().any(dim=1)
        results[name] = {"wraps": int(ctx.schedule.num_rows) > config.ring_rows,
                         "own written": int((written & own).sum()), "own": int(own.sum()),
                         "others written": bool(written[routed & ~own].all()), "out": out}
    out = results["roomy"].pop("out")
    results["same_bits"] = torch.equal(out, results["wraps"].pop("out"))
    return results


def test_own_routes_stay_in_the_ring_unless_it_wraps():
    """With a ring that holds every row, a rank's own routes are not pushed into its combine slots (the weighted
    sum reads them in the ring); a wrapping ring pushes every route; the same bits both ways."""
    for r in launch(_own_routes_stay, 2):
        roomy, wraps = r["roomy"], r["wraps"]
        assert not roomy["wraps"] and wraps["wraps"], r
        assert roomy["own"] > 0 and roomy["own written"] == 0 and roomy["others written"], r
        assert wraps["own written"] == wraps["own"] and wraps["others written"], r
        assert r["same_bits"], r


def _tile_cuts(world):
    p = _problem(world, CONFIG, (40,), "uniform", 0.0, 3)
    fused = fuse_shared(p.shared)
    results = {}
    for name, config in (("wraps", WRAPPING), ("roomy", replace(WRAPPING, ring_rows=1024))):
        kernel = MegaKernel(world, LayerShape.of(CONFIG, 1, 40), config, one_rank_megakernel=True)
        out, ctx = kernel.forward(p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, fused)
        t, mb = ctx.row_tiles, config.minibatch
        n, bounds = int(t.num_tiles), t.minibatch_tiles.tolist()
        row0, row_end = t.tile_row0[:n].tolist(), t.tile_row_end[:n].tolist()
        results[name] = {
            "straddles": any(r0 // mb != (r1 - 1) // mb for r0, r1 in zip(row0, row_end)),
            "by_first_row": all(j * mb <= row0[i] < (j + 1) * mb
                                for j in range(len(bounds) - 1) for i in range(bounds[j], bounds[j + 1])),
            "out": out,
        }
    results["same_bits"] = torch.equal(results["wraps"].pop("out"), results["roomy"].pop("out"))
    return results


def test_tiles_are_cut_at_minibatches_only_when_the_ring_wraps():
    """A wrapping ring cuts the row tiles at minibatch boundaries; a ring that holds every row does not (a
    minibatch's tiles are those starting in it, the last may reach into the next); the same bits either way."""
    r = launch(_tile_cuts, 1)[0]
    assert not r["wraps"]["straddles"] and r["roomy"]["straddles"], r
    assert r["wraps"]["by_first_row"] and r["roomy"]["by_first_row"] and r["same_bits"], r


def _one_rank(world, precision):
    from megamoe.ops import experts_mxfp8

    experts_mxfp8.AS_BF16 = False  # the MXFP8 tiles on both paths (as BF16 kernels: tests/test_experts_mxfp8_bf16.py)
    p = _problem(world, FP8_CONFIG, (41,), "uniform", 0.1, 7)
    want = ep_reference_forward_backward(world, p, with_grads=False)[0]
    shape, fused = LayerShape.of(FP8_CONFIG, 1, 41), fuse_shared(p.shared)
    runs = {}
    for megakernel in (False, True):
        kernel = MegaKernel(world, shape, ROOMY, precision=precision, one_rank_megakernel=megakernel)
        out, ctx = kernel.forward(p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, fused)
        rows, b = int(ctx.schedule.num_rows), ctx.buffers
        runs[megakernel] = (kernel.direct, kernel.sym.local("combine").shape[0], out,
                            b.ring_x[:rows].view(torch.uint8), b.act[:rows].view(torch.uint8), b.h[:rows],
                            b.shared_act)
        del kernel
    (direct, direct_slots, *a), (fused_direct, fused_slots, *b) = runs[False], runs[True]
    return {"paths": (direct, fused_direct), "combine_rows": (direct_slots, fused_slots),
            "same_bits": [torch.equal(u, v) for u, v in zip(a, b)],
            "out": compare({"out": a[0].float()}, {"out": want.float()}, "bf16")}


@pytest.mark.parametrize("precision", ["bf16", "fp8-block", "mxfp8"])
def test_one_rank_runs_the_expert_kernels_with_the_megakernels_bits(precision):
    """At one rank a pass gathers the rows and runs the expert kernels on every SM instead of the megakernel: the
    same output, ring rows, pre-activations and activations, bit for bit, as the megakernel on the same rank; both
    keep the layer shape's combine slots (41 tokens x k 3 = 123: the backward's d_x slots)."""
    r = launch(_one_rank, 1, precision)[0]
    assert r["paths"] == (True, False) and r["combine_rows"] == (123, 123), r
    assert all(r["same_bits"]), r
    assert r["out"]["rel_err"] < (1e-2 if precision == "bf16" else 6e-2), r


def _plan_and_buffers(world, precision):
    """The planner's memory entries for the forward's buffers, and the bytes a MegaKernel allocates for them."""
    from megamoe.planner import plan

    shape = LayerShape.of(FP8_CONFIG, world.size, 40)
    p = plan(FP8_CONFIG, world.size, 40, num_sms=4, comm_sms=1, minibatch=64, ring_rows=256, tile_m=32, tile_n=32,
             precision=precision)
    k = MegaKernel(world, shape, p.config, precision=precision, one_rank_megakernel=True)  # the plan is the kernel's
    size = lambda *ts: sum(t.numel() * t.element_size() for t in ts if t is not None)  # noqa: E731
    local, b = k.sym.local, k.new_buffers()
    allocated = {
        "symmetric x [N, D] (bf16)": size(local("x")),
        "symmetric combine slots [N*k, D] (the backward's d_x slots)": size(local("combine")),
        "ring rows [ring, D]": size(b.ring_x, b.ring_scale),
        "ring pre-activation h [ring, 2I]": size(b.h),
        "ring activation [ring, I]": size(b.act, b.act_scale),
        "ring expert outputs y [ring, D]": size(k.y),
        "shared expert pre-activation h [N, 2*Is]": size(b.shared_h),
        "shared expert activation [N, Is]": size(b.shared_act),
        "shared expert y [N, D]": size(k.shared_y),
    }
    if precision != "bf16":
        allocated["symmetric quantised x [N, D] + scales (FP8)"] = size(local("x_q"), local("x_scale"))
    planned = {**p.memory, **p.kept}
    return {name: (planned.get(name), got) for name, got in allocated.items()}


@pytest.mark.parametrize("precision", ["bf16", "fp8-block", "mxfp8"])
def test_plan_memory_is_what_the_kernel_allocates(precision):
    """`megamoe plan`'s memory report names the forward's buffers with the bytes the kernel allocates."""
    for name, (planned, allocated) in launch(_plan_and_buffers, 1, precision)[0].items():
        assert planned == allocated, (name, planned, allocated)


# --------------------------------------------------------------------------- on GPUs (skipped on the CPU)

GPU_CONFIG = MoEConfig(hidden=1024, intermediate=384, num_experts=16, top_k=4, shared=(256,))


def _gpu_configs(sms: int):
    return [KernelConfig(sms, comm, minibatch, ring, 128, 256)
            for comm, minibatch, ring in ((16, 1024, 8192), (4, 256, 512), (32, 512, 16384), (1, 128, 256))]


#: Tokens per rank for the GPU tests, cut to the group's size (uneven; one rank with a single token, one with none).
UNEVEN_TOKENS = (1000, 700, 1, 999, 0, 640, 333, 900)


def _gpu_suite(world):
    results = []
    sms = torch.cuda.get_device_properties(world.device).multi_processor_count
    ranks = world.size
    for name, tokens, routing, drop in (("uneven", UNEVEN_TOKENS[:ranks], "uniform", 0.1),
                                        ("one-rank", (900,) + (0,) * (ranks - 1), "one-rank", 0.0),
                                        ("zipf", (2048,) * ranks, "zipf", 0.05)):
        p = _problem(world, GPU_CONFIG, tokens, routing, drop, 11)
        want = ep_reference_forward_backward(world, p, with_grads=False)[0]
        args = (world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared, None)
        out = megamoe_forward(*args)
        outs = [megamoe_forward(*args, config=c) for c in _gpu_configs(sms)] + [megamoe_forward(*args)]
        fwd = compare({"out": out.float()}, {"out": want.float()}, "bf16")
        results.append({"case": name, "correct": fwd["correct"], "rel_err": fwd["rel_err"],
                        "same_bits": [torch.equal(out, o) for o in outs]})
    return results


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_every_gpu_correct_and_bitwise_stable():
    """One rank per visible GPU: EP 2 on two GPUs, EP 4 on four."""
    for rank, per_case in enumerate(launch(_gpu_suite, torch.cuda.device_count(), device="cuda")):
        for r in per_case:
            assert r["correct"] and r["rel_err"] < 1e-2 and all(r["same_bits"]), (rank, r)


def _fp8_gpus(world):
    """FP8 on GPUs: within FP8 error of the oracle, bitwise the same across configs (planner's, a wrapping
    ring with few comm SMs) and with the weights quantised before the pass or in it."""
    p = _problem(world, GPU_CONFIG, UNEVEN_TOKENS[:world.size], "uniform", 0.1, 17)
    want = ep_reference_forward_backward(world, p, with_grads=False)[0]
    args = (world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared, None)
    sms = torch.cuda.get_device_properties(world.device).multi_processor_count
    results = {}
    for precision in ("fp8-block", "mxfp8"):
        planned = default_config(world, LayerShape.of(GPU_CONFIG, world.size, 1000), precision)
        out = megamoe_forward(*args, precision=precision, max_tokens=1000, config=planned)
        others = [megamoe_forward(*args, precision=precision, max_tokens=1000, config=KernelConfig(sms, 4, 256, 512)),
                  megamoe_forward(*args, precision=precision, max_tokens=1000, config=planned,
                                  experts_q=quantize_experts(p.w_gate_up, p.w_down, precision))]
        results[precision] = {"rel_err": compare({"out": out.float()}, {"out": want.float()}, "bf16")["rel_err"],
                              "same_bits": [torch.equal(out, o) for o in others]}
    return results


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_fp8_correct_and_same_bits_across_configs_and_prequantized_weights():
    for rank, results in enumerate(launch(_fp8_gpus, torch.cuda.device_count(), device="cuda")):
        for precision, r in results.items():
            assert 1e-3 < r["rel_err"] < 6e-2 and all(r["same_bits"]), (rank, precision, r)


def _shared_gpus(world):
    """More ranks than GPUs (gloo group, each rank its share of the SMs): correct against a one-process
    reference that rebuilds every rank's experts from the problem's seeds (no collective on CUDA tensors)."""
    tokens = (700, 300, 1000, 0, 500, 64, 900, 1)[:world.size]
    p = _problem(world, GPU_CONFIG, tokens, "uniform", 0.1, 13)
    experts = [make_problem(GPU_CONFIG, r, world.size, tokens[r], dtype=torch.bfloat16, seed=13, device=world.device)
               for r in range(world.size)]
    w_gate_up, w_down = (torch.cat([getattr(e, name) for e in experts]) for name in ("w_gate_up", "w_down"))
    want = moe_forward(p.x, p.top_experts, p.router_weights, w_gate_up, w_down, p.shared)
    args = (world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared, None)
    out = megamoe_forward(*args, max_tokens=max(tokens))
    again = megamoe_forward(*args, max_tokens=max(tokens))
    fwd = compare({"out": out.float()}, {"out": want.float()}, "bf16")
    whole_gpu = torch.cuda.get_device_properties(world.device).multi_processor_count
    try:
        megamoe_forward(*args, max_tokens=max(tokens), config=KernelConfig(whole_gpu, 8, 256, 512, 128, 256))
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return {"correct": fwd["correct"], "rel_err": fwd["rel_err"], "same_bits": torch.equal(out, again),
            "per_device": world.ranks_per_device, "refused": refused}


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [4, 8])
def test_gpu_more_ranks_than_gpus_correct(ranks):
    gpus = torch.cuda.device_count()
    if not 0 < gpus < ranks:
        pytest.skip(f"needs 1 to {ranks - 1} GPUs")
    for rank, r in enumerate(launch(_shared_gpus, ranks, device="cuda")):
        assert r["correct"] and r["rel_err"] < 1e-2 and r["same_bits"], (rank, r)
        assert r["per_device"] == -(-ranks // gpus), r
        assert r["refused"] is not None and "ranks on one GPU" in r["refused"], r


def _gpu_graph_and_timeout(world):
    """A captured pass replays to the eager pass's bits; a rank that never arrives makes the other raise."""
    cfg = MoEConfig(hidden=512, intermediate=256, num_experts=8, top_k=2, shared=(128,))
    p = _problem(world, cfg, (300, 200), "uniform", 0.0, 5)
    fused = fuse_shared(p.shared)
    shape = LayerShape.of(cfg, world.size, 300)
    kernel = MegaKernel(world, shape)
    args = (p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, fused)
    eager = kernel.forward(*args)[0].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernel.forward(*args, check=False)[0]
    replays = []
    for _ in range(2):
        graph.replay()
        replays.append(torch.equal(captured, eager))
    kernel.check_errors()
    lonely = MegaKernel(world, shape, wait_budget=1 << 14)  # collective: both ranks allocate
    message = None
    if world.rank == 0:  # rank 1 never starts the pass: rank 0's barrier must give up and say so
        try:
            lonely.forward(*args)
        except RuntimeError as exc:
            message = str(exc)
    torch.cuda.synchronize()
    world.barrier()
    return replays, message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_graph_replay_and_bounded_wait():
    (replays, message), (replays1, _) = launch(_gpu_graph_and_timeout, 2, device="cuda")
    assert all(replays) and all(replays1)
    assert message is not None and "start-of-pass barrier flag of rank 1" in message, message


def _gpu_replays(world, precision):
    """Passes replayed from the kernel's own CUDA graph against passes launched from the host, bit for bit, as
    x and the routing change every pass, the weights change in place (FP8: re-quantised, new addresses) and the
    token count changes (a pass from the host) and comes back (the graph again)."""
    cfg = MoEConfig(hidden=512, intermediate=256, num_experts=8, top_k=2, shared=(128,))
    shape = LayerShape.of(cfg, world.size, 300)
    base = _problem(world, cfg, (300, 200), "uniform", 0.0, 5)
    fused = fuse_shared(base.shared)
    replayed = MegaKernel(world, shape, precision=precision)
    launched = MegaKernel(world, shape, precision=precision, replay=False)
    quantized = precision != "bf16"
    experts_q = quantize_experts(base.w_gate_up, base.w_down, precision) if quantized else None
    same, previous = [], None
    for step, tokens in enumerate([(300, 200)] * 4 + [(100, 250), (300, 200)]):
        p = _problem(world, cfg, tokens, "uniform", 0.0, 10 + step)
        if step == 3:  # an optimizer step
            base.w_down.mul_(0.5)
            experts_q = quantize_experts(base.w_gate_up, base.w_down, precision) if quantized else None
        args = (p.x, p.top_experts, p.router_weights, base.w_gate_up, base.w_down, fused)
        # each kernel's scratch buffers: a graph bakes in the buffers' addresses, and fresh buffers every pass
        # land wherever the allocator puts them (no key would repeat reliably)
        out = replayed.forward(*args, experts_q=experts_q, buffers=replayed.scratch_buffers())[0]
        want = launched.forward(*args, experts_q=experts_q, buffers=launched.scratch_buffers())[0]
        fresh = previous is None or out.shape != previous.shape or not torch.equal(out, previous)
        same.append(torch.equal(out, want) and fresh)
        previous = out
    return same, (replayed.replay.captures, replayed.replay.replays), launched.replay


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8-block"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_gpu_replayed_passes_match_launched(ranks, precision):
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs")
    for rank, (same, replays, launched) in enumerate(launch(_gpu_replays, ranks, precision, device="cuda")):
        assert all(same), (rank, same)
        # (captures, replays) bf16: passes 1-3 and 5 replay one graph (4 has another token count); fp8-block:
        # pass 3's re-quantised weights are a new key, seen again at pass 5 (after pass 4's other count), so
        # passes 1, 2 replay the first graph and pass 5 a second
        assert replays == ((1, 4) if precision == "bf16" else (2, 3)), (rank, replays)
        assert launched is None


def test_megakernel_compiles_for_sm90_in_every_format():
    """Compiled on the CPU for Hopper: wgmma (FP8 for fp8-block; MXFP8 dequantises to BF16), TMA loads, the
    async-proxy fences between the comm workers' stores and the compute workers' TMA reads, and 16-byte loads
    and stores only (2-byte stores of rows that cross NVLink made a pass 1.7x slower: 2026-11-30-one-rank,
    section 6); the weighted sum, one 16-byte load per slot vector."""
    summary = sm90_report("megakernel")
    weighted_sum = summary.pop("weighted_sum")
    assert set(summary) == {"bf16", "mxfp8", "fp8-block"}
    # the weighted sum loads each slot's rows once (16 bytes per thread and vector): a masked pair of loads per
    # slot compiled to twice as many and took twice the time (2026-11-30-qwen-pass)
    w = weighted_sum
    vectors = w["block_t"] * w["block_d"] * 2 // (16 * 32 * w["num_warps"])
    assert w["loads_v4"] == (w["top_k"] + w["has_shared"]) * vectors, w
    for fmt, facts in summary.items():
        assert facts["wgmma"] > 0 and facts["tma"] and facts["fence_proxy_async"], (fmt, facts)
        assert facts["stores_b16"] == 0 and facts["stores_v4"] > 0, (fmt, facts)
        assert facts["loads_b16"] == 0 and facts["loads_v4"] > 0, (fmt, facts)
        assert facts["wgmma_fp8"] == fmt.startswith("fp8-block") and facts["wgmma_bf16"], (fmt, facts)


def _error_word(world):
    from megamoe.kernels import megakernel as mk

    p = make_problem(CONFIG, world.rank, world.size, 8, dtype=torch.bfloat16)
    fused = fuse_shared(p.shared)
    kernel = MegaKernel(world, LayerShape.of(CONFIG, 1, 8), one_rank_megakernel=True)
    kernel.error.copy_(torch.tensor([mk.WAIT_TILE_DONE.value, 7, 2, 1], dtype=torch.int32))
    return raised((kernel.check_errors,
                   lambda: kernel.forward(p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, fused)),
                  RuntimeError)


def test_a_timed_out_wait_names_its_counter_and_breaks_the_kernel():
    """The error word a wait leaves becomes a RuntimeError naming the counter, index, target and value seen;
    the MegaKernel refuses later passes."""
    first, later = launch(_error_word, 1)[0]
    assert first is not None and "gate/up done of row tile 7" in first and "wanted >= 2, saw 1" in first
    assert later == first


@pytest.mark.slow  # a GPU tool's CPU smoke run (15-40 s): `pytest -m slow`, before a GPU session
def test_megakernel_ab_runs_on_cpu_ranks(tmp_path):
    """benchmarks/megakernel_ab.py (variants in interleaved rounds) on 2 CPU ranks: every variant, another comm SM
    count and minibatch included, gives the first's bits, and the configs are the ones asked for."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), *sys.path])}
    out = tmp_path / "ab.json"
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "megakernel_ab.py"), "--device", "cpu", "--preset", "tiny",
         "--tokens", "32", "--variants", "1,2/64", "--rounds", "1", "--passes", "1", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["bitwise_equal"] == {"1": True, "2/64": True}, result
    assert "comm_sms=1," in result["configs"]["1"] and "comm_sms=2, minibatch=64," in result["configs"]["2/64"]
    assert all(len(v) == 1 and v[0] > 0 for v in result["rounds_ms"].values()), result
