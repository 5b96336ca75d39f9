"""Tables and JSON records of `megamoe bench` runs."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from datetime import datetime, timezone

import torch
from rich.console import Console
from rich.table import Table


def run_metadata(device: str) -> dict:
    """Fields every record of one run shares: machine, commit, run id, date."""
    try:
        if os.environ.get("MEGAMOE_COMMIT"):  # a copy of the tree without .git (the GPU machine)
            raise OSError
        root = os.path.dirname(os.path.abspath(__file__))
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = os.environ.get("MEGAMOE_COMMIT", "unknown")
    machine = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    return {
        "machine": machine,
        "commit": commit,
        "run_id": uuid.uuid4().hex[:12],
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def print_table(records: list[dict], console: Console | None = None, baseline: str = "nccl-torch") -> None:
    """One row per (impl, pass): time, ratio against ``baseline``, TFLOP/s, GB/s, errors."""
    console = console or Console()
    if not console.is_terminal:  # logs and CI: do not squeeze the table into 80 columns
        console.width = max(console.width, 150)
    base = {(r["preset"], r["pass"], r["ep"]): r["time_ms"] for r in records if r["impl"] == baseline}
    first = records[0] if records else {}
    table = Table(title=f"megamoe bench · {first.get('preset')} · EP {first.get('ep')} · "
                        f"{first.get('tokens_per_rank')} tokens/rank · {first.get('precision')} · {first.get('machine')}")
    for col in ("impl", "pass", "ms", "p10–p90", f"× vs {baseline}", "TFLOP/s", "cross GB/s", "max abs", "rel", "ok"):
        table.add_column(col, justify="left" if col in ("impl", "pass") else "right")
    for r in records:
        ref = base.get((r["preset"], r["pass"], r["ep"]))
        speedup = ref / r["time_ms"] if ref and r["time_ms"] else None
        table.add_row(
            r["impl"], r["pass"],
            f"{r['time_ms']:.3f}", f"{r['time_ms_p10']:.3f}–{r['time_ms_p90']:.3f}",
            _fmt(speedup, ".2f"), _fmt(r["tflops"], ".3g"), _fmt(r["cross_gbps"], ".3g"),
            f"{r['max_abs_err']:.2e}", f"{r['rel_err']:.2e}",
            "[green]yes[/green]" if r["correct"] else f"[red]NO[/red] ({r['worst_tensor']})",
        )
    console.print(table)
    for line in _quantize_notes(records):
        console.print(line)


def _quantize_notes(records: list[dict]) -> list[str]:
    """What the FP8 rows' weight quantisation costs: it runs once per optimizer step, outside their passes."""
    return [f"{r['impl']}: the routed weights quantised once before the passes, {r['weights_quantize_ms']:.3f} ms "
            f"(once per optimizer step; not in the pass times)"
            for r in records if r.get("weights_quantize_ms") is not None and r["pass"] == "fwd"]


def write_json(records: list[dict], path: str) -> None:
    """Append-free write: the file holds exactly this run's records."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")


def write_markdown(records: list[dict], path: str, command: str, baseline: str = "nccl-torch") -> None:
    """A short Markdown table of the run with its machine, commit, date and command."""
    first = records[0] if records else {}
    base = {(r["preset"], r["pass"], r["ep"]): r["time_ms"] for r in records if r["impl"] == baseline}
    lines = [
        f"# {first.get('preset')} · EP {first.get('ep')} · {first.get('tokens_per_rank')} tokens/rank · "
        f"{first.get('precision')}",
        "",
        f"- machine: {first.get('machine')}; commit: {first.get('commit')}; date: {first.get('date')}",
        f"- command: `{command}`",
        "",
        f"| impl | pass | ms (median) | p10–p90 | × vs {baseline} | TFLOP/s | cross GB/s | max abs | rel | correct |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        ref = base.get((r["preset"], r["pass"], r["ep"]))
        lines.append(
            f"| {r['impl']} | {r['pass']} | {r['time_ms']:.3f} | {r['time_ms_p10']:.3f}–{r['time_ms_p90']:.3f} | "
            f"{_fmt(ref / r['time_ms'] if ref and r['time_ms'] else None, '.2f')} | {_fmt(r['tflops'], '.1f')} | "
            f"{_fmt(r['cross_gbps'], '.1f')} | {r['max_abs_err']:.2e} | {r['rel_err']:.2e} | {r['correct']} |"
        )
    notes = _quantize_notes(records)
    lines += [""] + [f"- {note}" for note in notes] if notes else []
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
