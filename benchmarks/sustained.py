"""Back-to-back calls for a while: what the power-cap tools (clock_probe.py, tiles_ab.py) time."""

from __future__ import annotations

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
