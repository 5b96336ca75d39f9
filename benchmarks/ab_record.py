"""What the measuring tools do with their result: the interleaved A/B tools (megakernel_ab, backward_ab) write it
and print its table; the per-SM tools (backward_per_sm, megakernel_per_sm) measure on one GPU rank or print a
recorded result again."""

from __future__ import annotations

import json
import os
import sys


def write_and_print(result: dict, out: str, title: str) -> None:
    """``result`` (median_ms, rounds_ms, configs, bitwise_equal by variant) as JSON at ``out`` (when given) and
    a Markdown table under ``title``."""
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print(title)
    print("| variant | config | median | rounds | same bits |")
    print("|---|---|---|---|---|")
    for name, ms in result["median_ms"].items():
        rounds = " ".join(f"{v:.2f}" for v in result["rounds_ms"][name])
        print(f"| {name} | {result['configs'][name]} | {ms:.2f} | {rounds} | {result['bitwise_equal'][name]} |")


def measure_or_replay(args, measure, print_table, name: str) -> None:
    """``args.from_`` set: print that recorded result's table (no GPU). Else ``measure(args)`` on one GPU rank, its
    result written to ``args.out/name.json`` and its table printed."""
    import torch

    from megamoe.parallel.world import launch

    if args.from_:
        with open(args.from_) as f:
            print_table(json.load(f))
        return
    if not torch.cuda.is_available():
        raise SystemExit(f"{os.path.basename(sys.argv[0])} times a GPU: no CUDA device here (--from prints a recorded run)")
    (result,) = launch(measure, 1, args, device="cuda")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print_table(result)
