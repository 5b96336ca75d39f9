"""Where one backward megakernel pass spends its time, beside the composed path's kernels (one GPU, one rank).

    PYTHONPATH=src python3 benchmarks/backward_trace.py --preset kimi-k2 --tokens 8192 [--out trace.json]

One rank runs the backward megakernel (``one_rank_megakernel``: comm workers copy local rows) in a TRACE build
after warm-up passes: per program its start and end, the time spent in bounded waits and how many, the end of its
shared-expert tasks (globaltimer stamps, ns). Then the composed path under torch.profiler: milliseconds per kernel
name in one pass. Prints both; writes --out JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections import defaultdict

import torch

from megamoe.bench.problem import make_problem
from megamoe.config import preset
from megamoe.kernels import sync
from megamoe.megakernel import MegaKernel, fuse_shared
from megamoe.megakernel.saved import SavedForward
from megamoe.parallel.world import launch
from megamoe.planner import LayerShape, plan


def run_rank(world, opts: dict):
    cfg = preset(opts["preset"])
    tokens = opts["tokens"]
    p = make_problem(cfg, world.rank, world.size, tokens, dtype=torch.bfloat16, device=world.device, seed=0)
    shared = fuse_shared(p.shared)
    config = plan(cfg, world.size, tokens).config
    kernel = MegaKernel(world, LayerShape.of(cfg, world.size, tokens), config, trace=True, one_rank_megakernel=True)
    with torch.no_grad():
        _, ctx = kernel.forward(p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, shared, cfg.activation)
    saved = SavedForward(ctx.buffers.h, ctx.buffers.shared_h, ctx.schedule)
    d_out = torch.randn(p.x.shape, generator=torch.Generator().manual_seed(100)).to(p.x)

    def backward(fused):
        return kernel.backward(saved, d_out, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, shared,
                               cfg.activation, check=False, fused=fused)

    for _ in range(opts["warmup"]):
        backward(True)
    kernel.trace.zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    backward(True)
    end.record()
    end.synchronize()
    kernel.check_errors()
    t = kernel.trace.cpu()
    t0 = int(t[:, sync.TRACE_START.value].min())
    programs = []
    for pid in range(config.num_sms):
        row = t[pid].tolist()
        programs.append(dict(role="comm" if pid < config.bwd_comm_sms else "compute",
                             start_us=(row[sync.TRACE_START.value] - t0) / 1e3,
                             end_us=(row[sync.TRACE_END.value] - t0) / 1e3,
                             wait_us=row[sync.TRACE_WAIT_NS.value] / 1e3, waits=row[sync.TRACE_WAITS.value],
                             shared_end_us=(row[sync.TRACE_SHARED_END.value] - t0) / 1e3 if row[
                                 sync.TRACE_SHARED_END.value] else None))
    for _ in range(2):
        backward(False)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        backward(False)
        torch.cuda.synchronize()
    kernels = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:80]] += e.device_time / 1e3
    return dict(config=str(config), fused_ms=start.elapsed_time(end), programs=programs,
                composed_kernels_ms=dict(sorted(kernels.items(), key=lambda kv: -kv[1])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    r = launch(run_rank, 1, dict(vars(args)), device="cuda")[0]
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)
    print(f"{args.preset}, {args.tokens} tokens, one rank: {r['config']}; fused pass {r['fused_ms']:.2f} ms")
    for role in ("comm", "compute"):
        rows = [x for x in r["programs"] if x["role"] == role]
        ends, waits = [x["end_us"] for x in rows], [x["wait_us"] for x in rows]
        print(f"  {role:8} programs {len(rows):3}: end median {statistics.median(ends):9.0f} us, min {min(ends):9.0f}, "
              f"max {max(ends):9.0f}; waiting median {statistics.median(waits):9.0f} us, max {max(waits):9.0f}; "
              f"waits median {statistics.median(x['waits'] for x in rows):.0f}")
    shared = [x["shared_end_us"] for x in r["programs"] if x["shared_end_us"]]
    if shared:
        print(f"  shared-expert tasks end: median {statistics.median(shared):.0f} us, max {max(shared):.0f}")
    print("composed path, one pass, ms per kernel:")
    for name, ms in list(r["composed_kernels_ms"].items())[:14]:
        print(f"  {ms:8.2f}  {name}")
    print(f"  {sum(r['composed_kernels_ms'].values()):8.2f}  total")


if __name__ == "__main__":
    main()
