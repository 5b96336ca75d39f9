"""What cutting row tiles at minibatch boundaries costs the expert GEMMs alone (one GPU).

The megakernel's row tiles never straddle a minibatch; its traces show the compute workers' routed work
growing as minibatches shrink (benchmarks/results/2026-11-30-one-rank). This times the standalone
``expert_forward`` on the same rows with the tiles cut the same way (``minibatch=``), so the cuts' share
can be told from the rest:

    PYTHONPATH=src python3 benchmarks/experts_minibatch_bench.py --preset kimi-k2 --experts 192 --out OUT.json

Rows: tokens x k spread evenly over the experts (``megamoe.bench.experts.make_load``). Prints a table;
every cut gives the same bits as no cut (checked).
"""

from __future__ import annotations

import argparse
import json

import torch

from megamoe.bench.experts import make_load, median_ms
from megamoe.config import preset
from megamoe.routing.row_tiles import build_row_tiles
from megamoe.ops.experts import expert_forward
from megamoe.ops.tiles import plan_tiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=192)
    parser.add_argument("--minibatch", default="0,8192,4096,1920,1024", help="rows; 0 = no cut")
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    cfg, device = preset(a.preset), torch.device("cuda")
    routes = a.tokens * cfg.top_k
    x, counts, offsets, wgu, wd = make_load(a.experts, routes, cfg.hidden, cfg.intermediate, device)
    flops = 6 * routes * cfg.hidden * cfg.intermediate
    block_m = plan_tiles("gate_up", device).block_m
    first, records = None, []
    for mb in (int(v) for v in a.minibatch.split(",")):
        minibatch = mb or None
        y = expert_forward(x, counts, offsets, wgu, wd, minibatch=minibatch).y
        first = y if first is None else first
        tiles = int(build_row_tiles(counts, offsets, routes, block_m, minibatch=minibatch).num_tiles)
        ms = median_ms(lambda: expert_forward(x, counts, offsets, wgu, wd, minibatch=minibatch), device)
        records.append({"preset": a.preset, "experts": a.experts, "rows": routes, "minibatch": mb, "tiles": tiles,
                        "ms": ms, "tflops": flops / ms / 1e9, "same_bits": bool(torch.equal(y, first))})
    if a.out:
        with open(a.out, "w") as f:
            json.dump(records, f, indent=1)
    print("| minibatch | row tiles | ms | TFLOP/s | same bits |\n|---|---|---|---|---|")
    for r in records:
        print(f"| {r['minibatch'] or 'none'} | {r['tiles']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['same_bits']} |")


if __name__ == "__main__":
    main()
