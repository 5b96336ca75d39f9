"""Where each implementation's backward pass goes on the GPU: milliseconds per kernel name, side by side.

    PYTHONPATH=src python3 benchmarks/backward_kernels.py [--preset kimi-k2] [--tokens 8192] [--ranks 1]
        [--impl nccl-torch,megamoe] [--warmup 3] [--out DIR]

`megamoe bench`'s problem (seed 0, uniform routing) and runners: each implementation runs --warmup steps, then
one forward untimed and its backward under torch.profiler (CUDA activity only). Rank 0 prints, per
implementation, the backward's wall time between CUDA events, its kernels' busy time and the largest kernels;
writes DIR/backward_kernels.json. Also prints the pull schedule's rows per local expert (the grouped GEMMs' M).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

import torch

from megamoe.bench.problem import make_problem
from megamoe.bench.runners import RUNNERS
from megamoe.config import preset
from megamoe.parallel.world import launch


def run_rank(world, opts: dict) -> dict:
    cfg = preset(opts["preset"])
    p = make_problem(cfg, world.rank, world.size, opts["tokens"], dtype=torch.bfloat16, device=world.device, seed=0)
    per_expert = torch.bincount(p.top_experts[p.top_experts >= 0].flatten(), minlength=cfg.num_experts)
    out = {"rows_per_expert": {"min": int(per_expert.min()), "median": float(per_expert.float().median()),
                               "max": int(per_expert.max()), "experts": cfg.num_experts}}
    for impl in opts["impl"]:
        runner = RUNNERS[impl](world, p)
        for _ in range(opts["warmup"]):
            runner.step()
        y = runner.train_forward()
        torch.cuda.synchronize()
        world.barrier("profile")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            start.record()
            runner.backward(y)
            end.record()
            torch.cuda.synchronize()
        kernels, launches = defaultdict(float), defaultdict(int)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name[:90]] += e.device_time / 1e3
                launches[e.name[:90]] += 1
        top = sorted(kernels.items(), key=lambda kv: -kv[1])
        out[impl] = {"ms": start.elapsed_time(end), "busy_ms": sum(kernels.values()),
                     "kernels": [{"name": n, "ms": ms, "launches": launches[n]} for n, ms in top]}
        del runner, y
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--impl", default="nccl-torch,megamoe")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    opts = dict(preset=a.preset, tokens=a.tokens, impl=a.impl.split(","), warmup=a.warmup)
    r = launch(run_rank, a.ranks, opts, device="cuda")[0]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "backward_kernels.json"), "w") as f:
        json.dump({"args": vars(a), "rank0": r}, f, indent=1)
    print(f"{a.preset}, {a.tokens} tokens/rank, {a.ranks} rank(s); routed rows per expert: {r['rows_per_expert']}")
    for impl in opts["impl"]:
        x = r[impl]
        print(f"{impl}: backward {x['ms']:.2f} ms between events, kernels busy {x['busy_ms']:.2f} ms")
        for k in x["kernels"][: a.top]:
            print(f"  {k['ms']:8.3f} ms  x{k['launches']:<4} {k['name']}")


if __name__ == "__main__":
    main()
