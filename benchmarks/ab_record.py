"""What the interleaved A/B tools (megakernel_ab, backward_ab) do with their result: write it, print its table."""

from __future__ import annotations

import json
import os


def write_and_print(result: dict, out: str, title: str) -> None:
    """``result`` (median_ms, rounds_ms, configs, bitwise_equal by variant) as JSON at ``out`` (when given) and
    a Markdown table under ``title``."""
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print(title)
    print("| variant | config | median | rounds | same bits |")
    print("|---|---|---|---|---|")
    for name, ms in result["median_ms"].items():
        rounds = " ".join(f"{v:.2f}" for v in result["rounds_ms"][name])
        print(f"| {name} | {result['configs'][name]} | {ms:.2f} | {rounds} | {result['bitwise_equal'][name]} |")
