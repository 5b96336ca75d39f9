"""The pull-schedule kernels (route_histogram, place_routes) across their blocking knobs, on one GPU.

    PYTHONPATH=src python3 benchmarks/schedule_bench.py [--out FILE.json]

Rank 0's schedule at EP 2 (8192 tokens per rank, uniform routing to k distinct experts, seed 0) of kimi-k2,
qwen3.5-397b and deepseek-v4-pro, with own_rows as the megakernel asks for them. A variant is a
`megamoe.routing.schedule.ScheduleBlocking` passed to the builder; the first is the default, and every other
variant's tensors must equal its bit for bit. Times: the whole builder replayed from a CUDA graph
(median of 20 x 50 replays, µs per build), and each kernel's mean from the profiler over 20 eager builds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import megamoe.routing.schedule as sched
from megamoe.config import preset

PRESETS = ("kimi-k2", "qwen3.5-397b", "deepseek-v4-pro")
VARIANTS = [sched.ScheduleBlocking()] + [sched.ScheduleBlocking(*v) for v in (
    (1024, 128, 16, 4), (1024, 64, 16, 4), (512, 32, 16, 4), (256, 32, 16, 4), (512, 64, 8, 4), (512, 64, 16, 8))]
FIELDS = ("tokens_per_expert", "counts", "offsets", "src_rank", "src_index", "num_rows", "own_rows")


def build(top, L, within, blocking):
    return sched.build_pull_schedule(top, 0, L, own_rows_within=within, blocking=blocking)


def graph_us(top, L, within, blocking) -> float:
    build(top, L, within, blocking)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        build(top, L, within, blocking)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / 50)
    return statistics.median(times)


def kernel_us(top, L, within, blocking) -> dict[str, float]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            build(top, L, within, blocking)
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / e.count for e in prof.key_averages() if e.key.endswith("routes_kernel")
            or e.key == "route_histogram_kernel"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for name in PRESETS:
        cfg = preset(name)
        R, N, L = 2, 8192, cfg.num_experts // 2
        top = torch.rand(R, N, cfg.num_experts, device="cuda", generator=gen).topk(cfg.top_k).indices.int()
        within = R * N * cfg.top_k  # the ring of a balanced pass holds every row
        first = None
        for blocking in VARIANTS:
            got = build(top, L, within, blocking)
            same = first is None or all(torch.equal(getattr(got, f), getattr(first, f)) for f in FIELDS)
            first = first or got
            row = {"preset": name, **dataclasses.asdict(blocking), "same_bits": same,
                   "build_us": graph_us(top, L, within, blocking), **kernel_us(top, L, within, blocking)}
            results.append(row)
            print(row, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "commit": os.environ.get("MEGAMOE_COMMIT"),
                       "results": results}, f, indent=1)
    print("\npreset            block sub prefix warps  build_us  same")
    for r in results:
        print(f"{r['preset']:17s} {r['route_block']:5d} {r['sub_block']:3d} {r['prefix_blocks']:6d} "
              f"{r['num_warps']:5d} {r['build_us']:9.1f}  {r['same_bits']}")


if __name__ == "__main__":
    main()
