"""Tables and JSON records of `megamoe bench` runs."""

from __future__ import annotations

import json
import os
import uuid
from datetime import datetime, timezone

import torch
from rich.console import Console
from rich.table import Table

from megamoe.bench.machine import git_commit


def run_metadata(device: str) -> dict:
    """Fields every record of one run shares: machine, commit (HEAD's 40 hex digits, or ``MEGAMOE_COMMIT`` in a
    copy of the tree without .git, else None) and whether the checkout had changes (dirty), run id, date."""
    commit, dirty = git_commit()
    machine = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    return {
        "machine": machine,
        "commit": commit,
        "dirty": dirty,
        "run_id": uuid.uuid4().hex[:12],
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _p50(r: dict) -> float:
    return r.get("time_ms_p50", r["time_ms"])


def commit_text(r: dict) -> str:
    return f"{r.get('commit')}{' (dirty)' if r.get('dirty') else ''}"


def machine_line(r: dict) -> str:
    """Where and how a run measured: device, driver, power limit, SM clocks seen, versions, rounds."""
    parts = [f"{r.get('device_name') or r.get('machine')} x {r.get('device_count')}"]
    if r.get("driver_version"):
        parts.append(f"driver {r['driver_version']}")
    if r.get("power_limit_w") is not None:
        parts.append(f"power limit {r['power_limit_w']:g} W")
    if r.get("sm_clock_mhz"):
        lo, hi = r["sm_clock_mhz"]
        parts.append(f"SM clock {lo:g}–{hi:g} MHz around the timed rounds")
    parts.append(f"torch {r.get('torch')}, triton {r.get('triton')}")
    if "steady_s" in r:
        parts.append(f"per pass {r.get('iters')} interleaved rounds after {r.get('warmup')} warm-up and "
                     f"{r['steady_s']:g} s steady")
    return "; ".join(parts)


def _clock_range_of(records: list[dict]) -> dict:
    """The first record with the SM clock range widened to every record's (the passes' rounds)."""
    seen = [c for r in records for c in (r.get("sm_clock_mhz") or ())]
    first = dict(records[0]) if records else {}
    first["sm_clock_mhz"] = [min(seen), max(seen)] if seen else None
    return first


def print_table(records: list[dict], console: Console | None = None, baseline: str = "nccl-torch") -> None:
    """One row per (impl, pass): p50 time, p10–p90, ratio against ``baseline``, TFLOP/s, time over the floor,
    GB/s, errors; under it the machine, commit and rounds."""
    console = console or Console()
    if not console.is_terminal:  # logs and CI: do not squeeze the table into 80 columns
        console.width = max(console.width, 160)
    base = {(r["preset"], r["pass"], r["ep"]): r["time_ms"] for r in records if r["impl"] == baseline}
    first = records[0] if records else {}
    table = Table(title=f"megamoe bench · {first.get('preset')} · EP {first.get('ep')} · "
                        f"{first.get('tokens_per_rank')} tokens/rank · {first.get('precision')} · {first.get('machine')}")
    for col in ("impl", "pass", "p50 ms", "p10–p90", f"× vs {baseline}", "TFLOP/s", "× floor", "cross GB/s",
                "max abs", "rel", "ok"):
        table.add_column(col, justify="left" if col in ("impl", "pass") else "right")
    for r in records:
        ref = base.get((r["preset"], r["pass"], r["ep"]))
        speedup = ref / r["time_ms"] if ref and r["time_ms"] else None
        table.add_row(
            r["impl"], r["pass"],
            f"{_p50(r):.3f}", f"{r['time_ms_p10']:.3f}–{r['time_ms_p90']:.3f}",
            _fmt(speedup, ".2f"), _fmt(r["tflops"], ".3g"), _fmt(r.get("x_floor"), ".2f"),
            _fmt(r["cross_gbps"], ".3g"),
            f"{r['max_abs_err']:.2e}", f"{r['rel_err']:.2e}",
            "[green]yes[/green]" if r["correct"] else f"[red]NO[/red] ({r['worst_tensor']})",
        )
    console.print(table)
    if records:
        console.print(f"{machine_line(_clock_range_of(records))}; commit {commit_text(first)}", soft_wrap=True,
                      markup=False)
        if any(r.get("floor_ms") for r in records):
            console.print("× floor: time over max(FLOPs at the H200's sustained dense rate, cross-rank bytes at "
                          "its NVLink rate), megamoe.bench.machine", soft_wrap=True)
    for line in _quantize_notes(records):
        console.print(line)


def _quantize_notes(records: list[dict]) -> list[str]:
    """What the FP8 rows' weight quantisation costs: it runs once per optimizer step, outside their passes."""
    return [f"{r['impl']}: the routed weights quantised once before the passes, {r['weights_quantize_ms']:.3f} ms "
            f"(once per optimizer step, megamoe's with the backward's transposes; not in the pass times)"
            for r in records if r.get("weights_quantize_ms") is not None and r["pass"] == "fwd"]


def write_json(records: list[dict], path: str) -> None:
    """Append-free write: the file holds exactly this run's records."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")


def write_markdown(records: list[dict], path: str, command: str, baseline: str = "nccl-torch") -> None:
    """A short Markdown table of the run with its machine, commit, date and command. The rows start on line 8
    and the first eleven columns keep their places (benchmarks/gpu_ep.sh cuts them); new columns go last."""
    first = records[0] if records else {}
    base = {(r["preset"], r["pass"], r["ep"]): r["time_ms"] for r in records if r["impl"] == baseline}
    lines = [
        f"# {first.get('preset')} · EP {first.get('ep')} · {first.get('tokens_per_rank')} tokens/rank · "
        f"{first.get('precision')}",
        "",
        f"- machine: {first.get('machine')}; commit: {commit_text(first)}; date: {first.get('date')}"
        + (f"; {machine_line(_clock_range_of(records))}" if records else ""),
        f"- command: `{command}`",
        "",
        f"| impl | pass | ms (median) | p10–p90 | × vs {baseline} | TFLOP/s | cross GB/s | max abs | rel | correct "
        f"| × floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        ref = base.get((r["preset"], r["pass"], r["ep"]))
        lines.append(
            f"| {r['impl']} | {r['pass']} | {r['time_ms']:.3f} | {r['time_ms_p10']:.3f}–{r['time_ms_p90']:.3f} | "
            f"{_fmt(ref / r['time_ms'] if ref and r['time_ms'] else None, '.2f')} | {_fmt(r['tflops'], '.1f')} | "
            f"{_fmt(r['cross_gbps'], '.1f')} | {r['max_abs_err']:.2e} | {r['rel_err']:.2e} | {r['correct']} | "
            f"{_fmt(r.get('x_floor'), '.2f')} |"
        )
    notes = _quantize_notes(records)
    lines += [""] + [f"- {note}" for note in notes] if notes else []
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
