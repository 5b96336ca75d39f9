"""Where a megamoe forward pass spends its GPU time: the kernels of one pass, on a timeline, eager and graphed.

    PYTHONPATH=src python3 benchmarks/megakernel_profile.py --preset kimi-k2 --tokens 8192 [--precision fp8-block] [--out DIR]

One process per GPU. Passes run as `megamoe bench` runs them (max_tokens given, no host checks; FP8 weights
quantised once before), eager and replayed from a CUDA graph, under torch.profiler. For the last pass of each
mode every rank reports each kernel's start (µs after the pass's first kernel starts) and duration, the pass's
span (first kernel start to last kernel end; the tool's barrier between passes, an NCCL all-reduce, is listed
before it and not counted) and the host time of the eager call. Rank 0 prints them; DIR/
profile.json holds every rank's timelines, DIR/profile.txt the printed tables.
"""

from __future__ import annotations

import json
import os
import time

import torch

from megamoe.bench.problem import make_problem
from megamoe.config import preset
from megamoe.planner import LayerShape
from megamoe.megakernel import megamoe_forward
from megamoe.ops.expert_weights import quantize_experts
from megamoe.parallel.world import launch

import megakernel_args  # benchmarks/, beside this script


def _timeline(prof, passes: int) -> dict:
    """The last pass's kernels (a pass = the kernels from a megakernel's predecessors to the next pass). The
    span runs from the first kernel after this tool's barrier between passes (an NCCL all-reduce, listed with
    negative starts) to the last kernel's end."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    per_pass = len(kernels) // passes
    last = kernels[-per_pass:]
    barrier = max((i for i, e in enumerate(last) if "nccl" in e.name.lower()), default=-1)
    own = last[barrier + 1:]
    t0 = own[0].time_range.start
    rows = [{"kernel": e.name[:60], "start_us": e.time_range.start - t0, "us": e.time_range.end - e.time_range.start}
            for e in last]
    return {"kernels": rows, "span_us": max(e.time_range.end for e in own) - t0, "kernels_per_pass": len(own)}


def _profile(world, a):
    cfg = preset(a.preset)
    p = make_problem(cfg, world.rank, world.size, a.tokens, dtype=torch.bfloat16, device=world.device)
    args = (world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared, cfg.activation)
    experts_q = None if a.precision == "bf16" else quantize_experts(p.w_gate_up, p.w_down, a.precision)
    config = megakernel_args.config_for(a, world, LayerShape.of(cfg, world.size, a.tokens))
    options = dict(config=config, precision=a.precision, max_tokens=a.tokens, experts_q=experts_q)
    megamoe_forward(*args, **options)  # compiles; checks the error word
    options["check"] = False
    host_ms = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(a.passes):
            world.barrier()
            torch.cuda.synchronize()
            t = time.perf_counter()
            megamoe_forward(*args, **options)
            host_ms.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    eager = _timeline(prof, a.passes)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        megamoe_forward(*args, **options)
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(a.passes):
            world.barrier()
            torch.cuda.synchronize()
            graph.replay()
        torch.cuda.synchronize()
    return {"rank": world.rank, "config": str(config), "host_ms_eager_call": sorted(host_ms)[len(host_ms) // 2],
            "eager": eager, "graph": _timeline(prof, a.passes)}


def _table(r: dict) -> str:
    lines = [f"rank {r['rank']} · {r['config']} · eager call {r['host_ms_eager_call']:.2f} ms on the host"]
    for mode in ("eager", "graph"):
        t = r[mode]
        lines.append(f"  {mode}: pass span {t['span_us'] / 1e3:.3f} ms, {t['kernels_per_pass']} kernels")
        lines += [f"    {k['start_us']:9.1f} +{k['us']:9.1f} us  {k['kernel']}" for k in t["kernels"]]
    return "\n".join(lines)


def main() -> None:
    a = megakernel_args.parse(__doc__)
    results = launch(_profile, torch.cuda.device_count(), a, device="cuda")
    text = "\n".join(_table(r) for r in results)
    print(text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "profile.txt"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(a.out, "profile.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
