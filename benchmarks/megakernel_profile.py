"""Where a megamoe forward pass spends its GPU time: torch.profiler over a few passes, rank 0's kernels.

    PYTHONPATH=src python3 benchmarks/megakernel_profile.py --preset kimi-k2 --tokens 8192 [--precision fp8-block] [--out DIR]

One process per GPU; prints the kernels by total CUDA time (rank 0) and writes the table to DIR/profile.txt.
"""

from __future__ import annotations

import os

import torch

from megamoe.bench.problem import make_problem
from megamoe.config import preset
from megamoe.megakernel import LayerShape, megamoe_forward
from megamoe.world import launch

import megakernel_args  # benchmarks/, beside this script


def _profile(world, a):
    cfg = preset(a.preset)
    p = make_problem(cfg, world.rank, world.size, a.tokens, dtype=torch.bfloat16, device=world.device)
    args = (world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared, cfg.swiglu_limit)
    options = dict(config=megakernel_args.config_for(a, world, LayerShape.of(cfg, world.size, a.tokens)),
                   precision=a.precision)
    for _ in range(2):
        megamoe_forward(*args, **options)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(a.passes):
            megamoe_forward(*args, **options)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=25) if world.rank == 0 else None


def main() -> None:
    a = megakernel_args.parse(__doc__)
    table = launch(_profile, torch.cuda.device_count(), a, device="cuda")[0]
    print(table)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "profile.txt"), "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
