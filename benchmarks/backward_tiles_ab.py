"""The BF16 expert backward's tiles A against B at the power cap, beside cuBLAS, and where a call's time goes.

    PYTHONPATH=src python3 benchmarks/backward_tiles_ab.py --preset kimi-k2 --experts 192 [--rounds 5]
        [--seconds 0.5] [--variants plan,dact-256x3,...] [--out DIR]

Every variant runs `megamoe.ops.experts_bwd.expert_backward` with the planner's tiles but for the kinds it names;
all of them and the dense peer (the backward's four GEMMs as cuBLAS `torch.mm` with M = all rows) run in
interleaved rounds (`sustained.interleaved_rounds`). Each variant's gradients are compared with the plan's:
bitwise, and as the largest relative difference. Then one steady-state call of the plan is profiled: its
kernels' device time against the call's span on the GPU, and the idle gaps between kernels (host or
allocator time). Writes DIR/backward_tiles_ab.json; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from megamoe.bench.experts import backward_load
from megamoe.config import preset
from megamoe.ops.experts_bwd import expert_backward
from megamoe.ops.tiles import TileConfig

from sustained import interleaved_rounds, run_for  # benchmarks/, beside this script

#: name -> {kind: TileConfig}; the plan's tiles for every kind a variant does not name.
VARIANTS = {
    "plan": {},
    "dact-256x3": {"dact": TileConfig(128, 256, 64, num_warps=8, num_stages=3)},
    "dact-256x4": {"dact": TileConfig(128, 256, 64, num_warps=8, num_stages=4)},
    "dact-128x5": {"dact": TileConfig(128, 128, 64, num_warps=8, num_stages=5)},
    "dact-128x4-flat": {"dact": TileConfig(128, 128, 64, num_warps=8, num_stages=4, flatten=True)},
    "dx-256x4": {"dx": TileConfig(128, 256, 64, num_warps=8, num_stages=4)},
    "dx-256x3-flat": {"dx": TileConfig(128, 256, 64, num_warps=8, num_stages=3, flatten=True)},
    "wgrad-256x32x4": {"wgrad": TileConfig(128, 256, 32, num_warps=8, num_stages=4, flatten=True)},
    "wgrad-256x32x6": {"wgrad": TileConfig(128, 256, 32, num_warps=8, num_stages=6, flatten=True)},
    "wgrad-256x32x4+dx-flat": {"wgrad": TileConfig(128, 256, 32, num_warps=8, num_stages=4, flatten=True),
                               "dx": TileConfig(128, 256, 64, num_warps=8, num_stages=3, flatten=True)},
    # 64-row tiles (one warpgroup), as the forward takes for experts of few rows (ops.tiles.FEW_ROWS_PER_EXPERT)
    "dact-64x128x4": {"dact": TileConfig(64, 128, 64, num_warps=4, num_stages=4)},
    "dx-64x256x4-flat": {"dx": TileConfig(64, 256, 64, num_warps=4, num_stages=4, flatten=True)},
    "dact-64+dx-64": {"dact": TileConfig(64, 128, 64, num_warps=4, num_stages=4),
                      "dx": TileConfig(64, 256, 64, num_warps=4, num_stages=4, flatten=True)},
    "wgrad-256x64x3": {"wgrad": TileConfig(128, 256, 64, num_warps=8, num_stages=3, flatten=True)},
    "dx-64+wgrad-256x64x3": {"dx": TileConfig(64, 256, 64, num_warps=4, num_stages=4, flatten=True),
                             "wgrad": TileConfig(128, 256, 64, num_warps=8, num_stages=3, flatten=True)},
}


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, a slice of rows at a time (the weight gradients are GBs)."""
    diff = scale = 0.0
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])  # [L, M, N] weight gradients: by rows
    for a_part, b_part in zip(a.split(4096), b.split(4096)):
        diff = max(diff, float((a_part.float() - b_part.float()).abs().max()))
        scale = max(scale, float(b_part.float().abs().max()))
    return diff / max(scale, 1e-30)


def gaps(fn, out_dir: str) -> dict:
    """One steady-state call's kernels on the GPU timeline (torch profiler): device busy ms, span ms, gaps."""
    run_for(fn, 1.0, 2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    path = os.path.join(out_dir or tempfile.gettempdir(), "backward_call_trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        return {}
    busy = sum(e["dur"] for e in kernels) / 1e3
    span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) / 1e3
    idle = []
    for before, after in zip(kernels, kernels[1:]):
        gap = after["ts"] - (before["ts"] + before["dur"])
        if gap > 20:
            idle.append({"us": gap, "after": before["name"][:60], "before": after["name"][:60]})
    return {"kernels": [(e["name"][:60], e["dur"] / 1e3) for e in kernels], "busy_ms": busy, "span_ms": span,
            "gaps_over_20us": idle}


def steady_call_ms(fn, calls: int = 12) -> dict:
    """Back-to-back calls at the cap: median GPU ms from an event before to an event after each call, and the
    wall ms per call (their difference is host or allocator time the GPU waits on between calls)."""
    run_for(fn, 1.0, 2)
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    torch.cuda.synchronize()
    start = time.time()
    for before, after in marks:
        before.record()
        fn()
        after.record()
    torch.cuda.synchronize()
    wall = 1e3 * (time.time() - start) / calls
    return {"event_ms": statistics.median(b.elapsed_time(a) for b, a in marks), "wall_ms": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=os.environ.get("OUT", ""))
    a = parser.parse_args()
    os.makedirs(a.out, exist_ok=True)  # before the run: its records go there
    cfg = preset(a.preset)
    dev = torch.device("cuda")
    d, i = cfg.hidden, cfg.intermediate
    load = backward_load(cfg, a.experts, a.tokens, dev)
    dy, x, wgu, wd, rows = load.dy, load.x, load.w_gate_up, load.w_down, load.x.shape[0]
    g = torch.Generator(device=dev).manual_seed(8)
    d_h = torch.randn(rows, 2 * i, generator=g, device=dev).bfloat16()  # the dense peer's dgrad operand
    c_dact, c_dx = torch.empty(rows, i, dtype=torch.bfloat16, device=dev), torch.empty_like(x)
    c_wd, c_wgu = torch.empty(d, i, dtype=torch.bfloat16, device=dev), torch.empty(2 * i, d, dtype=torch.bfloat16,
                                                                                   device=dev)

    def dense():
        torch.mm(dy, wd[0], out=c_dact)
        torch.mm(d_h, wgu[0], out=c_dx)
        torch.mm(dy.T, load.act, out=c_wd)
        torch.mm(d_h.T, x, out=c_wgu)

    calls, status = {"dense (cuBLAS)": dense}, {}
    ref = None
    for name in a.variants.split(","):
        tiles = VARIANTS[name]
        call = (lambda tiles=tiles: expert_backward(*load.args, tiles=tiles))
        try:
            grads = call()
            torch.cuda.synchronize()
        except Exception as e:  # a variant that does not compile (shared memory, registers) is reported
            status[name] = f"failed: {type(e).__name__}: {str(e)[:120]}"
            continue
        got = {k: getattr(grads, k) for k in ("d_x", "d_router", "d_w_gate_up", "d_w_down")}
        if ref is None:
            ref = got
        same = all(torch.equal(got[k], ref[k]) for k in got)
        worst = max(rel_diff(got[k], ref[k]) for k in got)
        status[name] = f"same bits: {same}, max rel diff {worst:.1e}"
        del grads, got
        calls[name] = call
    times = interleaved_rounds(calls, a.rounds, a.seconds)
    timeline = gaps(calls["plan"], a.out) if "plan" in calls else {}
    if timeline:
        timeline["steady"] = steady_call_ms(calls["plan"])
    flops = 12 * rows * d * i
    dense_ms = statistics.median(times["dense (cuBLAS)"])
    lines = [f"{a.preset}, {a.experts} experts x ~{rows // a.experts} rows, {a.rounds} rounds of {a.seconds} s",
             "| variant | ms (median) | min-max | TFLOP/s | % of dense | gradients vs plan |", "|---|---|---|---|---|---|"]
    for name, ts in times.items():
        med = statistics.median(ts)
        lines.append(f"| {name} | {med:.3f} | {min(ts):.3f}-{max(ts):.3f} | {flops / med / 1e9:.0f} | "
                     f"{100 * dense_ms / med:.0f} % | {status.get(name, '')} |")
    for name, s in status.items():
        if name not in calls:
            lines.append(f"| {name} | — | | | | {s} |")
    if timeline:
        lines.append(f"plan, one steady call: kernels busy {timeline['busy_ms']:.2f} ms of a "
                     f"{timeline['span_ms']:.2f} ms span; gaps > 20 us: {len(timeline['gaps_over_20us'])}, "
                     f"{sum(g['us'] for g in timeline['gaps_over_20us']) / 1e3:.2f} ms")
        lines.append(f"plan, 12 back-to-back calls: {timeline['steady']['event_ms']:.2f} ms per call between "
                     f"events, {timeline['steady']['wall_ms']:.2f} ms of wall clock")
        for name, ms in timeline["kernels"]:
            lines.append(f"  {ms:8.3f} ms  {name}")
    if a.out:
        with open(os.path.join(a.out, "backward_tiles_ab.json"), "w") as f:
            json.dump({"preset": a.preset, "tokens": a.tokens, "experts": a.experts, "rounds": a.rounds,
                       "seconds": a.seconds, "times_ms": times, "status": status, "timeline": timeline,
                       "variants": {n: {k: vars(c) for k, c in VARIANTS[n].items()} for n in a.variants.split(",")}},
                      f, indent=1, default=str)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
