"""Where a megamoe forward pass spends its GPU time: torch.profiler over a few passes, rank 0's kernels.

    PYTHONPATH=src python3 benchmarks/megakernel_profile.py --preset kimi-k2 --tokens 8192 [--out DIR]

One process per GPU; prints the kernels by total CUDA time (rank 0) and writes the table to DIR/profile.txt.
"""

from __future__ import annotations

import os

import torch

from megamoe.bench.problem import make_problem
from megamoe.config import preset
from megamoe.megakernel import megamoe_forward
from megamoe.plan import KernelConfig
from megamoe.world import launch

import megakernel_args  # benchmarks/, beside this script


def _profile(world, preset_name: str, tokens: int, passes: int, config: KernelConfig | None):
    cfg = preset(preset_name)
    p = make_problem(cfg, world.rank, world.size, tokens, dtype=torch.bfloat16, device=world.device)
    args = (world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared, cfg.swiglu_limit)
    for _ in range(2):
        megamoe_forward(*args, config=config)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(passes):
            megamoe_forward(*args, config=config)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=25) if world.rank == 0 else None


def main() -> None:
    a, config = megakernel_args.parse(__doc__)
    table = launch(_profile, torch.cuda.device_count(), a.preset, a.tokens, a.passes, config, device="cuda")[0]
    print(table)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "profile.txt"), "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
