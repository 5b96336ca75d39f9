"""The row-tile kernels' task order in one run: groups inside each expert's run against groups over the whole
tile list (the order before 942fee1), interleaved at the power cap (issue 28; one GPU).

    PYTHONPATH=src python3 benchmarks/task_order_ab.py [--loads 192x341,192x341r,16x4096] [--rounds 3]
                                                       [--seconds 0.4] [--out DIR]
    PYTHONPATH=src python3 benchmarks/task_order_ab.py --check     # the CPU interpreter: outputs only

2026-12-03-task-order measured the order with the probe's own kernels; 2026-12-03-gemm-vs-dense measured the
kernels after the change against a run of 2026-12-01, where 16 x 4096's gate/up (whose groups never straddled
experts: 32 tiles per expert in groups of 4) moved 6.112 -> 6.206 ms across the runs. Here the same kernels run
in both orders in the same rounds: ``runs`` is today's ``RowTiles.tile_run``; ``one run`` gives every tile the
run ``[0, num_tiles)``, which is exactly the old order, so the difference is the order and the per-task load of
the run alone. Kernels: BF16 gate/up + SwiGLU, down and the backward (its dact and dx walk the order), FP8-block
gate/up and down; a load ``EXPERTSxROWS`` has equal experts, with ``r`` the same total routed at random. Every
output of ``one run`` is checked bitwise against ``runs``'. Writes DIR/task_order_ab.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from unittest import mock

import torch

import megamoe.ops.launch as launch
from megamoe.bench.experts import fp8_block_operands
from megamoe.config import preset
from megamoe.ops.experts import ExpertForward, ExpertForwardQuantized, down, gate_up
from megamoe.ops.experts_bwd import expert_backward
from megamoe.ops.experts_fp8 import down_fp8, gate_up_fp8
from megamoe.routing.row_tiles import build_row_tiles
from megamoe.runtime import interpreting


def one_run_tiles(*args, **kwargs):
    """``build_row_tiles`` with every tile in one run: groups over the whole tile list."""
    tiles = build_row_tiles(*args, **kwargs)
    n = tiles.tile_run.shape[0]
    run = torch.stack([torch.zeros_like(tiles.num_tiles).expand(n), tiles.num_tiles.expand(n)], 1).contiguous()
    return dataclasses.replace(tiles, tile_run=run)


def in_order(fn, order: str):
    if order == "runs":
        return fn

    def call():
        with mock.patch.object(launch, "build_row_tiles", one_run_tiles):
            return fn()
    return call


def make_load(spec: str, d: int, i: int, dev, seed: int = 0):
    experts, rows = (int(v) for v in spec.rstrip("r").split("x"))
    g = torch.Generator(device="cpu").manual_seed(seed)
    if spec.endswith("r"):
        counts = torch.bincount(torch.randint(0, experts, (rows * experts,), generator=g), minlength=experts)
    else:
        counts = torch.full((experts,), rows)
    offsets = counts.cumsum(0) - counts
    total = int(counts.sum())
    x = torch.randn(total, d, generator=g).bfloat16()
    wgu = (torch.randn(experts, 2 * i, d, generator=g) / d**0.5).bfloat16()
    wd = (torch.randn(experts, d, i, generator=g) / i**0.5).bfloat16()
    dy = torch.randn(total, d, generator=g).bfloat16()
    row_w = torch.rand(total, generator=g)
    return tuple(t.to(dev) for t in (counts.int(), offsets.int(), x, wgu, wd, dy, row_w))


def calls_of(load, dense: bool) -> tuple[dict, dict]:
    """{name: fn} of every kernel in both orders (and the dense peers), {name: outputs to compare}."""
    counts, offsets, x, wgu, wd, dy, row_w = load
    rows, d = x.shape
    i = wd.shape[2]
    dev = x.device

    def poisoned(*shape, dtype=torch.bfloat16):
        return torch.full(shape, float("nan"), dtype=dtype, device=dev)

    fwd = ExpertForward(poisoned(rows, 2 * i), poisoned(rows, i), poisoned(rows, d))
    gate_up(x, counts, offsets, wgu, fwd.h, fwd.act)
    ops = fp8_block_operands(x, counts, offsets, wgu, wd)
    x_q, x_s, wgu_q, wgu_s, wd_q, wd_s, q_in = ops.x_q, ops.x_s, ops.wgu_q, ops.wgu_s, ops.wd_q, ops.wd_s, ops.fwd
    calls, outputs = {}, {}
    for order in ("runs", "one run"):
        h, act, y, y8 = poisoned(rows, 2 * i), poisoned(rows, i), poisoned(rows, d), poisoned(rows, d)
        q = ExpertForwardQuantized(poisoned(rows, 2 * i), torch.empty_like(q_in.act_q),
                                   torch.empty_like(q_in.act_scale), poisoned(rows, d))
        grads = {}
        own = {
            "gate_up": (lambda h=h, act=act: gate_up(x, counts, offsets, wgu, h, act), (h, act)),
            "down": (lambda y=y: down(fwd.act, counts, offsets, wd, y), (y,)),
            "backward": (lambda grads=grads: grads.update(
                g=expert_backward(dy, row_w, x, fwd.h, counts, offsets, wgu, wd)), grads),
            "fp8 gate_up": (lambda q=q: gate_up_fp8(x_q, x_s, counts, offsets, wgu_q, wgu_s, q),
                            (q.h, q.act_q, q.act_scale)),
            "fp8 down": (lambda y8=y8: down_fp8(q_in.act_q, q_in.act_scale, counts, offsets, wd_q, wd_s, y8), (y8,)),
        }
        for kernel, (fn, out) in own.items():
            calls[f"{kernel} {order}"] = in_order(fn, order)
            outputs[f"{kernel} {order}"] = out
    if dense:
        w_gu, w_dn = wgu[0].T.contiguous(), wd[0].T.contiguous()
        calls["gate_up dense"] = lambda: torch.mm(x, w_gu)
        calls["down dense"] = lambda: torch.mm(fwd.act, w_dn)
    return calls, outputs


def same_bits(a, b) -> bool:
    if isinstance(a, dict):  # the backward's gradients
        a, b = a["g"], b["g"]
        a = (a.d_x, a.d_router, a.d_w_gate_up, a.d_w_down)
        b = (b.d_x, b.d_router, b.d_w_gate_up, b.d_w_down)
    return all(torch.equal(u.view(torch.uint8), v.view(torch.uint8)) for u, v in zip(a, b))


def check(calls: dict, outputs: dict) -> dict:
    for fn in calls.values():
        fn()
    if not interpreting():
        torch.cuda.synchronize()
    kernels = sorted({name.rsplit(" ", 1)[0] for name in outputs if name.endswith(" runs")})
    return {k: same_bits(outputs[f"{k} runs"], outputs[f"{k} one run"]) for k in kernels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--loads", default="192x341,192x341r,16x4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=0.4)
    parser.add_argument("--check", action="store_true", help="small shapes, outputs only (CPU interpreter)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    os.makedirs(a.out, exist_ok=True)  # before the run: its records go there
    if a.check:
        found = {}
        for spec in ("5x40", "5x40r", "2x130"):
            calls, outputs = calls_of(make_load(spec, 128, 128, torch.device("cpu"), seed=1), dense=False)
            found[spec] = check(calls, outputs)
        print(json.dumps(found, indent=1))
        if not all(all(v.values()) for v in found.values()):
            raise SystemExit("the two orders' outputs differ")
        return
    from sustained import interleaved_rounds  # benchmarks/, beside this script

    cfg = preset(a.preset)
    dev = torch.device("cuda")
    out = {"args": vars(a), "loads": []}
    lines = []
    for spec in a.loads.split(","):
        load = make_load(spec, cfg.hidden, cfg.intermediate, dev)
        calls, outputs = calls_of(load, dense=True)
        bits = check(calls, outputs)
        times = interleaved_rounds(calls, a.rounds, a.seconds)
        ms = {name: statistics.median(ts) for name, ts in times.items()}
        out["loads"].append({"load": spec, "bits_equal": bits, "ms": ms, "ms_rounds": times})
        for kernel in bits:
            new, old = ms[f"{kernel} runs"], ms[f"{kernel} one run"]
            dense = ms.get(f"{kernel} dense")
            share = f"{100 * dense / new:.0f} % / {100 * dense / old:.0f} %" if dense else ""
            lines.append(f"| {spec} | {kernel} | {new:.3f} | {old:.3f} | {100 * (new / old - 1):+.1f} % | {share} "
                         f"| {bits[kernel]} |")
        del load, calls, outputs
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "task_order_ab.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"{a.preset}; {a.rounds} interleaved rounds of {a.seconds} s; ms per call")
    print("| load | kernel | runs (today) | one run (before 942fee1) | change | % of dense (runs / one run) "
          "| bits equal |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
