"""Phases to sample the GPUs' clocks and power against: megakernel passes, then the standalone expert kernels.

    PYTHONPATH=src python3 benchmarks/clock_probe.py --preset kimi-k2 --tokens 8192 [--seconds 2] > phases.json
    (with `nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw --format=csv -lms 10` running beside it;
    benchmarks/clock_probe_summary.py joins the two)

One process per GPU. Each rank runs megakernel passes (bf16; each of --configs) back to back for --seconds,
idling 0.5 s after each, then the standalone expert kernels (`megamoe.ops.experts.expert_forward`, every SM) on
the same routed rows for --seconds. Prints one JSON line per rank: each phase's wall-clock start and end and its ms per pass.
The question (benchmarks/results/2026-11-30-one-rank, section 8): do the GEMMs inside the megakernel lose ~12 %
to the communication beside them through the SM clock (power) rather than memory?
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime

import torch

from megamoe.bench.problem import make_problem
from megamoe.config import preset
from megamoe.megakernel import MegaKernel, fuse_shared
from megamoe.ops.experts import expert_forward
from megamoe.parallel.world import launch
from megamoe.planner import KernelConfig, LayerShape

from sustained import run_for  # benchmarks/, beside this script


def _phase(world, name: str, seconds: float, fn) -> dict:
    torch.cuda.synchronize()
    world.barrier()
    start, end, passes = run_for(fn, seconds, group=5)
    # local time, as nvidia-smi stamps its samples
    local = [datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f") for t in (start, end)]
    return {"phase": name, "start": local[0], "end": local[1], "ms_per_pass": 1e3 * (end - start) / passes}


def _probe(world, a):
    cfg = preset(a.preset)
    p = make_problem(cfg, world.rank, world.size, a.tokens, dtype=torch.bfloat16, device=world.device)
    fused = fuse_shared(p.shared)
    shape = LayerShape.of(cfg, world.size, a.tokens)
    args = (p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, fused, cfg.activation)
    phases = []
    for config in a.configs:
        knobs = None if config == "plan" else KernelConfig(*map(int, config.split(",")), 128, 256)
        kernel = MegaKernel(world, shape, knobs, one_rank_megakernel=True)
        buffers = kernel.scratch_buffers()  # one set for every pass, as megamoe_forward runs them
        _, ctx = kernel.forward(*args, buffers=buffers)
        phases.append(_phase(world, f"megakernel {kernel.config.comm_sms} comm SMs, minibatch "
                             f"{kernel.config.minibatch}", a.seconds,
                             lambda: kernel.forward(*args, buffers=buffers, check=False)))
        kernel.check_errors()
        time.sleep(0.5)
    s = ctx.schedule  # the last config's: its ring holds the routed rows of the last pass
    rows = (ctx.buffers.ring_x, s.tokens_per_expert, s.offsets, p.w_gate_up, p.w_down)
    expert_forward(*rows)
    phases.append(_phase(world, "standalone experts", a.seconds, lambda: expert_forward(*rows)))
    return {"rank": world.rank, "device": torch.cuda.current_device(), "phases": phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--configs", type=lambda v: v.split(";"), default=["plan"],
                        help="megakernel phases, ';'-separated: 'plan' (the planner's config) or num_sms,comm_sms,"
                             "minibatch,ring_rows; the last one's ring must hold every routed row (the standalone "
                             "kernels read it)")
    a = parser.parse_args()
    for r in launch(_probe, torch.cuda.device_count(), a, device="cuda"):
        print(json.dumps(r))


if __name__ == "__main__":
    main()
