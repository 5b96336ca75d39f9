"""A megakernel pass on a per-SM timeline: record it (TRACE build, GPU), convert it (Perfetto / Chrome JSON, PNG).

:func:`record_rank` runs forward passes of one preset with the kernel's TRACE build and returns the last pass's
record: for every program its SM, role (communication or compute worker), start and end, and its event log
(each task and each wait that spun, with what it waited for; `megamoe.kernels.sync`). :func:`chrome_trace`
turns a record into a Chrome trace (one process per rank, one track per program: open it in
https://ui.perfetto.dev), :func:`timeline_png` into a picture, :func:`summary` into a table. Records are plain
JSON (gzipped when the name ends in .gz), so a trace recorded on a GPU converts anywhere.
"""

from __future__ import annotations

import gzip
import json
import math
import time
from collections import Counter

import torch

from megamoe.kernels import sync

FORMAT = "megamoe-trace/1"

#: Task kinds of the event log, by code: (name on the timeline, category).
TASKS = {
    sync.TRACE_KIND_GATE_UP.value: ("gate/up + SwiGLU", "gate_up"),
    sync.TRACE_KIND_DOWN.value: ("down", "down"),
    sync.TRACE_KIND_SHARED_GATE_UP.value: ("shared gate/up", "shared"),
    sync.TRACE_KIND_SHARED_DOWN.value: ("shared down", "shared"),
    sync.TRACE_KIND_PULL.value: ("pull rows", "pull"),
    sync.TRACE_KIND_PUSH.value: ("push rows home", "push"),
    # the backward megakernel's
    sync.TRACE_KIND_BWD_PULL.value: ("pull d_out and x rows", "pull"),
    sync.TRACE_KIND_DACT.value: ("dact + SwiGLU backward", "dact"),
    sync.TRACE_KIND_DX.value: ("dx", "dx"),
    sync.TRACE_KIND_SHARED_DACT.value: ("shared dact", "shared"),
    sync.TRACE_KIND_SHARED_DX.value: ("shared dx", "shared"),
    sync.TRACE_KIND_WGRAD.value: ("weight gradient block", "wgrad"),
}
#: Colours of the PNG's categories (waits last, drawn in grey).
COLOURS = {"gate_up": "#1f77b4", "down": "#2ca02c", "dact": "#17becf", "dx": "#bcbd22", "wgrad": "#8c564b",
           "shared": "#9467bd", "pull": "#ff7f0e", "push": "#d62728", "wait": "#b0b0b0"}


def decode(trace: torch.Tensor, comm_sms: int) -> list[dict]:
    """Each program's row of a TRACE buffer (`[programs, TRACE_ROW]` int64) as a dict; times in ns from the
    earliest start of any program."""
    t = trace.cpu().tolist()
    origin = min(row[sync.TRACE_START.value] for row in t)
    programs = []
    for p, row in enumerate(t):
        logged = row[sync.TRACE_EVENTS.value]
        kept = min(logged, sync.TRACE_MAX_EVENTS.value)
        base, words = sync.TRACE_FIELDS.value, sync.TRACE_EVENT_WORDS.value
        events = [row[base + e * words: base + (e + 1) * words] for e in range(kept)]
        shared_end = row[sync.TRACE_SHARED_END.value]
        programs.append({
            "program": p, "sm": row[sync.TRACE_SM.value], "role": "comm" if p < comm_sms else "compute",
            "start": row[sync.TRACE_START.value] - origin, "end": row[sync.TRACE_END.value] - origin,
            "shared_end": shared_end - origin if shared_end else None,
            "wait_ns": row[sync.TRACE_WAIT_NS.value], "waits": row[sync.TRACE_WAITS.value],
            "dropped": logged - kept,
            "events": sorted([start - origin, end - origin, kind, detail] for start, end, kind, detail in events),
        })
    return programs


def record_rank(world, preset_name: str, tokens: int, precision: str = "bf16", passes: int = 3,
                steady_s: float = 0.0) -> dict:
    """``passes`` forward passes of ``preset_name`` at ``tokens`` per rank with the TRACE build (GPU; one rank runs
    the megakernel too), then as many more back to back as fill ``steady_s`` seconds at the last one's pace, a
    count every rank agrees on (the GPU at its power cap, as in training: a pass traced right after the first ones
    runs at a clock it will not hold; one that ran into the cap while being traced slowed 20 % midway,
    benchmarks/results/2026-12-04-megakernel-stages); the last pass's record of this rank, with the task counts
    the schedule implied."""
    from megamoe.bench.problem import make_problem
    from megamoe.config import preset
    from megamoe.megakernel import MegaKernel, fuse_shared
    from megamoe.planner import LayerShape

    if world.device.type != "cuda":
        raise RuntimeError("the TRACE build runs on a CUDA GPU (it reads the GPU's globaltimer)")
    cfg = preset(preset_name)
    p = make_problem(cfg, world.rank, world.size, tokens, dtype=torch.bfloat16, device=world.device)
    fused = fuse_shared(p.shared)
    kernel = MegaKernel(world, LayerShape.of(cfg, world.size, tokens), precision=precision, trace=True,
                        one_rank_megakernel=True, replay=False)

    def one_pass():
        ctx = kernel.forward(p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, fused, cfg.activation,
                             buffers=kernel.scratch_buffers())[1]
        torch.cuda.synchronize()  # the host never runs far ahead of the clock
        return ctx

    for _ in range(passes):
        start = time.perf_counter()
        ctx = one_pass()
    # the steady passes by count, the same on every rank (each pass meets the others at its barriers)
    per_pass = time.perf_counter() - start
    steady = max(world.all_gather_object(math.ceil(steady_s / per_pass))) if steady_s > 0 else 0
    for _ in range(steady):
        ctx = one_pass()
    c = kernel.config
    gate_up, down = kernel.tiles()
    tiles = int(ctx.row_tiles.num_tiles.item())
    batches = -(-int(ctx.schedule.num_rows.item()) // c.minibatch)
    return {"rank": world.rank, "programs": decode(kernel.trace, c.comm_sms), "passes": passes + steady,
            "expected": {"gate/up + SwiGLU": tiles * -(-cfg.intermediate // gate_up.block_n),
                         "down": tiles * -(-cfg.hidden // down.block_n),
                         "pull rows": c.comm_sms * batches, "push rows home": c.comm_sms * batches},
            "config": {"num_sms": c.num_sms, "comm_sms": c.comm_sms, "minibatch": c.minibatch,
                       "ring_rows": c.ring_rows}}


def new_record(ranks: list[dict], preset_name: str, tokens: int, precision: str, machine: str = "") -> dict:
    """The record of a traced pass over ``ranks`` (what :func:`record_rank` returned on each)."""
    return {"format": FORMAT, "preset": preset_name, "tokens": tokens, "precision": precision, "machine": machine,
            "ranks": sorted(ranks, key=lambda r: r["rank"])}


def save(record: dict, path: str) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt") as f:
        json.dump(record, f, separators=(",", ":"))


def load(path: str) -> dict:
    """A record written by :func:`save`; ValueError if the file is not one."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a megamoe trace record ({exc})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{path}: not a megamoe trace record (format {FORMAT!r} expected)")
    return record


def event_name(kind: int) -> tuple[str, str]:
    """(name, category) of an event kind: a task, or a wait named by the counter it waited on."""
    if kind in TASKS:
        return TASKS[kind]
    from megamoe.megakernel.kernel import WAITS

    return f"wait: {WAITS.get(kind, f'counter {kind}')}", "wait"


def _args(kind: int, detail: int) -> dict:
    if kind in (sync.TRACE_KIND_PULL.value, sync.TRACE_KIND_PUSH.value, sync.TRACE_KIND_BWD_PULL.value):
        return {"minibatch": detail}
    if kind == sync.TRACE_KIND_WGRAD.value:
        return {"block": detail}
    if kind in TASKS:
        return {"tile": detail >> 16, "n": detail & 0xFFFF}
    return {"index": detail}


def chrome_trace(record: dict) -> dict:
    """The Chrome / Perfetto trace of a record: a process per rank, a track per program (comm workers first),
    a complete event per task and per wait (µs), the program's whole run as the outer span."""
    events = []
    for r in record["ranks"]:
        rank = r["rank"]
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for prog in r["programs"]:
            tid = prog["program"]
            label = f"{prog['role']} {tid} (SM {prog['sm']})"
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": label}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
            events.append({"ph": "X", "name": f"{prog['role']} worker", "cat": "program", "pid": rank, "tid": tid,
                           "ts": prog["start"] / 1e3, "dur": max(prog["end"] - prog["start"], 0) / 1e3,
                           "args": {"wait_ms": prog["wait_ns"] / 1e6, "waits": prog["waits"],
                                    "dropped_events": prog["dropped"]}})
            for start, end, kind, detail in prog["events"]:
                name, cat = event_name(kind)
                events.append({"ph": "X", "name": name, "cat": cat, "pid": rank, "tid": tid, "ts": start / 1e3,
                               "dur": max(end - start, 0) / 1e3, "args": _args(kind, detail)})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {k: record[k] for k in ("preset", "tokens", "precision", "machine")}}


def summary(record: dict) -> list[dict]:
    """Per rank and role: programs, the pass's end (ms, max), and ms per program in each category (mean)."""
    rows = []
    for r in record["ranks"]:
        for role in ("comm", "compute"):
            progs = [p for p in r["programs"] if p["role"] == role]
            if not progs:
                continue
            busy = Counter()
            for p in progs:
                for start, end, kind, _ in p["events"]:
                    busy[event_name(kind)[1]] += end - start
            rows.append({"rank": r["rank"], "role": role, "programs": len(progs),
                         "end_ms": max(p["end"] for p in progs) / 1e6,
                         **{f"{cat}_ms": busy[cat] / len(progs) / 1e6 for cat in COLOURS if busy[cat]},
                         "dropped_events": sum(p["dropped"] for p in progs)})
    return rows


def timeline_png(record: dict, path: str, rank: int = 0) -> str | None:
    """One rank's programs as horizontal lanes (comm workers at the top), each task and wait a bar; returns why
    not (matplotlib missing), else None."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return f"matplotlib is not installed: no timeline written to {path} (pip install matplotlib)"

    r = next(r for r in record["ranks"] if r["rank"] == rank)
    programs = r["programs"]
    fig, ax = plt.subplots(figsize=(13, max(4.0, 0.045 * len(programs) + 1.5)), dpi=110)
    present = set()
    for lane, prog in enumerate(programs):
        bars = {cat: [] for cat in COLOURS}
        for start, end, kind, _ in prog["events"]:
            bars[event_name(kind)[1]].append((start / 1e6, max(end - start, 1) / 1e6))
        for cat, spans in bars.items():
            if spans:
                present.add(cat)
                ax.broken_barh(spans, (lane - 0.4, 0.8), facecolors=COLOURS[cat], linewidth=0)
    comm = sum(p["role"] == "comm" for p in programs)
    if comm:
        ax.axhline(comm - 0.5, color="black", linewidth=0.6)
    ax.set_ylim(len(programs) - 0.5, -0.5)
    ax.set_xlim(0, max(p["end"] for p in programs) / 1e6 * 1.01)
    ax.set_xlabel("ms from the first program's start")
    ax.set_ylabel(f"program ({comm} comm workers on top)")
    ax.set_title(f"megamoe forward megakernel, {record['preset']} {record['tokens']} tokens per rank, "
                 f"{record['precision']}, rank {rank} of {len(record['ranks'])}" +
                 (f" ({record['machine']})" if record.get("machine") else ""), fontsize=10)
    shown = [(n, c) for n, c in COLOURS.items() if n in present]
    ax.legend(handles=[Patch(color=c, label=n) for n, c in shown], loc="upper center", fontsize=8,
              ncol=max(len(shown), 1), bbox_to_anchor=(0.5, -0.07 * 6 / fig.get_figheight()), frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None
