"""The backward's peak memory per rank at several EP sizes with the same tokens per rank (ranks sharing one GPU),
beside the planner's accounting: issue 48's "memory per rank independent of R".

    PYTHONPATH=src python3 benchmarks/backward_memory.py [--preset qwen3-30b-a3b] [--tokens 8192] [--ranks 1,2,4]
        [--fused] [--out DIR]
    python3 benchmarks/backward_memory.py --from DIR/backward_memory_<preset>_<tokens>[_fused].json  # no GPU

For each R, R ranks on one GPU (``megamoe.launch``) each measure their backward
(``megamoe.bench.memory.backward_bytes``: ring and launcher buffers, plus the peak a backward adds over what was
allocated before it, less the weight gradients it returns) beside the planner's backward entries. Prints one
table (the largest rank of each R); writes DIR/backward_memory_<preset>_<tokens>[_fused].json. ``--from`` prints a
recorded run's table again.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from megamoe.bench.memory import backward_bytes
from megamoe.config import preset
from megamoe.parallel.world import launch


def _rank(world, a) -> dict:
    return backward_bytes(world, preset(a.preset), a.tokens, fused=a.fused)


def print_table(args: dict, results: dict) -> None:
    """The run's table: ``args`` (preset, tokens, fused) and ``results`` ({R: every rank's backward_bytes record})."""
    gib = 2**30
    print(f"{args['preset']}, {args['tokens']} tokens per rank, {'fused' if args['fused'] else 'composed'} backward, "
          "ranks on one GPU")
    print("| EP | backward bytes (ring + launcher + peak - weight grads), GiB | planned backward, GiB | ratio | "
          "peak over base, GiB | weight grads, GiB |")
    print("|---|---|---|---|---|---|")
    for ranks, rows in results.items():
        r = max(rows, key=lambda x: x["backward_bytes"])
        print(f"| {ranks} | {r['backward_bytes'] / gib:.3f} | {r['planned_bytes'] / gib:.3f} | "
              f"{r['backward_bytes'] / r['planned_bytes']:.3f} | {r['peak_bytes'] / gib:.3f} | "
              f"{r['weight_grad_bytes'] / gib:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--fused", action="store_true", help="the backward megakernel (R >= 2) instead of the "
                                                              "composed kernels")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--from", dest="from_", default="", help="a recorded backward_memory_*.json: print its table "
                                                                 "(no GPU)")
    a = parser.parse_args()
    if a.from_:
        with open(a.from_) as f:
            rec = json.load(f)
        print_table(rec["args"], rec["ranks"])
        return
    if not torch.cuda.is_available():
        raise SystemExit("backward_memory.py measures a GPU's allocator: no CUDA device here")
    results = {}
    for ranks in (int(r) for r in a.ranks.split(",")):
        results[ranks] = launch(_rank, ranks, a, device="cuda")
    os.makedirs(a.out, exist_ok=True)
    args = {k: v for k, v in vars(a).items() if k != "from_"}
    with open(os.path.join(a.out, f"backward_memory_{a.preset}_{a.tokens}{'_fused' if a.fused else ''}.json"),
              "w") as f:
        json.dump({"args": args, "ranks": results}, f, indent=1)
    print_table(args, results)


if __name__ == "__main__":
    main()
