"""The Gluon dacts' ring depth and K step, BF16 and FP8-block, timed as kernels inside the expert backward (one GPU).

    PYTHONPATH=src python3 benchmarks/dact_ab.py [--preset kimi-k2] [--experts 192] [--rounds 4] [--out DIR]

``tokens x k`` rows over --experts experts. Each variant is the expert backward with the planner's tiles but
for the dact's (`TileConfig` stages and BLOCK_K, which `experts_bwd.dact_ws_constexprs` turns into the Gluon
kernel's ring); its gradients are compared with the plan's bit for bit. In interleaved rounds every variant runs
back to back for --seconds at the power cap, then two calls under the torch profiler
(`bench.experts.kernel_times`) give the dact kernel's device time (the backward's other kernels are the same in
every variant). Prints the median dact ms per variant; writes DIR/dact_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from megamoe.bench.experts import backward_load, kernel_times
from megamoe.config import preset
from megamoe.ops.expert_weights import transposed_weights
from megamoe.ops.experts_bwd import expert_backward
from megamoe.ops.experts_fp8_bwd import expert_backward_fp8_block
from megamoe.ops.tiles import TileConfig

from sustained import run_for  # benchmarks/, beside this script

#: name -> the dact's TileConfig (None: the planner's)
BF16 = {
    "plan": None,
    "s5": TileConfig(128, 128, 64, num_warps=8, num_stages=5, group_m=8),
    "s6": TileConfig(128, 128, 64, num_warps=8, num_stages=6, group_m=8),
    "bk128-s3": TileConfig(128, 128, 128, num_warps=8, num_stages=3, group_m=8),
}
FP8 = {
    "plan": None,
    "s3": TileConfig(128, 128, 128, num_warps=8, num_stages=3, group_m=8),
    "s5": TileConfig(128, 128, 128, num_warps=8, num_stages=5, group_m=8),
    "s6": TileConfig(128, 128, 128, num_warps=8, num_stages=6, group_m=8),
}
GRADS = ("d_x", "d_router", "d_w_gate_up", "d_w_down")


def dact_ms(fn) -> float:
    """The dact kernel's device ms per call (two profiled calls after one more)."""
    return sum(ms for name, ms in kernel_times(fn, iters=2).items() if "dact" in name) or float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    load = backward_load(preset(a.preset), a.experts, a.tokens, torch.device("cuda"))
    args, rows = load.args, load.x.shape[0]
    wt = transposed_weights(load.w_gate_up, load.w_down)
    calls = {}
    for name, tile in BF16.items():
        calls[f"bf16 {name}"] = lambda t=tile: expert_backward(*args, tiles={"dact": t} if t else None)
    for name, tile in FP8.items():
        calls[f"fp8-block {name}"] = lambda t=tile: expert_backward_fp8_block(*args, weights_t=wt,
                                                                              tiles={"dact": t} if t else None)
    status, plans = {}, {}
    for name, fn in list(calls.items()):
        fmt = name.split()[0]
        try:
            got = fn()
            torch.cuda.synchronize()
        except Exception as e:  # a ring that does not fit shared memory is reported
            status[name] = f"failed: {type(e).__name__}: {str(e)[:120]}"
            del calls[name]
            continue
        if fmt not in plans:
            plans[fmt] = got
            continue
        status[name] = "same bits" if all(torch.equal(getattr(got, k), getattr(plans[fmt], k)) for k in GRADS) \
            else "DIFFERENT bits"
        del got
    del plans
    times = {name: [] for name in calls}
    for r in range(a.rounds + 1):
        for name, fn in calls.items():
            run_for(fn, a.seconds, 2)
            ms = dact_ms(fn)
            if r:
                times[name].append(ms)
    med = {k: statistics.median(v) for k, v in times.items()}
    with open(os.path.join(a.out, "dact_ab.json"), "w") as f:
        json.dump({"args": vars(a), "dact_ms": med, "rounds": times, "status": status}, f, indent=1)
    print(f"{a.preset}, {a.experts} experts x ~{rows // a.experts} rows; the dact kernel's ms, median of {a.rounds}")
    print("| variant | dact ms | vs plan | |")
    print("|---|---|---|---|")
    for k, v in med.items():
        base = med[k.split()[0] + " plan"]
        print(f"| {k} | {v:.3f} | {v / base:.3f} | {status.get(k, '')} |")
    for k, s in status.items():
        if k not in med:
            print(f"| {k} | — | | {s} |")


if __name__ == "__main__":
    main()
