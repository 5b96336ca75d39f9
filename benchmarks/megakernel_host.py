"""Host time of an eager megakernel pass, by stage (the GPU runs behind: nothing here syncs).

    PYTHONPATH=src python3 benchmarks/megakernel_host.py --preset kimi-k2 --tokens 8192

One process per GPU; rank 0 prints the mean host microseconds per pass of each stage of
`MegaKernel.forward` (wrapped with perf_counter) and of the whole call.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

import megamoe.megakernel as mega
from megamoe.bench.problem import make_problem
from megamoe.config import preset
from megamoe.world import launch


def _host(world, preset_name: str, tokens: int, passes: int):
    cfg = preset(preset_name)
    p = make_problem(cfg, world.rank, world.size, tokens, dtype=torch.bfloat16, device=world.device)
    fused = mega.fuse_shared(p.shared)
    kernel = mega.MegaKernel(world, mega.LayerShape.of(cfg, world.size, tokens))
    spent = defaultdict(float)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            spent[name] += time.perf_counter() - t0
            return result
        return wrapper

    mega.build_pull_schedule = timed("build_pull_schedule", mega.build_pull_schedule)
    mega.build_row_tiles = timed("build_row_tiles", mega.build_row_tiles)
    for name in ("_barrier", "_launch", "_weighted_sum"):
        setattr(kernel, name, timed(name, getattr(kernel, name)))
    args = (p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, fused, cfg.swiglu_limit)
    kernel.forward(*args)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")  # names any op of the pass that makes the host wait
    kernel.forward(*args, check=False)
    torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    spent.clear()
    t0 = time.perf_counter()
    for _ in range(passes):
        kernel.forward(*args, check=False)
    spent["forward (whole call)"] = time.perf_counter() - t0
    torch.cuda.synchronize()
    kernel.check_errors()
    return {name: 1e6 * s / passes for name, s in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--passes", type=int, default=10)
    a = parser.parse_args()
    result = launch(_host, torch.cuda.device_count(), a.preset, a.tokens, a.passes, device="cuda")[0]
    for name, us in sorted(result.items(), key=lambda kv: -kv[1]):
        print(f"{name:28} {us:10.1f} us")


if __name__ == "__main__":
    main()
