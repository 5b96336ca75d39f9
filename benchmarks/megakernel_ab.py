"""MegaKernel variants in interleaved rounds: comm SMs and minibatch.

    PYTHONPATH=src python3 benchmarks/megakernel_ab.py --preset kimi-k2 --variants 8,6,8/1024 [--rounds 5]
        [--precision fp8-block]

On every GPU (one rank each), `megamoe bench`'s problem (seed 0, uniform routing, 8192 tokens per rank). A variant
is ``COMM_SMS[/MINIBATCH]``: `megamoe plan`'s config at that comm SM count (and minibatch, the ring rounded up
to whole minibatches). (``:push``, every output pushed to its combine slot, local ones too, went with
``MegaKernel(keep_own_outputs=False)`` after 480f1e9; its answer is benchmarks/results/2026-11-30-own-outputs.)
Each variant's MegaKernel is built once and kept; a round
runs --passes eager passes of each (device work replayed from the kernel's own CUDA graph, as `megamoe bench`
times them), one variant after another, after a warm-up round: variants drift together as the GPUs heat toward
the power cap, where sweeps that time one point after another drift apart (up to 8 %,
benchmarks/results/2026-11-30-own-outputs). Prints ms per pass (slowest rank, median over rounds, and every
round), checks that every variant's output equals the first's bit for bit; writes --out JSON. (Named
own_outputs_ab.py at 7cba9a2, where it took COMM_SMS[:push] only.)
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
from dataclasses import replace

import torch

import ab_record  # benchmarks/, beside this script
from megamoe.bench.runners import timed_pass
from megamoe.bench.problem import make_problem
from megamoe.config import preset
from megamoe.megakernel import MegaKernel, fuse_shared
from megamoe.ops.expert_weights import quantize_experts
from megamoe.planner.tiles import plan_tiles
from megamoe.parallel.world import launch
from megamoe.planner import LayerShape, plan
from megamoe.precision import PRECISIONS
from megamoe.runtime import INTERPRETER_PROGRAMS


def variants(text: str) -> list[tuple[str, int, int | None]]:
    """``8,6/1024`` -> [("8", 8, None), ("6/1024", 6, 1024)]: (name, comm_sms, minibatch or None for the
    planner's)."""
    out = []
    for item in text.split(","):
        sms, _, minibatch = item.partition("/")
        if not sms.isdigit() or (minibatch and not minibatch.isdigit()):
            raise ValueError(f"a variant is COMM_SMS[/MINIBATCH], got {item!r}")
        out.append((item, int(sms), int(minibatch) if minibatch else None))
    return out


@torch.no_grad()
def run_rank(world, opts: dict):
    cfg = preset(opts["preset"])
    p = make_problem(cfg, world.rank, world.size, opts["tokens"], dtype=torch.bfloat16, device=world.device, seed=0)
    fused = fuse_shared(p.shared)
    shape = LayerShape.of(cfg, world.size, opts["tokens"])
    precision = opts["precision"]
    # FP8: the weights quantised once, as after an optimizer step (`megamoe bench` does the same)
    experts_q = None if precision == "bf16" else quantize_experts(p.w_gate_up, p.w_down, precision)
    kernels = {}
    # the expert GEMMs' tile (128x256 on Hopper, 32x32 under the interpreter): the kernel accepts no other
    tile = plan_tiles("down", world.device if world.is_cuda else torch.device("cpu"))
    num_sms = (torch.cuda.get_device_properties(world.device).multi_processor_count if world.is_cuda
               else INTERPRETER_PROGRAMS)
    for name, sms, minibatch in opts["variants"]:
        config = plan(cfg, world.size, opts["tokens"], num_sms=num_sms, precision=precision, comm_sms=sms,
                      tile_m=tile.block_m, tile_n=tile.block_n).config
        if minibatch:
            config = replace(config, minibatch=minibatch, ring_rows=-(-config.ring_rows // minibatch) * minibatch)
        kernels[name] = (MegaKernel(world, shape, config, precision=precision), config)

    def forward(kernel, check=False):
        return kernel.forward(p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, fused, cfg.activation,
                              experts_q=experts_q, buffers=kernel.scratch_buffers(), check=check)[0]

    first, same = None, {}
    for name, (kernel, _) in kernels.items():
        for _ in range(3):  # compile, capture the device work's graph, replay it
            out = forward(kernel, check=True)
        first = out.clone() if first is None else first
        same[name] = bool(torch.equal(out, first))
    times = {name: [] for name in kernels}
    for r in range(opts["rounds"] + 1):
        for name, (kernel, _) in kernels.items():
            ms, _ = timed_pass(world, lambda: [forward(kernel) for _ in range(opts["passes"])])
            if r:
                times[name].append(ms / opts["passes"])
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
    parser.add_argument("--variants", type=variants, default=variants("8,6"))
    parser.add_argument("--precision", default="bf16", choices=PRECISIONS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--out", default="")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a smoke run on --ranks CPU ranks (e.g. --preset tiny --tokens 64 --variants 1,2)")
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks (--device cpu)")
    args = parser.parse_args()
    commit = os.environ.get("MEGAMOE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    opts = dict(vars(args))
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    result = launch(run_rank, args.ranks if args.device == "cpu" else None, opts, device=args.device)[0]
    result.update(preset=args.preset, tokens=args.tokens, precision=args.precision, commit=commit,
                  date=datetime.date.today().isoformat(),
                  machine=torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (interpreter)",
                  command="PYTHONPATH=src python3 " + " ".join(sys.argv))
    title = (f"{args.preset}, {args.tokens} tokens per rank, {args.precision}, commit {commit}: ms per pass "
             "(slowest rank)")
    ab_record.write_and_print(result, args.out, title)

if __name__ == "__main__":
    main()
