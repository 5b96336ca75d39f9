"""Back-to-back calls for a while: what the power-cap tools (the per-SM tools, gemm_vs_dense.py, tiles_ab.py) time."""

from __future__ import annotations

import statistics
import time

import torch


def run_for(fn, seconds: float, group: int) -> tuple[float, float, int]:
    """Call ``fn`` in groups of ``group`` (a device sync after each) until ``seconds`` have passed; returns
    (wall-clock start, end, calls)."""
    torch.cuda.synchronize()
    start, calls = time.time(), 0
    while time.time() - start < seconds:
        for _ in range(group):
            fn()
        calls += group
        torch.cuda.synchronize()
    return start, time.time(), calls


def interleaved_rounds(calls: dict, rounds: int, seconds: float, group: int = 4) -> dict[str, list[float]]:
    """ms per call of each of ``calls`` ({name: fn}) in ``rounds`` rounds, every round running each for
    ``seconds`` back to back, after a first round that only warms up: candidates timed one after another drift
    as the GPU heats toward its power cap, interleaved ones drift together."""
    times = {name: [] for name in calls}
    for r in range(rounds + 1):
        for name, fn in calls.items():
            start, end, n = run_for(fn, seconds, group)
            if r:
                times[name].append(1e3 * (end - start) / n)
    return times


def rounds_table(times: dict[str, list[float]], flops: float, same: dict[str, bool], baseline: str) -> str:
    """:func:`interleaved_rounds`' result as a Markdown table: each variant's median ms, its range, TFLOP/s at
    ``flops`` a call, and whether it gave ``baseline``'s bits (``same``)."""
    lines = [f"| variant | ms (median) | min-max | TFLOP/s | same bits as {baseline} |", "|---|---|---|---|---|"]
    for name, ts in times.items():
        med = statistics.median(ts)
        lines.append(f"| {name} | {med:.3f} | {min(ts):.3f}-{max(ts):.3f} | {flops / med / 1e9:.0f} | {same[name]} |")
    return "\n".join(lines)
