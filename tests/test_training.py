"""Training through megamoe on CPU ranks: every gradient against the FP32 oracle, bitwise stable, and the API.

One launch per rank count runs a table of cases on one process group. Each case's gradients (x, router
weights, the routed experts, every shared expert) are compared with ``moe_forward_backward`` run over the EP
group (``megamoe.reference.ep``) with a random upstream gradient, and again across a rerun, a ring too small for
the routed rows (the backward replays the overwritten minibatches) and other comm_sms / minibatch sizes: the
gradients must be the same bits.
"""

import sys
import time

from unittest import mock

import pytest
import torch

from megamoe.autograd import moe
from megamoe.bench.accuracy import _flatten, error_stats
from megamoe.bench.problem import make_problem
from megamoe.config import MoEConfig
from megamoe.megakernel import megamoe_forward
from megamoe.parallel.world import launch
from megamoe.planner import KernelConfig, LayerShape
from megamoe.reference.ep import ep_reference_forward_backward

from kinds import GEGLU, GPT_OSS, SWIGLU  # tests/kinds.py

from raised import raised  # tests/raised.py
from sm90 import sm90_report  # tests/sm90.py

CONFIG = MoEConfig(hidden=128, intermediate=64, num_experts=8, top_k=3, shared=(32,))
EMPTY_EXPERT = 5
#: Interpreter tiles are 32 rows: a 32-row minibatch in a 64-row ring wraps for any case with > 64 rows.
#: Its backward takes 64-row minibatches: the ring's end is a boundary of theirs too.
WRAPPING = KernelConfig(num_sms=4, comm_sms=2, minibatch=32, ring_rows=64, tile_m=32, tile_n=32, backward_minibatch=64)
OTHER = KernelConfig(num_sms=5, comm_sms=1, minibatch=96, ring_rows=1056, tile_m=32, tile_n=32, backward_comm_sms=3,
                     backward_minibatch=32)
#: BF16 gradients against the FP32 oracle: relative L1 and the worst row's relative L2 (a row judged against its
#: own norm or the typical row's), the bench's BF16 bounds with a tighter row. Measured here 0.3-0.6e-2 L1 (the
#: interpreter rounds to nearest like the GPU: megamoe.kernels.convert). A missing or misplaced route, a wrong
#: weight or a stale context gives errors near 1.
GRAD_TOLERANCE = (1e-2, 2.5e-2)
#: With the SwiGLU clamp the gradient has a step at the limit: the kernels differentiate at the BF16 h the forward
#: kept, the oracle at its FP32 h, so elements within a BF16 ulp of the limit (~0.1 % here) get 0 on one side and
#: their gradient on the other (measured: 1-2 elements per rank here). With ~15 rows per expert one such element
#: carries a weight-gradient row (3x the oracle's norm seen), so only the L1 bound holds the layer here; the kernels
#: against the twin that differentiates at the same BF16 h hold the clamp's gradient tightly
#: (tests/test_experts.py).
CLAMP_TOLERANCE = (5e-2, float("inf"))

# (name, tokens per rank, routing, drop, seed, activation, shared experts, zero router weights)
CASES = {
    1: [("uniform", (37,), "uniform", 0.0, 1, SWIGLU, (32,), False),
        ("no-tokens", (0,), "uniform", 0.0, 4, SWIGLU, (32,), False)],
    2: [("two-shared", (40, 33), "uniform", 0.0, 5, SWIGLU, (32, 16), False),  # first: it wraps WRAPPING's ring
        ("uneven-zero-weights", (29, 0), "uniform", 0.15, 1, SWIGLU, (32,), True),
        ("one-rank-gpt-oss", (17, 23), "one-rank", 0.1, 3, GPT_OSS, (32,), False),
        ("no-shared", (21, 30), "uniform", 0.1, 6, SWIGLU, (), True)],
    3: [("zipf", (13, 31, 7), "zipf", 0.2, 2, GEGLU, (), False)],
    4: [("uneven", (13, 5, 21, 0), "uniform", 0.15, 1, SWIGLU, (32,), False)],
}


def _problem(world, cfg, tokens, routing, drop, seed, zero_weights):
    p = make_problem(cfg, world.rank, world.size, tokens[world.rank], dtype=torch.bfloat16, seed=seed,
                     routing=routing, drop=drop, device=world.device)
    p.top_experts = torch.where(p.top_experts == EMPTY_EXPERT, -1, p.top_experts)  # an expert with no tokens
    w = torch.where(p.top_experts >= 0, p.router_weights, 0.5)  # a stale slot would show
    if zero_weights:  # a route whose weight is exactly 0 still has a gradient (no division by w)
        w[::2, 0] = 0.0
    p.router_weights = w
    return p


def _grads(world, p, activation, config=None, fused=True, **options):
    """(out, gradients) of megamoe.moe with every input and weight requiring grad (``options`` go to moe)."""
    leaves = {name: getattr(p, name).detach().clone().requires_grad_()
              for name in ("x", "router_weights", "w_gate_up", "w_down")}
    shared = [(a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()) for a, b in p.shared]
    out = moe(world, leaves["x"], p.top_experts, leaves["router_weights"], leaves["w_gate_up"], leaves["w_down"],
              shared, activation, config=config, fused_backward=fused, **options)
    out.backward(p.d_out)
    grads = {name: t.grad for name, t in leaves.items()}
    grads["shared"] = [(a.grad, b.grad) for a, b in shared]
    return out.detach(), _flatten(grads)


def _routed_rows(world, top_experts):
    """Rows this rank's experts get from every rank (the schedule's num_rows)."""
    everyone = world.all_gather_object(top_experts.cpu())
    L = CONFIG.num_experts // world.size if world.size != 3 else 3
    return sum(int(((t >= world.rank * L) & (t < (world.rank + 1) * L)).sum()) for t in everyone)


def _suite(world, cases):
    results = []
    for index, (name, tokens, routing, drop, seed, activation, shared, zero) in enumerate(cases):
        experts = 9 if world.size == 3 else CONFIG.num_experts
        cfg = MoEConfig(**{**CONFIG.__dict__, "activation": activation, "shared": shared, "num_experts": experts})
        p = _problem(world, cfg, tokens, routing, drop, seed, zero)
        want_out, want = ep_reference_forward_backward(world, p)
        want = _flatten(want)
        out, got = _grads(world, p, activation)
        errors = {k: error_stats(got[k].detach(), v) for k, v in want.items() if v.numel()}
        # the standalone kernels composed: the backward megakernel's bits; and on each rank count's first case
        # a rerun, a wrapping ring (replay), other knobs and the composed kernels with a replay (the fuzz and the
        # soak repeat these over many more cases: tests/test_fuzz.py, tests/test_soak.py)
        runs = [_grads(world, p, activation, fused=False)[1]]
        if index == 0:
            runs += [_grads(world, p, activation)[1], _grads(world, p, activation, WRAPPING)[1],
                     _grads(world, p, activation, OTHER)[1], _grads(world, p, activation, WRAPPING, fused=False)[1]]
        zero_slots = p.router_weights == 0
        results.append({
            "case": name,
            "out_rel": error_stats(out, want_out)["rel"] if out.numel() else 0.0,
            "errors": {k: (e["rel"], e["row"], e["finite"]) for k, e in errors.items()},
            "dtypes": {k: str(t.dtype) for k, t in got.items()},
            "same_bits": [all(torch.equal(run[k], got[k]) for k in got) for run in runs],
            "wrapped": _routed_rows(world, p.top_experts) > WRAPPING.ring_rows,
            # the oracle's gradient at the zero weights is not zero, and ours follows it
            "zero_weight_grads": (float(want["router_weights"][zero_slots].abs().sum()),
                                  float((got["router_weights"][zero_slots] - want["router_weights"][zero_slots])
                                        .abs().max()) if bool(zero_slots.any()) else 0.0),
        })
    return results


# CI keeps 1, 2 and one odd or wide world; the rest run with -m slow (CI stays under 15 minutes on 2 cores)
@pytest.mark.parametrize("ranks", [pytest.param(r, marks=pytest.mark.slow) if r in (3, 4) else r
                                   for r in sorted(CASES)])
def test_gradients_match_the_oracle_and_are_bitwise_stable(ranks):
    """Every gradient equals the oracle's within BF16 tolerance; a rerun, a wrapping ring (replay), other
    comm_sms / minibatch / ring sizes and the standalone kernels composed give the backward megakernel's bits."""
    wrapped = False
    for rank, per_case in enumerate(launch(_suite, ranks, CASES[ranks])):
        assert len(per_case) == len(CASES[ranks])
        for r, case in zip(per_case, CASES[ranks]):
            rel_tol, row_tol = CLAMP_TOLERANCE if case[5].limit is not None else GRAD_TOLERANCE
            assert r["out_rel"] < 1e-2, (ranks, rank, r)
            for name, (rel, row, finite) in r["errors"].items():
                assert finite and rel <= rel_tol and row <= row_tol, (ranks, rank, r["case"], name, rel, row)
            assert all(r["same_bits"]), (ranks, rank, r)
            assert r["dtypes"]["x"] == "torch.bfloat16" and r["dtypes"]["router_weights"] == "torch.float32", r
            oracle_sum, worst = r["zero_weight_grads"]
            if "zero-weights" in r["case"] and oracle_sum:
                assert worst <= 0.05 * oracle_sum + 1e-3, r
            wrapped = wrapped or (r["wrapped"] and r["case"] == CASES[ranks][0][0])
    if ranks == 2:  # the first case (the one run with WRAPPING) routes more rows to a rank than its ring holds
        assert wrapped, "the first case did not wrap the ring: the replay went untested"


def _api(world):
    p = _problem(world, CONFIG, (12, 9), "uniform", 0.0, 7, False)
    x = p.x.clone().requires_grad_()
    w = p.w_gate_up.clone().requires_grad_()
    args = (world, x, p.top_experts, p.router_weights, w, p.w_down, p.shared)
    errors = raised([
        lambda: megamoe_forward(*args),  # grad mode on and inputs requiring grad: not silently dropped
        lambda: moe(*args, precision="fp8-block", fused_backward=True),
        lambda: moe(*args, precision="fp4"),
        lambda: moe(*args, max_tokens=3),
    ])
    with torch.no_grad():
        plain = megamoe_forward(*args)
    out = moe(*args)
    out.backward(p.d_out)
    # only what requires grad gets a gradient
    return errors, torch.equal(out.detach(), plain), x.grad is not None and w.grad is not None, p.w_down.grad is None


def test_api_refuses_what_it_cannot_train_and_grads_only_where_asked():
    errors, same, got, untouched = launch(_api, 2)[0]
    assert all(errors), errors
    assert "megamoe.moe" in errors[0] and "runs BF16 experts" in errors[1]
    assert "precision" in errors[2] and "max_tokens" in errors[3]
    assert same and got and untouched


MODEL = MoEConfig(hidden=64, intermediate=32, num_experts=8, top_k=2, shared=(32,))
STEPS = 10
#: Loss curves of the megamoe model and the same model on the reference layer: the same weights, data and
#: optimizer, BF16 kernels against FP32 reference math; their relative distance per step.
LOSS_TOLERANCE = 2e-2
#: Step 0's expert gradients of each block against the reference model's: block 1's pass through block 2's d_x,
#: so two layers' BF16 errors compound (measured ~3e-2); a block reading the other's context gives ~1.
MODEL_GRAD_TOLERANCE = 5e-2


class TwoBlocks(torch.nn.Module):
    """A MoEBlock, then a MoEBlock with a residual: ``y = b1(x); out = y + b2(y)``."""

    def __init__(self, world, impl):
        super().__init__()
        from megamoe.nn import MoEBlock

        torch.manual_seed(0)  # the routers alike on every rank and in both models
        self.b1 = MoEBlock(MODEL, world, impl=impl, seed=1)
        self.b2 = MoEBlock(MODEL, world, impl=impl, seed=2)

    def forward(self, x):
        y = self.b1(x)
        return y + self.b2(y)


def _replicated(model):
    """Parameters every rank holds alike (routers, shared experts): their gradients cover this rank's tokens."""
    return [p for name, p in model.named_parameters() if "router" in name or "shared" in name]


def _train(world):
    g = torch.Generator().manual_seed(100 + world.rank)
    x = torch.randn(16, MODEL.hidden, generator=g)
    target = torch.randn(16, MODEL.hidden, generator=g) * 0.1
    curves, first_grads = {}, {}
    for impl in ("megamoe", "reference"):
        model = TwoBlocks(world, impl)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step in range(STEPS):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).float(), target)
            loss.backward()
            for p in _replicated(model):
                torch.distributed.all_reduce(p.grad, group=world.group)
            if step == 0:  # each block's expert gradients: a block reading the other's context would be wrong
                first_grads[impl] = [b.moe.w_gate_up.grad.float().clone() for b in (model.b1, model.b2)]
            opt.step()
            total = loss.detach().clone()
            torch.distributed.all_reduce(total, group=world.group)
            losses.append(float(total) / world.size)
        curves[impl] = losses
    grad_errors = [error_stats(a, b)["rel"] for a, b in zip(first_grads["megamoe"], first_grads["reference"])]
    return curves, grad_errors


def test_two_block_model_trains_like_the_reference_layer():
    """A two-block model trained 10 steps with AdamW on 2 CPU ranks: its loss curve is the reference layer's
    within BF16 tolerance, it learns, and both blocks' first gradients match (each backward read its own
    context)."""
    (curves, grad_errors), _ = launch(_train, 2)
    mm, ref = curves["megamoe"], curves["reference"]
    gaps = [abs(a - b) / b for a, b in zip(mm, ref)]
    assert max(gaps) <= LOSS_TOLERANCE, (gaps, mm, ref)
    assert mm[-1] < 0.9 * mm[0] and ref[-1] < 0.9 * ref[0], (mm, ref)
    assert all(e <= MODEL_GRAD_TOLERANCE for e in grad_errors), grad_errors


def _compiled(world):
    from megamoe.nn import MoEBlock

    torch.manual_seed(0)
    block = MoEBlock(MODEL, world, max_tokens=12, seed=3)
    x = torch.randn(12, MODEL.hidden, generator=torch.Generator().manual_seed(world.rank))
    eager = block(x)
    eager.float().square().sum().backward()
    want = {name: p.grad.clone() for name, p in block.named_parameters()}
    results = {}
    for backend in ("aot_eager", "inductor"):  # AOTAutograd traces the fake impls and the backward op
        torch._dynamo.reset()
        block.zero_grad()
        out = torch.compile(block, fullgraph=True, backend=backend)(x)
        out.float().square().sum().backward()
        results[backend] = (torch.equal(out, eager),
                            max(error_stats(p.grad, want[name])["rel"] for name, p in block.named_parameters()))
    return results


def test_backward_megakernel_compiles_for_sm90():
    """Compiled on the CPU for Hopper, every role of the backward megakernel: BF16 wgmma, TMA, the async-proxy
    fences after each wait, 16-byte loads and stores only, and one program fits an SM (shared memory and
    registers: the grid must be resident at once)."""
    report = sm90_report("backward")
    gather = report["gather_rows"]  # the windows' read of the forward ring: 16-byte vectors, no spills
    assert gather["loads_b16"] == 0 and gather["stores_b16"] == 0 and gather["stores_v4"] > 0, gather
    assert not gather["local_memory"], gather
    assert not report["window_table"]["local_memory"], report["window_table"]  # one launch per window, no spills
    deal = report["wgrad_deal"]  # one launch a dealt wgrad: no spills
    assert not deal["local_memory"] and deal["stack_bytes"] == 0, deal
    facts = report["bf16"]
    assert facts["wgmma"] > 0 and facts["wgmma_bf16"] and facts["tma"] and facts["fence_proxy_async"], facts
    assert facts["stores_b16"] == 0 and facts["loads_b16"] == 0 and facts["stores_v4"] > 0, facts
    assert facts["shared_bytes"] <= 227 * 1024 and facts["registers"] * 256 <= 65536, facts


def test_torch_compile_fullgraph_traces_a_moe_block(tmp_path, monkeypatch):
    """torch.compile(fullgraph=True) over a MoEBlock on CPU ranks, forward and backward: the same bits as eager
    through AOTAutograd; with Inductor (which fuses the router's own ops its way) the same output and gradients
    within float32 rounding."""
    # a fresh compile cache: a cached graph does not see a change in this project's fake implementations
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    for results in launch(_compiled, 2):
        assert results["aot_eager"] == (True, 0.0), results
        same_out, grad_error = results["inductor"]
        assert same_out and grad_error < 1e-5, results


def _eager_and_op_paths(world):
    from megamoe.ops.expert_weights import quantize_experts

    cfg = MoEConfig(hidden=128, intermediate=128, num_experts=4, top_k=2, shared=(32,), expert_bias=True)  # FP8: I % 128
    p = _problem(world, cfg, (12, 9), "uniform", 0.0, 11, True)
    results = {}
    for precision in ("bf16", "fp8-block"):
        runs = []
        for compiling in (False, True):  # the op as torch.compile traces it, called here eagerly
            leaves = {name: getattr(p, name).detach().clone().requires_grad_()
                      for name in ("x", "router_weights", "w_gate_up", "b_gate_up", "b_down")}
            w_down = p.w_down.detach().clone()  # no gradient asked: none given
            shared = [(a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()) for a, b in p.shared]
            pack = None if precision == "bf16" else quantize_experts(leaves["w_gate_up"], w_down, precision,
                                                                       backward=True)
            with mock.patch.object(torch.compiler, "is_compiling", return_value=compiling):
                out = moe(world, leaves["x"], p.top_experts, leaves["router_weights"], leaves["w_gate_up"], w_down,
                          shared, precision=precision, max_tokens=12, experts_q=pack, b_gate_up=leaves["b_gate_up"],
                          b_down=leaves["b_down"], check=not compiling)
            out.backward(p.d_out)
            grads = [t.grad for t in leaves.values()] + [t.grad for pair in shared for t in pair]
            runs.append((type(out.grad_fn).__name__, out.detach(), grads, w_down.grad))
        (eager_fn, out, grads, none), (op_fn, op_out, op_grads, op_none) = runs
        results[precision] = (eager_fn, op_fn, torch.equal(out, op_out),
                              all(g is not None and torch.equal(g, h) for g, h in zip(grads, op_grads)),
                              none is None and op_none is None, len(grads))
    return results


def test_eager_layer_gives_the_ops_bits_and_grads_only_where_asked():
    """Outside torch.compile `moe` runs the ops' functions through one autograd.Function (`EagerLayer`, no
    custom-op dispatch on the host's path); under it, the ops. Both give the same output and gradients, bit for
    bit, with shared experts, expert biases and an FP8 pack, on two ranks; an input asking no gradient gets none."""
    for per_rank in launch(_eager_and_op_paths, 2):
        for precision, (eager_fn, op_fn, same_out, same_grads, none, count) in per_rank.items():
            assert eager_fn == "EagerLayerBackward" and op_fn != eager_fn, (precision, eager_fn, op_fn)
            assert same_out and same_grads and none and count == 7, (precision, per_rank[precision])


def _validations(world):
    from megamoe.megakernel import MegaKernel, fuse_shared

    p = _problem(world, CONFIG, (12,), "uniform", 0.0, 5, False)
    leaves = [t.detach().clone().requires_grad_() for t in (p.x, p.router_weights, p.w_gate_up, p.w_down)]
    calls = []
    check = MegaKernel.check_inputs
    with mock.patch.object(MegaKernel, "check_inputs", lambda self, *a, **k: calls.append(1) or check(self, *a, **k)):
        out = moe(world, leaves[0], p.top_experts, *leaves[1:], p.shared, max_tokens=12)
        out.backward(p.d_out)
        layer_calls = len(calls)
        megamoe_forward(world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared, max_tokens=12)
        forward_calls = len(calls) - layer_calls
        kernel = MegaKernel(world, LayerShape.of(CONFIG, world.size, 8), WRAPPING)  # 12 tokens do not fit
        wrong = raised((lambda: kernel.forward(p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down,
                                               fuse_shared(p.shared)),), ValueError)
    return layer_calls, forward_calls, len(calls) - layer_calls - forward_calls, wrong, all(
        t.grad is not None for t in leaves)


def test_the_layer_checks_its_inputs_once_and_a_kernel_called_alone_checks_them():
    """``moe`` and ``megamoe_forward`` validate the pass's inputs and pick the kernel for their shape, so the kernel
    does not check them again (``validated``: 25-50 us of host time a pass saved); a MegaKernel called directly does,
    and names the mismatch."""
    layer_calls, forward_calls, direct_calls, wrong, grads = launch(_validations, 1)[0]
    assert layer_calls == 0 and forward_calls == 0 and grads, (layer_calls, forward_calls, grads)
    assert direct_calls == 1 and wrong is not None and "at most 8 tokens per rank" in wrong[0], (direct_calls, wrong)


def _backward_error_word(world):
    from megamoe.kernels import megakernel_bwd as mkb
    from megamoe.megakernel import MegaKernel, fuse_shared
    from megamoe.megakernel.saved import SavedForward
    from megamoe.planner import LayerShape

    p = _problem(world, CONFIG, (12, 9), "uniform", 0.0, 8, False)
    fused = fuse_shared(p.shared)
    kernel = MegaKernel(world, LayerShape.of(CONFIG, world.size, 12), WRAPPING)
    _, ctx = kernel.forward(p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, fused)
    saved = SavedForward(ctx.buffers.h, ctx.buffers.shared_h, ctx.schedule)
    kernel.error.copy_(torch.tensor([mkb.WAIT_DACT.value, 3, 2, 1], dtype=torch.int32))  # as a timed-out wait leaves it
    backward = lambda: kernel.backward(saved, p.d_out, p.x, p.top_experts, p.router_weights, p.w_gate_up,  # noqa: E731
                                       p.w_down, fused, SWIGLU)
    return raised((kernel.check_errors, backward), RuntimeError)


def test_a_timed_out_backward_wait_names_its_counter_and_breaks_the_kernel():
    """The backward megakernel's waits report as the forward's do: the counter, its index, target and value."""
    for first, later in launch(_backward_error_word, 2):
        assert first is not None and "backward dact done of row tile 3" in first and "wanted >= 2, saw 1" in first
        assert later == first


GPU_CONFIG = MoEConfig(hidden=1024, intermediate=384, num_experts=16, top_k=4, shared=(256,))
GPU_TOKENS = (1000, 700, 1, 999, 0, 640, 333, 900)


def _gpu_configs(world):
    """The planner's config, a ring that wraps (replay), and other comm_sms / minibatch sizes."""
    sms = torch.cuda.get_device_properties(world.device).multi_processor_count // world.ranks_per_device
    return [None] + [KernelConfig(sms, comm, minibatch, ring, 128, 256, backward_minibatch=bwd)
                     for comm, minibatch, ring, bwd in ((4, 256, 512, None), (16, 1024, 8192, 2048),
                                                        (2, 128, 256, 256))]


def _gpu_suite(world):
    results = []
    ranks = world.size
    for name, tokens, routing, activation in (("uneven", GPU_TOKENS[:ranks], "uniform", SWIGLU),
                                              ("one-rank-gpt-oss", (900,) + (0,) * (ranks - 1), "one-rank", GPT_OSS),
                                              ("zipf-geglu", (2048,) * ranks, "zipf", GEGLU)):
        start = time.time()
        cfg = MoEConfig(**{**GPU_CONFIG.__dict__, "activation": activation})
        p = _problem(world, cfg, tokens, routing, 0.1, 11, name == "uneven")
        _, want = ep_reference_forward_backward(world, p)
        want = _flatten(want)
        got = _grads(world, p, activation)[1]
        errors = {k: error_stats(got[k].detach(), v) for k, v in want.items() if v.numel()}
        runs = [_grads(world, p, activation, config=c, fused=f)[1] for c in _gpu_configs(world) for f in (True, False)]
        results.append({"case": name, "activation": activation,
                        "errors": {k: (e["rel"], e["row"], e["finite"]) for k, e in errors.items()},
                        "same_bits": [all(torch.equal(run[k], got[k]) for k in got) for run in runs],
                        "host_syncs": {f: _host_sync(world, p, activation, max(tokens), f) for f in (True, False)}})
        print(f"rank {world.rank}: {name} in {time.time() - start:.0f} s", file=sys.stderr, flush=True)  # with -s
    return results


def _host_sync(world, p, activation, max_tokens, fused):
    """None when a training step with check=False and max_tokens given makes no host sync (CUDA's sync debug
    mode raises on one), else what it raised. Two warm-up steps first: compiles, workspaces, graph captures."""
    for _ in range(2):
        _grads(world, p, activation, fused=fused, check=False, max_tokens=max_tokens)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _grads(world, p, activation, fused=fused, check=False, max_tokens=max_tokens)
        return None
    except RuntimeError as e:
        return str(e)[:300]
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_gradients_match_the_oracle_and_are_bitwise_stable():
    """On the GPUs (one rank per GPU; two ranks on one GPU when there is one): every gradient against the oracle,
    and the same bits across knobs, a replay, and the composed standalone kernels; no host sync in a step with
    check=False, fused or composed."""
    ranks = max(2, torch.cuda.device_count())
    for rank, per_case in enumerate(launch(_gpu_suite, ranks, device="cuda")):
        for r in per_case:
            rel_tol, row_tol = CLAMP_TOLERANCE if r["activation"].limit is not None else GRAD_TOLERANCE
            for name, (rel, row, finite) in r["errors"].items():
                assert finite and rel <= rel_tol and row <= row_tol, (rank, r["case"], name, rel, row)
            assert all(r["same_bits"]), (rank, r)
            assert r["host_syncs"] == {True: None, False: None}, (rank, r["case"], r["host_syncs"])
