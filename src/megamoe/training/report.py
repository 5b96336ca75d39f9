"""What `megamoe train` hands back: a table, the JSON record, a PNG of the loss curves."""

from __future__ import annotations

import json
import os


def format_table(record: dict) -> str:
    """One line per impl: final loss, tokens/s per GPU, steady step time, its MoE part, peak memory, and its
    megakernels' CUDA graphs (replays / captures, forward + backward; "-" where it kept none)."""
    header = ("impl", "final loss", "tokens/s/GPU", "step ms", "MoE ms", "peak MiB", "graphs")
    rows = [header]
    for impl, run in record["runs"].items():
        rows.append((impl, f"{run['final_loss']:.4f}", f"{run['tokens_per_s_per_gpu']:.1f}",
                     f"{run['step_ms_median']:.1f}", f"{run['moe_ms_median']:.1f}",
                     f"{run['peak_memory_bytes'] / 2**20:.0f}", _graphs(run.get("graphs"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join(lines)


def _graphs(counts: dict | None) -> str:
    if not counts or not counts["kernels"]:
        return "-"
    replays = counts["replays"] + counts["backward_replays"]
    return f"{replays} / {counts['captures'] + counts['backward_captures']}"


def write_json(record: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


def plot_unavailable(path: str) -> str | None:
    """Why no PNG can be written to ``path`` (matplotlib, a dependency of megamoe, not importable), else None:
    `megamoe train` asks before it trains."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return (f"matplotlib is not installed ({exc}), so no loss plot can be written to {path}: pip install "
                f"matplotlib (a dependency of megamoe: pip install -e . installs it)")
    return None


def plot_losses(record: dict, path: str) -> str | None:
    """Every impl's loss per step in one PNG at ``path``; returns why not (matplotlib missing), else None."""
    if (why := plot_unavailable(path)) is not None:
        return why
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for impl, run in record["runs"].items():
        few = len(run["losses"]) < 50  # a marker per step while they can be told apart
        ax.plot(range(1, len(run["losses"]) + 1), run["losses"], label=impl, marker="." if few else None)
    preset = record["preset"]
    ax.set(xlabel="step", ylabel="loss (mean over ranks)",
           title=f"megamoe train: {preset['name']}, {record['world_size']} {record['device']} rank(s)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    ax.grid(alpha=0.3)
    ax.legend()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return None
