"""docs/errors.md's table, walked: every public entry point given each kind of bad input raises the error the
table names, before anything runs; every row has a case here and every case a row."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from megamoe.config import SWIGLU, MoEConfig
from megamoe.parallel.world import launch

from kinds import clamped  # tests/kinds.py

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
CFG = MoEConfig(hidden=128, intermediate=64, num_experts=4, top_k=2, shared=(32,))
N = 4


def _inputs():
    """A good BF16 layer problem on one rank: x, top_experts, router_weights, w_gate_up, w_down, shared."""
    g = torch.Generator().manual_seed(0)
    D, I, E = CFG.hidden, CFG.intermediate, CFG.num_experts
    bf16 = dict(dtype=torch.bfloat16)
    x = torch.randn(N, D, generator=g).to(**bf16)
    top = torch.tensor([[0, 1], [2, 3], [1, -1], [3, 0]], dtype=torch.int32)
    weights = torch.rand(N, 2, generator=g)
    w_gate_up = (torch.randn(E, 2 * I, D, generator=g) * D ** -0.5).to(**bf16)
    w_down = (torch.randn(E, D, I, generator=g) * I ** -0.5).to(**bf16)
    shared = [((torch.randn(64, D, generator=g) * D ** -0.5).to(**bf16),
               (torch.randn(D, 32, generator=g) * 32 ** -0.5).to(**bf16))]
    return x, top, weights, w_gate_up, w_down, shared


def _layer_cases(name, call, bf16_only=True):
    """The bad inputs every layer entry point refuses alike; ``call(x, top, w, w_gate_up, w_down, shared, **kw)``.
    ``bf16_only``: x must be bfloat16 (the reference takes any float dtype)."""
    x, top, w, gu, dn, shared = _inputs()
    return {
        **({(name, "x not bfloat16"): lambda: call(x.float(), top, w, gu, dn, shared)} if bf16_only else {}),
        (name, "x not 2-D"): lambda: call(x[0], top, w, gu, dn, shared),
        (name, "D not a multiple of 64"): lambda: call(x[:, :100], top, w, gu, dn, shared),
        (name, "top_experts not integer"): lambda: call(x, top.float(), w, gu, dn, shared),
        (name, "top_experts rows differ from x's"): lambda: call(x, top[:3], w, gu, dn, shared),
        (name, "router_weights not float32"): lambda: call(x, top, w.double(), gu, dn, shared),
        (name, "router_weights shape differs from top_experts'"): lambda: call(x, top, w[:, :1], gu, dn, shared),
        (name, "an expert id out of range"): lambda: call(x, top.masked_fill(top == 3, 9), w, gu, dn, shared),
        (name, "w_gate_up's D differs from x's"): lambda: call(x, top, w, gu[:, :, :64], dn, shared),
        (name, "w_down's shape differs from w_gate_up's"): lambda: call(x, top, w, gu, dn[:, :, :32], shared),
        (name, "a shared expert not a pair"): lambda: call(x, top, w, gu, dn, [shared[0][0]]),
        (name, "activation a bare number"): lambda: call(x, top, w, gu, dn, shared, activation=-1.0),
        (name, "a weight on another device"): lambda: call(x, top, w, gu.to("meta"), dn, shared),
    }


def _cases(world) -> dict:
    from megamoe import KernelConfig, MoE, Router, moe, plan, preset
    from megamoe.baselines.nccl_torch import nccl_torch_moe
    from megamoe.megakernel import MegaKernel, megamoe_forward
    from megamoe.ops.expert_weights import quantize_experts
    from megamoe.parallel.world import init_world
    from megamoe.planner import LayerShape
    from megamoe.reference.layer import moe_forward
    from megamoe.adapters import fsdp, hf, torchtitan
    from megamoe.training import TrainOptions

    x, top, w, gu, dn, shared = _inputs()
    small = KernelConfig(num_sms=4, comm_sms=1, minibatch=32, ring_rows=64, tile_m=32, tile_n=32)
    forward = lambda *a, **kw: megamoe_forward(world, *a, config=small, **kw)  # noqa: E731
    layer = lambda *a, **kw: moe(world, *a, config=small, **kw)  # noqa: E731
    kernel = MegaKernel(world, LayerShape.of(CFG, 1, N), small)
    fused = (shared[0][0], shared[0][1])
    cases = {
        ("init_world", "an unknown device"): lambda: init_world("tpu"),
        ("MoEConfig", "D not a multiple of 64"): lambda: MoEConfig(hidden=100, intermediate=64, num_experts=4,
                                                                   top_k=2),
        ("MoEConfig", "top_k above num_experts"): lambda: MoEConfig(hidden=128, intermediate=64, num_experts=4,
                                                                    top_k=5),
        ("MoEConfig", "activation limit not positive"): lambda: MoEConfig(hidden=128, intermediate=64, num_experts=4,
                                                                          top_k=2, activation=clamped(0.0)),
        ("preset", "an unknown name"): lambda: preset("gpt-5"),
        ("KernelConfig", "comm_sms leaving no compute SM"): lambda: KernelConfig(4, 4, 32, 64, 32, 32),
        ("KernelConfig", "minibatch not a multiple of tile_m"): lambda: KernelConfig(4, 1, 48, 96, 32, 32),
        ("KernelConfig", "backward_minibatch not a multiple of tile_m"): lambda: KernelConfig(
            4, 1, 32, 96, 32, 32, backward_minibatch=48),
        ("KernelConfig", "backward_ring_rows not a multiple of 128"): lambda: KernelConfig(
            4, 1, 32, 96, 32, 32, backward_ring_rows=96),
        ("plan", "ep not dividing the experts"): lambda: plan(CFG, 3, 1024),
        ("plan", "an unknown precision"): lambda: plan(CFG, 1, 1024, precision="fp4"),
        ("megamoe_forward", "an unknown precision"): lambda: forward(x, top, w, gu, dn, shared, precision="fp4"),
        ("megamoe_forward", "config not a KernelConfig"): lambda: megamoe_forward(world, x, top, w, gu, dn, shared,
                                                                                 config="fast"),
        ("megamoe_forward", "max_tokens below this rank's tokens"): lambda: forward(x, top, w, gu, dn, shared,
                                                                                   max_tokens=2),
        ("megamoe_forward", "an input requiring grad"): lambda: forward(x.clone().requires_grad_(), top, w, gu, dn,
                                                                        shared),
        ("megamoe_forward", "num_experts the weights do not hold"): lambda: forward(x, top, w, gu, dn, shared,
                                                                                   num_experts=2),
        ("megamoe_forward", "a NaN in x with check_finite=True"): lambda: forward(
            x.index_fill(0, torch.tensor([1]), float("nan")), top, w, gu, dn, shared, check_finite=True),
        ("moe", "an FP8 precision with fused_backward=True"): lambda: layer(
            x, top, w, gu, dn, shared, precision="mxfp8", fused_backward=True),
        ("moe", "max_tokens not an int"): lambda: layer(x, top, w, gu, dn, shared, max_tokens=True),
        ("moe", "num_experts the weights do not hold"): lambda: layer(x, top, w, gu, dn, shared, num_experts=8),
        ("moe", "num_experts not a positive int"): lambda: layer(x, top, w, gu, dn, shared, num_experts=0),
        ("moe", "experts_q with bf16 experts"): lambda: layer(x, top, w, gu, dn, shared,
                                                              experts_q=quantize_experts(gu, dn, "mxfp8")),
        ("moe", "experts_q not a pack"): lambda: layer(x, top, w, gu, dn, shared, precision="mxfp8",
                                                       experts_q=quantize_experts(gu, dn, "mxfp8").tensors()),
        ("moe", "experts_q made from other weights (or before they changed)"): lambda: layer(
            x, top, w, gu.clone(), dn, shared, precision="mxfp8", experts_q=quantize_experts(gu, dn, "mxfp8")),
        ("MoE", "an unknown impl"): lambda: MoE(CFG, world, impl="deepspeed"),
        ("MoE", "config not a MoEConfig"): lambda: MoE(dict(hidden=128), world),
        ("Router", "top_k above num_experts"): lambda: Router(128, 4, 5),
        ("Router.forward", "x's D differs from the gate's"): lambda: Router(128, 4, 2)(x[:, :64]),
        ("MegaKernel", "a shape for another number of ranks"): lambda: MegaKernel(world, LayerShape.of(CFG, 2, N),
                                                                                  small),
        ("MegaKernel.forward", "k differs from the kernel's"): lambda: kernel.forward(x, top[:, :1], w[:, :1], gu,
                                                                                      dn, fused),
        ("MegaKernel.forward", "more tokens than its max_tokens"): lambda: kernel.forward(
            torch.cat([x, x]), torch.cat([top, top]), torch.cat([w, w]), gu, dn, fused),
        ("nccl_torch_moe", "x's dtype differs from the weights'"): lambda: nccl_torch_moe(world, x.float(), top, w,
                                                                                      gu, dn, shared),
        ("MegaKernel.backward", "d_out not of x's shape"): lambda: kernel.backward(
            None, x[:2], x, top, w, gu, dn, fused, SWIGLU),
        ("quantize_experts", "weights not bfloat16"): lambda: quantize_experts(gu.float(), dn, "fp8-block"),
        ("quantize_experts", "an unknown format"): lambda: quantize_experts(gu, dn, "int4"),
        ("adapters.hf.patch", "a model without a supported block"): lambda: hf.patch(torch.nn.Linear(4, 4), world),
        ("adapters.hf.patch", "an unknown impl"): lambda: hf.patch(torch.nn.Linear(4, 4), world, impl="deepspeed"),
        ("adapters.torchtitan.patch", "a model without a torchtitan MoE layer"): lambda: torchtitan.patch(
            torch.nn.Linear(4, 4), world),
        ("adapters.fsdp.mesh", "ep not dividing the world size"): lambda: fsdp.mesh(ep=3),
        ("adapters.fsdp.shard", "a model not patched"): lambda: fsdp.shard(torch.nn.Linear(4, 4), fsdp.mesh(ep=1)),
        ("training.TrainOptions", "steps below 1"): lambda: TrainOptions(steps=0),
    }
    cases.update(_layer_cases("megamoe_forward", forward))
    cases.update(_layer_cases("moe", layer))
    cases.update(_layer_cases("nccl_torch_moe", lambda *a, **kw: nccl_torch_moe(world, *a, **kw), bf16_only=False))
    cases.update(_layer_cases("reference moe_forward", moe_forward, bf16_only=False))
    return cases


def _raised(world) -> dict:
    out = {}
    for key, call in _cases(world).items():
        try:
            call()
            out[key] = None
        except Exception as exc:  # noqa: BLE001 - the table names the type
            out[key] = f"{type(exc).__name__}: {exc}"
    return out


def _launch_cases() -> dict:
    from megamoe import launch as face_launch

    out = {}
    for key, call in {("launch", "nprocs not positive"): lambda: launch(_raised, 0),
                      ("launch", "an unknown device"): lambda: face_launch(_raised, 1, device="tpu")}.items():
        try:
            call()
            out[key] = None
        except Exception as exc:  # noqa: BLE001
            out[key] = f"{type(exc).__name__}: {exc}"
    return out


def _table() -> dict:
    """(entry point, bad input) -> the error the doc names, from its tables' rows."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and not set(cells[0]) <= set("-: "):
            entry, bad, error = (re.sub(r"`", "", c) for c in cells)
            rows[(entry, bad)] = error
    return rows


def test_every_entry_point_names_each_bad_input_as_the_table_says():
    got = {**launch(_raised, 1)[0], **_launch_cases()}
    table = _table()
    assert sorted(set(table) - set(got)) == [], "rows without a case"
    assert sorted(set(got) - set(table)) == [], "cases without a row"
    wrong = {key: (table[key], message) for key, message in got.items()
             if message is None or not message.startswith(table[key])}
    assert not wrong, wrong


def test_the_run_time_table_names_tests_that_exist():
    root = DOC.parents[1]
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", DOC.read_text())
    assert len(named) >= 7, named
    for path, name in named:
        assert f"def {name}(" in (root / path).read_text(), (path, name)
