"""The command line that the megakernel's per-pass tools share (trace, profile)."""

from __future__ import annotations

import argparse

from megamoe.plan import KernelConfig


def parse(doc: str) -> tuple[argparse.Namespace, KernelConfig | None]:
    """(--preset, --tokens, --passes, --out) and the KernelConfig from --config, or None for the planner's."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--config", default=None, help="num_sms,comm_sms,minibatch,ring_rows (default: the planner's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    return args, KernelConfig(*map(int, args.config.split(",")), 128, 256) if args.config else None
