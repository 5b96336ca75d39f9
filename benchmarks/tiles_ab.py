"""Expert forward tiles A against B at the power cap: interleaved rounds of sustained calls, one GPU.

    PYTHONPATH=src python3 benchmarks/tiles_ab.py --preset kimi-k2 --experts 384 [--rounds 6] [--seconds 0.5]

A sweep that times candidates one after another drifts: under sustained GEMMs an H200 sits at its 700 W
cap and its SM clock falls from 1980 to ~1400 MHz over the first second (benchmarks/results/2026-11-30-replay,
clock_probe), so later candidates run hotter. Here every round runs each variant for --seconds back to back,
after a first round that only warms up, and the table gives each variant's median ms over the rounds. Variants:
the planner's tiles (128-row) and 64-row tiles (one warpgroup) for gate/up and down; every variant's output is
compared with the planner's first.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from megamoe.bench.experts import make_load
from megamoe.config import preset
from megamoe.ops.experts import ExpertForward, expert_forward
from megamoe.ops.tiles import TileConfig, plan_tiles

from sustained import interleaved_rounds  # benchmarks/, beside this script

VARIANTS = {
    "128-row (planner)": None,
    "64-row gate/up": {"gate_up": TileConfig(64, 128, 64, 4, 4, 8)},
    "64-row down": {"down": TileConfig(64, 256, 64, 4, 4, 8, True)},
    "64-row both": {"gate_up": TileConfig(64, 128, 64, 4, 4, 8), "down": TileConfig(64, 256, 64, 4, 4, 8, True)},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=0.5)
    a = parser.parse_args()
    cfg = preset(a.preset)
    device = torch.device("cuda")
    x, counts, offsets, wgu, wd = make_load(a.experts, a.tokens * cfg.top_k, cfg.hidden, cfg.intermediate, device)
    rows, d, i = x.shape[0], cfg.hidden, cfg.intermediate
    outs, calls = {}, {}
    for name, tiles in VARIANTS.items():
        tiles = {stage: (tiles or {}).get(stage, plan_tiles(stage, device)) for stage in ("gate_up", "down")}
        out = ExpertForward(*(torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=device)
                              for n in (2 * i, i, d)))
        calls[name] = (lambda out=out, tiles=tiles: expert_forward(x, counts, offsets, wgu, wd, out=out, tiles=tiles))
        calls[name]()
        outs[name] = out.y
    first = next(iter(outs.values()))
    same = {name: bool(torch.equal(y, first)) for name, y in outs.items()}
    times = interleaved_rounds(calls, a.rounds, a.seconds)
    flops = 6 * rows * d * i
    print(f"{a.preset}, {a.experts} experts x ~{rows // a.experts} rows, {a.rounds} rounds of {a.seconds} s each")
    print("| variant | ms (median) | min-max | TFLOP/s | same bits as the planner's |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.3f} | {min(ts):.3f}-{max(ts):.3f} | {flops / med / 1e9:.0f} | {same[name]} |")


if __name__ == "__main__":
    main()
