"""The megakernel with a rank's own outputs left in the ring against pushing them home, in interleaved rounds.

    PYTHONPATH=src python3 benchmarks/own_outputs_ab.py --preset kimi-k2 --variants 8:push,8,6 [--rounds 5]

On every GPU (one rank each), `megamoe bench`'s problem (seed 0, uniform routing, 8192 tokens per rank, BF16).
A variant is ``comm_sms`` (minibatch and ring from `megamoe plan` at that count) with ``:push`` for
``MegaKernel(keep_own_outputs=False)``: every output pushed to its combine slot, local ones too (the layout
before 24c8091). Each variant's MegaKernel is built once and kept; a round runs --passes eager passes of
each (device work replayed from the kernel's own CUDA graph, as `megamoe bench` times them), one variant
after another, after a warm-up round: variants drift together as the GPUs heat toward the power cap.
Prints ms per pass (slowest rank, median over rounds, and every round), checks that every variant's output
equals the first's bit for bit; writes --out JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

import torch

from megamoe.bench.problem import make_problem
from megamoe.config import preset
from megamoe.megakernel import LayerShape, MegaKernel, fuse_shared
from megamoe.plan import plan
from megamoe.world import launch


def variants(text: str) -> list[tuple[int, bool]]:
    """``8:push,8,6`` -> [(8, False), (8, True), (6, True)]: (comm_sms, keep_own_outputs)."""
    out = []
    for item in text.split(","):
        sms, _, mode = item.partition(":")
        if mode not in ("", "push"):
            raise ValueError(f"a variant is COMM_SMS or COMM_SMS:push, got {item!r}")
        out.append((int(sms), mode != "push"))
    return out


@torch.no_grad()
def run_rank(world, opts: dict):
    cfg = preset(opts["preset"])
    p = make_problem(cfg, world.rank, world.size, opts["tokens"], dtype=torch.bfloat16, device=world.device, seed=0)
    fused = fuse_shared(p.shared)
    shape = LayerShape.of(cfg, world.size, opts["tokens"])
    kernels = {}
    for sms, keep in opts["variants"]:
        config = plan(cfg, world.size, opts["tokens"], comm_sms=sms).config
        kernels[f"{sms}{'' if keep else ':push'}"] = (MegaKernel(world, shape, config, keep_own_outputs=keep), config)

    def forward(kernel, check=False):
        return kernel.forward(p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, fused,
                              cfg.swiglu_limit, check=check)[0]

    first, same = None, {}
    for name, (kernel, _) in kernels.items():
        for _ in range(3):  # compile, capture the device work's graph, replay it
            out = forward(kernel, check=True)
        first = out.clone() if first is None else first
        same[name] = bool(torch.equal(out, first))
    times = {name: [] for name in kernels}
    for r in range(opts["rounds"] + 1):
        for name, (kernel, _) in kernels.items():
            world.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(opts["passes"]):
                forward(kernel)
            end.record()
            end.synchronize()
            if r:
                times[name].append(start.elapsed_time(end) / opts["passes"])
    for kernel, _ in kernels.values():
        kernel.check_errors()
    everyone = world.all_gather_object(times)
    slowest = {name: [max(t[name][i] for t in everyone) for i in range(opts["rounds"])] for name in kernels}
    same_all = world.all_gather_object(same)
    return dict(configs={name: str(config) for name, (_, config) in kernels.items()}, rounds_ms=slowest,
                median_ms={name: statistics.median(v) for name, v in slowest.items()},
                bitwise_equal={name: all(s[name] for s in same_all) for name in kernels}) if world.rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--variants", type=variants, default=variants("8:push,8,6"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    commit = os.environ.get("MEGAMOE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    opts = dict(vars(args))
    result = launch(run_rank, None, opts, device="cuda")[0]
    result.update(preset=args.preset, tokens=args.tokens, commit=commit, date=datetime.date.today().isoformat(),
                  machine=torch.cuda.get_device_name(0), command="PYTHONPATH=src python3 " + " ".join(sys.argv))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{args.preset}, {args.tokens} tokens per rank, commit {commit}: ms per pass (slowest rank)")
    print("| variant | config | median | rounds | same bits |")
    print("|---|---|---|---|---|")
    for name, ms in result["median_ms"].items():
        rounds = " ".join(f"{v:.2f}" for v in result["rounds_ms"][name])
        print(f"| {name} | {result['configs'][name]} | {ms:.2f} | {rounds} | {result['bitwise_equal'][name]} |")


if __name__ == "__main__":
    main()
