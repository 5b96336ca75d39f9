"""The command line that the megakernel's per-pass tools share (trace, profile)."""

from __future__ import annotations

import argparse

from megamoe.megakernel import default_config
from megamoe.planner import KernelConfig, LayerShape
from megamoe.precision import PRECISIONS


def parse(doc: str, argv: list[str] | None = None) -> argparse.Namespace:
    """(--preset, --tokens, --passes, --config, --precision, --out); `config_for` turns them into the pass's
    KernelConfig on a rank."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--config", default=None, help="num_sms,comm_sms,minibatch,ring_rows (default: the planner's)")
    parser.add_argument("--precision", default="bf16", choices=PRECISIONS)
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def config_for(args: argparse.Namespace, world, shape: LayerShape) -> KernelConfig:
    """--config, or the planner's config for this precision."""
    if args.config:
        return KernelConfig(*map(int, args.config.split(",")), 128, 256)
    return default_config(world, shape, args.precision)
