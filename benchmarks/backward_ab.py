"""The backward megakernel's variants in interleaved rounds: its comm SMs, and the composed standalone kernels.

    PYTHONPATH=src python3 benchmarks/backward_ab.py --preset kimi-k2 --tokens 4096 --variants plan,12,composed
        [--ranks 2] [--rounds 5] [--passes 5]

`megamoe bench`'s problem (seed 0, uniform routing) on --ranks ranks (default: one per GPU; more ranks than GPUs
share them, each with its share of the SMs, and their processes' kernels time-slice the GPU: a correctness run, not
a timing of EP across GPUs). One rank runs the megakernel too (``one_rank_megakernel``: its comm workers copy
local rows), which times the fused kernel against the composed one on a whole GPU. A variant is
``plan`` (the planner's backward_comm_sms), a number (that many backward comm SMs, the forward's config otherwise
the planner's) or ``composed`` (the standalone kernels ordered on the device, the planner's config). One forward
per variant leaves what the backward reads; a round runs --passes backward passes of each variant, one variant
after another, after a warm-up round (variants drift together as the GPU heats toward its power cap). Prints ms per
backward pass (slowest rank, median over rounds, and every round) and whether each variant's gradients equal the
first's bit for bit (the weight gradients by row checksums); writes --out JSON.
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
from megamoe.megakernel.saved import SavedForward
from megamoe.planner.tiles import plan_tiles
from megamoe.parallel.world import launch
from megamoe.planner import LayerShape, plan
from megamoe.runtime import INTERPRETER_PROGRAMS


def variants(text: str) -> list[tuple[str, int | None, bool]]:
    """``plan,12,composed`` -> [("plan", None, True), ("12", 12, True), ("composed", None, False)]:
    (name, backward comm SMs or None for the planner's, fused)."""
    out = []
    for item in text.split(","):
        if item not in ("plan", "composed") and not item.isdigit():
            raise ValueError(f"a variant is plan, composed or a backward comm SM count, got {item!r}")
        out.append((item, int(item) if item.isdigit() else None, item != "composed"))
    return out


def fingerprint(g) -> list[torch.Tensor]:
    """The gradients as tensors to compare bit for bit: the token-sized ones whole, the experts' weight gradients
    as int64 sums of each row's bit patterns (a copy of those would hold another rank's worth of weights)."""
    small = [t for t in (g.x, g.router_weights, g.shared_gate_up, g.shared_down) if t is not None]
    rows = [torch.stack([e.view(torch.int16).to(torch.int64).sum(-1) for e in w]) for w in (g.w_gate_up, g.w_down)]
    return [t.clone() for t in small] + rows


def run_rank(world, opts: dict):
    cfg = preset(opts["preset"])
    tokens = opts["tokens"]
    p = make_problem(cfg, world.rank, world.size, tokens, dtype=torch.bfloat16, device=world.device, seed=0)
    shared = fuse_shared(p.shared)
    shape = LayerShape.of(cfg, world.size, tokens)
    tile = plan_tiles("down", world.device if world.is_cuda else torch.device("cpu"))
    num_sms = (torch.cuda.get_device_properties(world.device).multi_processor_count // world.ranks_per_device
               if world.is_cuda else INTERPRETER_PROGRAMS)
    # the interpreter's 4 programs fit no comm rule: one comm program there
    base = plan(cfg, world.size, tokens, num_sms=num_sms, tile_m=tile.block_m, tile_n=tile.block_n,
                comm_sms=None if world.is_cuda else 1).config
    d_out = torch.randn(p.x.shape, generator=torch.Generator().manual_seed(100 + world.rank)).to(p.x)
    kernels, runs = {}, {}
    for name, sms, fused in opts["variants"]:
        config = base if sms is None else replace(base, backward_comm_sms=sms)
        if config not in kernels:
            # one rank: the megakernel anyway (MegaKernel's default there is the composed path, nothing to overlap)
            kernels[config] = MegaKernel(world, shape, config, one_rank_megakernel=world.size == 1)
        kernel = kernels[config]
        with torch.no_grad():
            _, ctx = kernel.forward(p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, shared,
                                    cfg.activation)
        saved = SavedForward(ctx.buffers.h, ctx.buffers.shared_h, ctx.schedule)
        runs[name] = (kernel, config, saved, fused)

    def backward(name, check=False):
        kernel, _, saved, fused = runs[name]
        return kernel.backward(saved, d_out, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, shared,
                               cfg.activation, check=check, fused=fused)

    def passes(name):
        for _ in range(opts["passes"]):
            backward(name)  # the gradients dropped at once: one pass's worth alive at a time

    first, same = None, {}
    for name in runs:
        got = fingerprint(backward(name, check=True))  # compile, and every wait's error word read
        first = got if first is None else first
        same[name] = all(torch.equal(a, b) for a, b in zip(got, first))
    times = {name: [] for name in runs}
    for r in range(opts["rounds"] + 1):
        for name in runs:
            ms, _ = timed_pass(world, lambda: passes(name))
            if r:
                times[name].append(ms / opts["passes"])
    for kernel in kernels.values():
        kernel.check_errors()
    everyone = world.all_gather_object(times)
    slowest = {name: [max(t[name][i] for t in everyone) for i in range(opts["rounds"])] for name in runs}
    same_all = world.all_gather_object(same)
    if world.rank:
        return None
    return dict(configs={name: str(config) for name, (_, config, _, _) in runs.items()}, rounds_ms=slowest,
                median_ms={name: statistics.median(v) for name, v in slowest.items()},
                bitwise_equal={name: all(s[name] for s in same_all) for name in runs})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--variants", type=variants, default=variants("plan,composed"))
    parser.add_argument("--ranks", type=int, default=None, help="ranks (default: every GPU; 2 on the CPU)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--out", default="")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a smoke run (e.g. --preset tiny --tokens 64 --variants plan,3,composed)")
    args = parser.parse_args()
    if args.ranks is not None and args.ranks < 1:
        parser.error("--ranks must be >= 1")
    commit = os.environ.get("MEGAMOE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    opts = dict(vars(args))
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    ranks = args.ranks or (2 if args.device == "cpu" else max(2, torch.cuda.device_count()))
    result = launch(run_rank, ranks, opts, device=args.device)[0]
    result.update(preset=args.preset, tokens=args.tokens, ranks=ranks, commit=commit,
                  date=datetime.date.today().isoformat(),
                  machine=torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (interpreter)",
                  gpus=torch.cuda.device_count() if args.device == "cuda" else 0,
                  command="PYTHONPATH=src python3 " + " ".join(sys.argv))
    title = (f"{args.preset}, {args.tokens} tokens per rank, {ranks} ranks on {result['gpus']} GPUs, commit {commit}: "
             "ms per backward pass (slowest rank)")
    ab_record.write_and_print(result, args.out, title)

if __name__ == "__main__":
    main()
