"""128-row expert tiles with 64-row tiles for the tails, on routed loads as random routing spreads them.

    PYTHONPATH=src python3 benchmarks/tail_tiles_ab.py --preset deepseek-v4-pro --ep 2 [--rounds 6] [--seconds 0.5]

`tiles_ab.py` and `megamoe bench-experts` spread rows evenly over the experts (deepseek-v4-pro at EP 2: 256
rows each, two full 128-row tiles). Uniform random routing spreads them binomially (256 +- 16), so about half
of the experts get a third tile holding 1-16 rows: ~19 % of the tile rows the GEMMs compute are padding, where
the even load has none. Here the counts come from random routing (8192 tokens per rank x k routes over E
experts, this rank's E / ep), and three variants run in interleaved sustained rounds on one GPU (the
tiles_ab.py method): every tile 128 rows; every tile 64 rows; and 128-row tiles with each expert's last <= 64
rows in a 64-row tile (two launches per GEMM: the full parts, then the tails, each expert split into two
regions). Every variant's y is compared bit for bit with the first's.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from megamoe.config import preset
from megamoe.ops.experts import ExpertForward, expert_forward
from megamoe.ops.tiles import TileConfig

from sustained import interleaved_rounds  # benchmarks/, beside this script

WIDE = {"gate_up": TileConfig(128, 128, 64, 8, 3, 4), "down": TileConfig(128, 256, 64, 8, 3, 8, True)}
NARROW = {"gate_up": TileConfig(64, 128, 64, 4, 4, 8), "down": TileConfig(64, 256, 64, 4, 4, 8, True)}


def _padded(counts: torch.Tensor, block: int) -> int:
    return int(((counts + block - 1) // block * block).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="deepseek-v4-pro")
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=0.5)
    a = parser.parse_args()
    cfg, device = preset(a.preset), torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    local = cfg.num_experts // a.ep
    ids = torch.randint(0, cfg.num_experts, (a.ep * a.tokens * cfg.top_k,), generator=gen, device=device)
    counts = torch.bincount(ids, minlength=cfg.num_experts)[:local].to(torch.int32)
    offsets = (counts.cumsum(0) - counts).to(torch.int32)
    rows, d, i = int(counts.sum()), cfg.hidden, cfg.intermediate
    x = torch.randn(rows, d, generator=gen, device=device).bfloat16()
    wgu = (torch.randn(local, 2 * i, d, generator=gen, device=device) / d**0.5).bfloat16()
    wd = (torch.randn(local, d, i, generator=gen, device=device) / i**0.5).bfloat16()
    tail = counts % 128
    short = (tail > 0) & (tail <= 64)
    counts_full = torch.where(short, counts - tail, counts)
    counts_tail = torch.where(short, tail, torch.zeros_like(tail))
    offsets_tail = offsets + counts_full

    def fresh() -> ExpertForward:
        return ExpertForward(*(torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=device)
                               for n in (2 * i, i, d)))

    outs = {name: fresh() for name in ("128-row", "64-row", "128-row + 64-row tails")}
    calls = {
        "128-row": lambda o=outs["128-row"]: expert_forward(x, counts, offsets, wgu, wd, out=o, tiles=WIDE),
        "64-row": lambda o=outs["64-row"]: expert_forward(x, counts, offsets, wgu, wd, out=o, tiles=NARROW),
        "128-row + 64-row tails": lambda o=outs["128-row + 64-row tails"]: (
            expert_forward(x, counts_full, offsets, wgu, wd, out=o, tiles=WIDE),
            expert_forward(x, counts_tail, offsets_tail, wgu, wd, out=o, tiles=NARROW)),
    }
    computed = {"128-row": _padded(counts, 128), "64-row": _padded(counts, 64),
                "128-row + 64-row tails": _padded(counts_full, 128) + _padded(counts_tail, 64)}
    for fn in calls.values():
        fn()
    first = outs["128-row"].y
    same = {name: bool(torch.equal(o.y, first)) for name, o in outs.items()}
    times = interleaved_rounds(calls, a.rounds, a.seconds)
    flops = 6 * rows * d * i
    print(f"{a.preset} EP {a.ep}: {local} experts, {rows} rows (mean {rows / local:.0f}, min {int(counts.min())}, "
          f"max {int(counts.max())}), {a.rounds} rounds of {a.seconds} s")
    print("| tiles | rows computed (% padding) | ms (median) | min-max | TFLOP/s (useful rows) | same bits |")
    print("|---|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {computed[name]} ({100 * (1 - rows / computed[name]):.0f} %) | {med:.3f} | "
              f"{min(ts):.3f}-{max(ts):.3f} | {flops / med / 1e9:.0f} | {same[name]} |")


if __name__ == "__main__":
    main()
