"""Does a GEMM cost less at the power cap when some of its rows are zeros? Interleaved sustained rounds, one GPU.

    PYTHONPATH=src python3 benchmarks/zero_rows_power.py [--rows 65536] [--k 7168] [--n 4096] [--rounds 6]

The expert tiles compute whole 128-row tiles: the rows past an expert's end (11 % of kimi-k2's routed tile rows
at EP 2, ~20 % of deepseek-v4-pro's) are the next expert's rows, real data, multiplied and thrown away. Under
sustained GEMMs an H200 sits at its 700 W cap (benchmarks/results/2026-11-30-replay), so a pass is bound by its
energy; if the tensor cores spend less energy on zero operands, zero-filled padding rows would make the pass
faster. Here: ``A [rows, K] @ B [K, N]`` in bf16 (torch.mm) with the last ``f`` of every 128-row block of A zero,
f in 0 (random data), 0.125, 0.25, 0.5 and 1 (all zeros); each round runs every variant back to back for
--seconds, after a warm-up round; the table gives each variant's median ms and TFLOP/s over the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from sustained import interleaved_rounds  # benchmarks/, beside this script

FRACTIONS = (0.0, 0.125, 0.25, 0.5, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--k", type=int, default=7168)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    b = torch.randn(a.k, a.n, generator=gen, device="cuda").bfloat16()
    base = torch.randn(a.rows, a.k, generator=gen, device="cuda").bfloat16()
    inputs = {}
    for f in FRACTIONS:
        x = base.clone()
        zero_from = round(128 * (1 - f))
        x.view(-1, 128, a.k)[:, zero_from:] = 0
        inputs[f] = x
    out = torch.empty(a.rows, a.n, dtype=torch.bfloat16, device="cuda")
    times = interleaved_rounds({f: (lambda x=x: torch.mm(x, b, out=out)) for f, x in inputs.items()},
                               a.rounds, a.seconds)
    flops = 2 * a.rows * a.k * a.n
    records = [{"zero_fraction": f, "ms": statistics.median(t), "ms_rounds": t,
                "tflops": flops / statistics.median(t) / 1e9} for f, t in times.items()]
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"rows": a.rows, "k": a.k, "n": a.n, "seconds": a.seconds, "records": records}, fh, indent=1)
    print(f"A [{a.rows}, {a.k}] @ B [{a.k}, {a.n}] bf16, {a.rounds} rounds of {a.seconds} s per variant")
    print("| zero rows per 128 | ms (median) | TFLOP/s | vs random |")
    print("|---|---|---|---|")
    for rec in records:
        print(f"| {rec['zero_fraction']:.3f} | {rec['ms']:.3f} | {rec['tflops']:.0f} | "
              f"{records[0]['ms'] / rec['ms']:.3f}x |")


if __name__ == "__main__":
    main()
