"""Where the grouped forward tiles lose to cuBLAS on few rows per expert: rows per expert swept (one GPU).

    PYTHONPATH=src python3 benchmarks/padding_probe.py [--preset kimi-k2] [--rows 320,341,384,448,512]
                                                       [--rounds 4] [--seconds 0.4] [--groups 3,16] [--out DIR]

On kimi-k2's 341-row experts our gate/up and down reach 85-87 % of cuBLAS's batched GEMM on equal groups and
78-79 % of its dense rate (benchmarks/results/2026-12-02-backward-few-rows). 341 = 2 x 128 + 85: 11 % of the
rows a 128-row tile computes are padding. This sweeps the rows per expert (about 65,536 rows in all) around
that, with every call in interleaved rounds at the power cap (``--profile``: each call once, for ncu):

- ours (``experts.gate_up`` / ``down``, the planner's tiles, and 64-row tiles),
- ``torch.bmm`` on equal groups (cuBLAS; its kernel names, which carry its tile shape, from the profiler),
- the dense GEMM of all rows (the yardstick),
- with ``--groups``, the planner's tiles with other task-group sizes (GROUP_M).

TFLOP/s count the real rows only, so a tile that computes padding shows it. If ours is close to bmm at 384 and
512 rows (no partial tiles) and falls away only where the last tile is partial, the gap is the tail; if cuBLAS
holds its rate at 341, its kernel names say how it tiles the tail. Writes DIR/padding_probe.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics

import torch

from megamoe.bench.experts import kernel_times
from megamoe.config import preset
from megamoe.ops.experts import down, gate_up
from megamoe.ops.tiles import TileConfig, plan_tiles

from sustained import interleaved_rounds  # benchmarks/, beside this script

TILES_64 = {"gate_up": TileConfig(64, 128, 64, num_warps=4, num_stages=4, group_m=8),
            "down": TileConfig(64, 256, 64, num_warps=4, num_stages=4, group_m=8, flatten=True)}


def load_calls(m: int, total: int, d: int, i: int, dev, groups: tuple[int, ...] = ()) -> tuple[dict, dict, int]:
    """{name: fn} and {name: FLOPs} of equal groups of ``m`` rows (about ``total`` rows in all)."""
    experts = max(1, round(total / m))
    rows = experts * m
    g = torch.Generator(device=dev).manual_seed(m)
    x = torch.randn(rows, d, generator=g, device=dev).bfloat16()
    wgu = (torch.randn(experts, 2 * i, d, generator=g, device=dev) / d**0.5).bfloat16()
    wd = (torch.randn(experts, d, i, generator=g, device=dev) / i**0.5).bfloat16()
    counts = torch.full((experts,), m, dtype=torch.int32, device=dev)
    offsets = (counts.cumsum(0) - counts).to(torch.int32)
    h = torch.empty(rows, 2 * i, dtype=torch.bfloat16, device=dev)
    act = torch.randn(rows, i, generator=g, device=dev).bfloat16()
    y = torch.empty(rows, d, dtype=torch.bfloat16, device=dev)
    act_scratch = torch.empty_like(act)
    xb, actb = x.view(experts, m, d), act.view(experts, m, i)
    w_gu, w_dn = wgu[0].T.contiguous(), wd[0].T.contiguous()
    calls = {
        "gate_up": lambda: gate_up(x, counts, offsets, wgu, h, act_scratch),
        "gate_up 64-row": lambda: gate_up(x, counts, offsets, wgu, h, act_scratch, tiles=TILES_64["gate_up"]),
        "gate_up bmm": lambda: torch.bmm(xb, wgu.transpose(1, 2)),
        "gate_up dense": lambda: torch.mm(x, w_gu),
        "down": lambda: down(act, counts, offsets, wd, y),
        "down 64-row": lambda: down(act, counts, offsets, wd, y, tiles=TILES_64["down"]),
        "down bmm": lambda: torch.bmm(actb, wd.transpose(1, 2)),
        "down dense": lambda: torch.mm(act, w_dn),
    }
    for g_m in groups:  # the planner's tiles with groups of g_m row tiles (the task order)
        gu, dn = (dataclasses.replace(plan_tiles(k, dev), group_m=g_m) for k in ("gate_up", "down"))
        calls[f"gate_up group {g_m}"] = lambda gu=gu: gate_up(x, counts, offsets, wgu, h, act_scratch, tiles=gu)
        calls[f"down group {g_m}"] = lambda dn=dn: down(act, counts, offsets, wd, y, tiles=dn)
    fwd = 2 * rows * d * i
    flops = {name: (2 * fwd if name.startswith("gate_up") else fwd) for name in calls}
    return calls, flops, experts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--rows", default="320,341,384,448,512")
    parser.add_argument("--total", type=int, default=65536)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=0.4)
    parser.add_argument("--groups", default="", help="also the planner's tiles with these group_m values (1,3,...)")
    parser.add_argument("--profile", action="store_true",
                        help="no timing: each call once between cudaProfilerStart and Stop (for `ncu "
                             "--profile-from-start off`), after a warm-up call")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    os.makedirs(a.out, exist_ok=True)  # before the run: its records go there
    cfg = preset(a.preset)
    dev = torch.device("cuda")
    groups = tuple(int(v) for v in a.groups.split(",") if v)
    if a.profile:
        for m in (int(v) for v in a.rows.split(",")):
            calls, _, _ = load_calls(m, a.total, cfg.hidden, cfg.intermediate, dev, groups)
            for fn in calls.values():
                fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            for fn in calls.values():
                fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        return
    records, lines = [], []
    for m in (int(v) for v in a.rows.split(",")):
        calls, flops, experts = load_calls(m, a.total, cfg.hidden, cfg.intermediate, dev, groups)
        times = interleaved_rounds(calls, a.rounds, a.seconds)
        names = {kind: list(kernel_times(calls[f"{kind} bmm"], iters=1)) for kind in ("gate_up", "down")}
        by = {}
        for name, ts in times.items():
            ms = statistics.median(ts)
            by[name] = {"rows": m, "experts": experts, "call": name, "ms": ms, "ms_rounds": ts,
                        "tflops": flops[name] / ms / 1e9}
            records.append(by[name])
        for kind in ("gate_up", "down"):
            records.append({"rows": m, "call": f"{kind} bmm kernels", "kernels": names[kind]})
            dense = by[f"{kind} dense"]["tflops"]
            row = [f"{by[n]['tflops']:.0f} ({100 * by[n]['tflops'] / dense:.0f} %)"
                   for n in (kind, f"{kind} 64-row", f"{kind} bmm")]
            lines.append(f"| {m} x {experts} | {kind} | " + " | ".join(row) + f" | {dense:.0f} | "
                         f"{names[kind][0][:90] if names[kind] else ''} |")
        for g_m in groups:
            lines.append(f"| {m} x {experts} | group_m {g_m} | " + " | ".join(
                f"{kind} {by[f'{kind} group {g_m}']['tflops']:.0f} "
                f"({100 * by[f'{kind} group {g_m}']['tflops'] / by[f'{kind} dense']['tflops']:.0f} %)"
                for kind in ("gate_up", "down")) + " | | | |")
        del calls
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "padding_probe.json"), "w") as f:
        json.dump({"preset": a.preset, "rounds": a.rounds, "seconds": a.seconds, "records": records}, f, indent=1)
    print(f"{a.preset}, {a.rounds} interleaved rounds of {a.seconds} s per call; TFLOP/s on real rows "
          "(% of the dense GEMM of all rows)")
    print("| rows x experts | kernel | ours (plan) | ours 64-row | cuBLAS bmm | dense | bmm's kernel |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
