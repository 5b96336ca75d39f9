"""How the speedup over nccl-torch moves with EP: `megamoe bench` JSON records in, a Markdown table and a PNG out.

    python3 benchmarks/ep_scaling.py RESULTS_DIR [--png ep-scaling.png] > ep-scaling.md

Reads every ``*.json`` under RESULTS_DIR (each a list of bench records, as `megamoe bench --json` writes), keeps
the forward passes, and prints one row per (preset, tokens per rank, EP): nccl-torch's time, then megamoe's
eager and graph-replayed times and speedups for each routed-expert format, the commits and whether every row
was correct. The PNG draws the graph-replayed speedups against EP, one panel per preset.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import defaultdict

#: The megamoe rows of a bench record, by (implementation, routed-expert format).
MEGAMOE_ROWS = {("megamoe", "bf16"): "megamoe", ("megamoe-graph", "bf16"): "megamoe-graph",
                ("megamoe", "fp8-block"): "megamoe (fp8-block experts)",
                ("megamoe-graph", "fp8-block"): "megamoe-graph (fp8-block experts)"}


def load(results_dir: str) -> dict[tuple[str, int, int], dict[str, dict]]:
    """(preset, tokens per rank, EP) -> {impl name: forward record}."""
    runs: dict[tuple[str, int, int], dict[str, dict]] = defaultdict(dict)
    for path in sorted(glob.glob(os.path.join(results_dir, "**", "*.json"), recursive=True)):
        with open(path) as f:
            records = json.load(f)
        if not isinstance(records, list):
            continue
        for r in records:
            if isinstance(r, dict) and r.get("pass") == "fwd" and "impl" in r:
                runs[(r["preset"], r["tokens_per_rank"], r["ep"])][r["impl"]] = r
    return runs


def table(runs: dict[tuple[str, int, int], dict[str, dict]]) -> str:
    head = ["preset", "tokens/rank", "EP", "nccl-torch ms"]
    for (impl, fmt), _ in MEGAMOE_ROWS.items():
        head.append(f"{impl} {fmt} ms (x)")
    head += ["commit", "all correct"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in sorted(runs, key=lambda k: (k[0], -k[1], k[2])):
        rows = runs[key]
        base = rows.get("nccl-torch")
        if base is None:
            continue
        cells = [key[0], str(key[1]), str(key[2]), f"{base['time_ms']:.2f}"]
        for name in MEGAMOE_ROWS.values():
            r = rows.get(name)
            cells.append(f"{r['time_ms']:.2f} ({base['time_ms'] / r['time_ms']:.2f}x)" if r else "-")
        cells.append(", ".join(sorted({str(r["commit"]) for r in rows.values()})))
        cells.append(str(all(r["correct"] for r in rows.values())))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: dict[tuple[str, int, int], dict[str, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on the benchmark machines
    import matplotlib.pyplot as plt

    presets = sorted({k[0] for k in runs})
    token_counts = sorted({k[1] for k in runs}, reverse=True)
    graphs = {fmt: name for (impl, fmt), name in MEGAMOE_ROWS.items() if impl == "megamoe-graph"}
    colors = {"bf16": "tab:blue", "fp8-block": "tab:red"}
    fig, axes = plt.subplots(1, len(presets), figsize=(5 * len(presets), 4), sharey=True, squeeze=False)
    for ax, preset in zip(axes[0], presets):
        for tokens, style in zip(token_counts, ("-", "--", ":", "-.") * len(token_counts)):
            for fmt, name in graphs.items():
                points = sorted((ep, rows["nccl-torch"]["time_ms"] / rows[name]["time_ms"])
                                for (p, t, ep), rows in runs.items()
                                if p == preset and t == tokens and name in rows and "nccl-torch" in rows)
                if points:
                    ax.plot(*zip(*points), style, marker="o", color=colors[fmt], label=f"{fmt}, {tokens} tokens")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_title(preset)
        ax.set_xlabel("EP (GPUs)")
        ax.set_xticks(sorted({k[2] for k in runs}))
    axes[0][0].set_ylabel("speedup over nccl-torch (graph-replayed forward)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results_dir")
    parser.add_argument("--png", default="", help="also draw the speedups against EP here")
    args = parser.parse_args()
    runs = load(args.results_dir)
    if not runs:
        print(f"no forward bench records under {args.results_dir}", file=sys.stderr)
        return 1
    if args.png:
        plot(runs, args.png)
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
