"""Tables and JSON records of `megamoe bench` runs."""

from __future__ import annotations

import json
import os
import uuid
from datetime import datetime, timezone
from functools import partial

import torch
from rich.console import Console
from rich.markup import escape
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


def _routing_text(r: dict) -> str:
    """`` · <routing> routing`` unless uniform (records before 2026-12-07 have none: uniform or their command's)."""
    routing = r.get("routing", "uniform")
    return "" if routing == "uniform" else f" · {routing} routing"


def _knobs_text(r: dict) -> str:
    """The run's ``MEGAMOE_*`` variables as a command's prefix (``K=V `` each), empty without any."""
    return "".join(f"{k}={v} " for k, v in (r.get("knobs") or {}).items())


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


def interpreted(records: list[dict]) -> bool:
    """Whether these records' times come from CPU ranks, where megamoe's Triton kernels run under the
    interpreter: wall times that say nothing about a GPU, so no ratio or rate is drawn from them."""
    return any((r.get("device") or r.get("machine")) == "cpu" for r in records)


def _error_cell(r: dict) -> str:
    """The relative error against its bound ("4.57e-03 ≤ 1e-02"), or alone for a record without the bound."""
    if r.get("rel_tol") is None:
        return f"{r['rel_err']:.2e}"
    within = r["rel_err"] <= r["rel_tol"]
    return f"{r['rel_err']:.2e} {'≤' if within else '[red]>[/red]'} {r['rel_tol']:.0e}"


def _tolerance_lines(records: list[dict]) -> list[str]:
    """The bounds of every check, per tolerance the records were checked with (harness.TOLERANCES)."""
    seen = {}
    for r in records:
        if r.get("tolerance") is not None:
            fwd = seen.setdefault(r["tolerance"], [r, None])
            if r.get("max_abs_tol") is not None:
                fwd[1] = r["max_abs_tol"]
    lines = []
    for name, (r, max_abs) in seen.items():
        row = f"the worst row's L2 error (over its norm, or a typical row's if larger) ≤ {r['row_tol']:g}"
        if r.get("row_group_tol") is not None:
            row += (f" (the routed experts' weight gradients: the median row error of each group of 64 rows "
                    f"≤ {r['row_group_tol']:g})")
        lines.append(f"  {name} bounds: rel err ≤ {r['rel_tol']:.0e}; {row}"
                     + (f"; the output's max abs error ≤ {max_abs:g} (fwd)" if max_abs is not None else ""))
    return lines


def print_table(records: list[dict], console: Console | None = None, baseline: str = "nccl-torch") -> None:
    """One row per (impl, pass): p50 time, p10–p90, ratio against ``baseline``, TFLOP/s, time over the floor
    (where one is known), GB/s, the relative error against its bound, correct; under it a legend of the
    columns, the machine, commit and rounds. CPU records (interpreter timings) show no ratio nor rate."""
    console = console or Console()
    if not console.is_terminal:  # logs and CI: do not squeeze the table into 80 columns
        console.width = max(console.width, 160)
    cpu = interpreted(records)
    base = {(r["preset"], r["pass"], r["ep"]): r["time_ms"] for r in records if r["impl"] == baseline}
    with_floor = any(r.get("floor_ms") for r in records)
    first = records[0] if records else {}
    table = Table(title=f"megamoe bench · {first.get('preset')} · EP {first.get('ep')} · "
                        f"{first.get('tokens_per_rank')} tokens/rank{_routing_text(first)} · {first.get('precision')} · "
                        f"{first.get('machine')}")
    columns = ["impl", "pass", "p50 ms", "p10–p90"]
    columns += [f"× vs {baseline}"] if base else []
    columns += ["TFLOP/s"] + (["× floor"] if with_floor else []) + ["cross GB/s", "rel err ≤ tol", "correct"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("impl", "pass", "correct") else "right")
    for r in records:
        ref = base.get((r["preset"], r["pass"], r["ep"]))
        speedup = ref / r["time_ms"] if ref and r["time_ms"] and not cpu else None
        cells = [r["impl"], r["pass"], f"{_p50(r):.3f}", f"{r['time_ms_p10']:.3f}–{r['time_ms_p90']:.3f}"]
        cells += [_fmt(speedup, ".2f")] if base else []
        cells += [_fmt(None if cpu else r["tflops"], ".3g")]
        cells += [_fmt(r.get("x_floor"), ".2f")] if with_floor else []
        cells += [_fmt(None if cpu else r["cross_gbps"], ".3g"), _error_cell(r),
                  "[green]yes[/green]" if r["correct"] else
                  f"[red]NO[/red]: {escape(r.get('failed') or str(r['worst_tensor']))}"]
        table.add_row(*cells)
    console.print(table)
    if not records:
        return
    say = partial(console.print, soft_wrap=True, markup=False, highlight=False)
    if cpu:
        say("CPU run: the Triton kernels ran under the interpreter, so these timings are not GPU timings (nor "
            "comparable between implementations): no speed ratio, TFLOP/s or GB/s is drawn from them (—).")
    say("columns:")
    say("  p50 ms, p10–p90: the median and the 10th–90th percentiles of the timed rounds, each round the slowest "
        "rank's time")
    if base:
        say(f"  × vs {baseline}: {baseline}'s p50 over this row's (> 1: faster than {baseline})")
    say("  TFLOP/s: the pass's FLOPs per rank (the mean over ranks; the backward twice the forward's) over p50")
    if with_floor:
        say("  × floor: time over max(FLOPs at the H200's sustained dense rate, cross-rank bytes at its NVLink "
            "rate), megamoe.bench.machine (— where no rate is measured)")
    else:
        say("  no × floor column: the floor (the pass's FLOPs and bytes at measured rates) is known for an "
            "H200 in BF16 only (megamoe.bench.machine)")
    say("  cross GB/s: the bytes of a rank's routes to other ranks' experts (dispatch and combine; the largest "
        "rank's) over p50 (— with one rank)")
    say("  rel err ≤ tol: sum|out − ref| / sum|ref| against the plain-PyTorch reference, the worst tensor (the "
        "output for fwd, every gradient for bwd and step) of the worst rank, and its bound")
    say("  correct: every tensor within every bound, with no NaN or inf; NO names the first check that failed")
    if any(r["impl"] == "reference" and r["pass"] == "bwd" for r in records):
        say("  reference bwd: its forward + backward minus its fwd time (its backward recomputes the forward)")
    for line in _tolerance_lines(records):
        say(line)
    say(f"{machine_line(_clock_range_of(records))}; commit {commit_text(first)}")
    for line in _run_notes(records):
        say(line)


def _run_notes(records: list[dict]) -> list[str]:
    """What the FP8 rows' weight quantisation costs (it runs once per optimizer step, outside their passes), and
    the passes whose timed rounds captured a CUDA graph (a device sync inside a timed pass)."""
    notes = [f"{r['impl']}: the routed weights quantised once before the passes, {r['weights_quantize_ms']:.3f} ms "
             f"(once per optimizer step, megamoe's with the backward's transposes; not in the pass times)"
             for r in records if r.get("weights_quantize_ms") is not None and r["pass"] == "fwd"]
    captured = {}  # pass: the graph captures in its timed rounds (the same for every record of the pass)
    for r in records:
        g = r.get("graphs_in_rounds") or {}
        if n := g.get("captures", 0) + g.get("backward_captures", 0):
            captured[r["pass"]] = n
    notes += [f"{name}: {n} CUDA graph capture(s) inside the timed rounds (a device sync each; the keys changed: "
              f"those rounds are not the steady state)" for name, n in captured.items()]
    return notes


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
    cpu = interpreted(records)  # the columns keep their places; the ratio and the rates are blank on the CPU
    base = {(r["preset"], r["pass"], r["ep"]): r["time_ms"] for r in records if r["impl"] == baseline and not cpu}
    lines = [
        f"# {first.get('preset')} · EP {first.get('ep')} · {first.get('tokens_per_rank')} tokens/rank"
        f"{_routing_text(first)} · {first.get('precision')}",
        "",
        f"- machine: {first.get('machine')}; commit: {commit_text(first)}; date: {first.get('date')}"
        + (f"; {machine_line(_clock_range_of(records))}" if records else ""),
        f"- command: `{_knobs_text(first)}{command}`",
        "",
        f"| impl | pass | ms (median) | p10–p90 | × vs {baseline} | TFLOP/s | cross GB/s | max abs | rel | correct "
        f"| × floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        ref = base.get((r["preset"], r["pass"], r["ep"]))
        lines.append(
            f"| {r['impl']} | {r['pass']} | {r['time_ms']:.3f} | {r['time_ms_p10']:.3f}–{r['time_ms_p90']:.3f} | "
            f"{_fmt(ref / r['time_ms'] if ref and r['time_ms'] else None, '.2f')} | "
            f"{_fmt(None if cpu else r['tflops'], '.1f')} | {_fmt(None if cpu else r['cross_gbps'], '.1f')} | {r['max_abs_err']:.2e} | {r['rel_err']:.2e} | {r['correct']} | "
            f"{_fmt(r.get('x_floor'), '.2f')} |"
        )
    notes = _run_notes(records)
    if cpu:
        notes.insert(0, "CPU run: the Triton kernels ran under the interpreter, so these timings are not GPU "
                        "timings: no ratio, TFLOP/s or GB/s is drawn from them (—)")
    lines += [""] + [f"- {note}" for note in notes] if notes else []
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
