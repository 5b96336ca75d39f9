"""Host time of an eager megakernel pass, by stage (the GPU runs behind: nothing here syncs).

    PYTHONPATH=src python3 benchmarks/megakernel_host.py --preset kimi-k2 --tokens 8192 [--precision fp8-block]

One process per GPU; rank 0 prints the mean host microseconds per pass of each stage of
`MegaKernel.forward` (wrapped with perf_counter) and of the whole call, then the functions that take the
host's time (cProfile of the same passes, by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from collections import defaultdict

import torch

import megamoe.megakernel.kernel as mega  # the pass's module: the functions it calls are looked up there
from megamoe.bench.problem import make_problem
from megamoe.config import preset
from megamoe.megakernel import fuse_shared
from megamoe.ops.expert_weights import quantize_experts
from megamoe.parallel.world import launch
from megamoe.planner import LayerShape
from megamoe.precision import PRECISIONS


def _host(world, preset_name: str, tokens: int, passes: int, precision: str):
    cfg = preset(preset_name)
    p = make_problem(cfg, world.rank, world.size, tokens, dtype=torch.bfloat16, device=world.device)
    fused = fuse_shared(p.shared)
    kernel = mega.MegaKernel(world, LayerShape.of(cfg, world.size, tokens), precision=precision)
    experts_q = None if precision == "bf16" else quantize_experts(p.w_gate_up, p.w_down, precision)
    spent = defaultdict(float)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            spent[name] += time.perf_counter() - t0
            return result
        return wrapper

    # steps 2-4 (barrier, schedule, row tiles, the kernel) are one graph replay from the second pass on
    # (megamoe.megakernel.replay); MEGAMOE_HOST_REPLAY=0 times them launched from the host
    if os.environ.get("MEGAMOE_HOST_REPLAY", "1") == "0":
        kernel.replay = None
    else:
        kernel.replay = timed("replay (steps 2-4)", kernel.replay)
    for name in ("build_pull_schedule", "build_row_tiles", "quantize_activations"):
        setattr(mega, name, timed(name, getattr(mega, name)))
    for name in ("_stage", "_device_work", "_barrier", "_weighted_sum"):
        setattr(kernel, name, timed(name, getattr(kernel, name)))
    for name in ("arguments", "run"):  # the megakernel's launch: its arguments, then the launch itself
        setattr(kernel.launcher, name, timed(f"launcher.{name}", getattr(kernel.launcher, name)))
    args = (p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, fused, cfg.activation)
    kernel.forward(*args, experts_q=experts_q)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")  # names any op of the pass that makes the host wait
    kernel.forward(*args, experts_q=experts_q, check=False)
    torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    spent.clear()
    t0 = time.perf_counter()
    for _ in range(passes):
        kernel.forward(*args, experts_q=experts_q, check=False)
    spent["forward (whole call)"] = time.perf_counter() - t0
    torch.cuda.synchronize()
    kernel.check_errors()
    stages = {name: 1e6 * s / passes for name, s in spent.items()}
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(passes):
        kernel.forward(*args, experts_q=experts_q, check=False)
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    return stages, text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--precision", default="bf16", choices=PRECISIONS)
    a = parser.parse_args()
    stages, profile = launch(_host, torch.cuda.device_count(), a.preset, a.tokens, a.passes, a.precision,
                             device="cuda")[0]
    print(profile)
    for name, us in sorted(stages.items(), key=lambda kv: -kv[1]):
        print(f"{name:28} {us:10.1f} us")


if __name__ == "__main__":
    main()
