"""One rank's wgrads reading d_out / x rows by token (gathered on load) against the routed copy first, one GPU.

    PYTHONPATH=src python3 benchmarks/wgrad_gather_ab.py [--shapes qwen3-30b-a3b,sonic-7b] [--rounds 5]
        [--seconds 0.3] [--out FILE.json]

At EP 1 the composed backward copies each routed row's d_out and x into expert order (two pulls: 0.79 ms of a
sonic-7b step's 4.51 ms busy time on an H100, benchmarks/results/2026-12-06-h100-graph-step) for the down and
gate/up weight gradients; with ``megamoe.ops.experts.GATHER_BACKWARD`` the Gluon wgrad's producer reads d_out by
token instead (cp.async; 2026-12-06-h100-wgrad-gather: on, in 64-row K steps). Per shape (the preset's D, I,
experts and k; each token routed to k distinct random experts, each expert's rows in token order as the schedule
lays them out) and per wgrad (down: ``d_out_rowsᵀ · act_w``, d_out gathered as A; gate/up: ``d_hᵀ · x_rows``, x
gathered as A of ``(x_rowsᵀ · d_h)ᵀ``, the blocks stored transposed; at 2026-12-06 it was gathered as B and ran
0.69-0.84x the copy + wgrad), the variants in interleaved rounds:

- ``copy + wgrad``: the rows copied (``index_select``, the pull's work) then the wgrad, as a pass runs them;
- ``wgrad``: the wgrad alone on copied rows (the floor a gather can reach);
- ``wgrad BK 64``: the same with 64-row K steps;
- ``gather``: the wgrad gathering on load at the pass's tile;
- ``gather BK 64``: the same with 64-row K steps (half the producer's steps per row; what a pass's gathering wgrad
  runs, ``megamoe.ops.expert_wgrad.gathering_wgrad_tile``).

Every gathering variant's gradient must equal the copied rows' bit for bit. TFLOP/s counts 2 x rows x M x N.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from megamoe import runtime
from megamoe.config import preset
from megamoe.ops import experts as expert_ops
from megamoe.ops.expert_wgrad import wgrad
from megamoe.planner.tiles import mean_rows
from megamoe.planner.tuning import DEFAULT_TUNING

from sustained import interleaved_rounds  # benchmarks/, beside this script

#: shape: (preset, tokens) — one GPU's fine-grained layers, where the pulls weigh most
SHAPES = {"qwen3-30b-a3b": ("qwen3-30b-a3b", 8192), "sonic-7b": ("sonic-7b", 24576)}
VARIANTS = ("copy + wgrad", "wgrad", "wgrad BK 64", "gather", "gather BK 64")


@dataclasses.dataclass
class Load:
    """One rank's routed rows: each expert's rows (in token order) and their tokens, and the wgrads' operands."""

    tokens: torch.Tensor  # int32 [R]: row r's token
    counts: torch.Tensor  # int32 [E]
    offsets: torch.Tensor  # int32 [E]
    d_out: torch.Tensor  # bf16 [T, D]
    x: torch.Tensor  # bf16 [T, D]
    act_w: torch.Tensor  # bf16 [R, I]
    d_h: torch.Tensor  # bf16 [R, 2I]


def make_load(t: int, d: int, i: int, experts: int, k: int, device, seed: int = 0) -> Load:
    g = torch.Generator(device=device).manual_seed(seed)
    top = torch.rand(t, experts, generator=g, device=device).topk(k, dim=1).indices  # k distinct experts a token
    order = torch.argsort(top.flatten(), stable=True)  # by expert, then token: the schedule's row order
    counts = torch.bincount(top.flatten(), minlength=experts).to(torch.int32)
    rows = t * k

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device).bfloat16()

    return Load((order // k).to(torch.int32), counts, (counts.cumsum(0) - counts).to(torch.int32), rand(t, d),
                rand(t, d), rand(rows, i), rand(rows, 2 * i))


def shape_args(doc: str, shapes: dict) -> argparse.Namespace:
    """The wgrad A/B tools' command line: ``--shapes`` (of ``shapes``), ``--rounds``, ``--seconds``, ``--out``."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(shapes), help=f"comma-separated, of {', '.join(shapes)}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def shape_loads(args: argparse.Namespace, shapes: dict, device):
    """``(shape, tokens, layer config, Load)`` of each of ``args.shapes``: one rank's routed rows at EP 1."""
    for shape in args.shapes.split(","):
        name, t = shapes[shape]
        cfg = preset(name)
        yield shape, t, cfg, make_load(t, cfg.hidden, cfg.intermediate, cfg.num_experts, cfg.top_k, device)


def write_results(out: str | None, results: list) -> None:
    """The rounds' records as JSON at ``out`` (when given), with the device's name."""
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "results": results}, f, indent=1)


def variant_calls(load: Load, device) -> tuple[dict, dict, dict]:
    """({variant: {wgrad: call}}, {variant: {wgrad: output}}, {wgrad: flops}): each call writes its output."""
    rows, experts = load.tokens.shape[0], load.counts.shape[0]
    d, i = load.x.shape[1], load.act_w.shape[1]
    tile = DEFAULT_TUNING.tile("wgrad", device, mean_rows(rows, experts, None))
    programs = runtime.num_programs(device)
    long = load.tokens.long()
    copied = {"down": load.d_out[long], "gate_up": load.x[long]}
    outs = {v: {"down": torch.empty(experts, d, i, dtype=torch.bfloat16, device=device),
                "gate_up": torch.empty(experts, 2 * i, d, dtype=torch.bfloat16, device=device)} for v in VARIANTS}

    def copy_then(kind, out):
        source = load.d_out if kind == "down" else load.x
        rows_in_order = torch.index_select(source, 0, long, out=copied[kind])
        run(kind, out, rows_in_order, None, tile)

    def run(kind, out, rows_in_order, index, t):
        if kind == "down":  # d_W_down[l] = d_out_rowsᵀ · act_w: A is d_out's rows
            source = load.d_out if index is not None else rows_in_order
            wgrad(source, load.act_w, out, load.offsets, load.counts, t, programs, a_index=index)
        else:  # d_W_gate_up[l] = d_hᵀ · x_rows: B is x's rows
            source = load.x if index is not None else rows_in_order
            wgrad(load.d_h, source, out, load.offsets, load.counts, t, programs, b_index=index)

    calls = {v: {} for v in VARIANTS}
    for kind in ("down", "gate_up"):
        calls["copy + wgrad"][kind] = lambda kind=kind: copy_then(kind, outs["copy + wgrad"][kind])
        calls["wgrad"][kind] = lambda kind=kind: run(kind, outs["wgrad"][kind], copied[kind], None, tile)
        calls["wgrad BK 64"][kind] = lambda kind=kind: run(kind, outs["wgrad BK 64"][kind], copied[kind], None,
                                                           dataclasses.replace(tile, block_k=64))
        calls["gather"][kind] = lambda kind=kind: run(kind, outs["gather"][kind], None, load.tokens, tile)
        calls["gather BK 64"][kind] = lambda kind=kind: run(kind, outs["gather BK 64"][kind], None, load.tokens,
                                                            dataclasses.replace(tile, block_k=64))
    flops = {"down": 2 * rows * d * i, "gate_up": 2 * rows * 2 * i * d}
    return calls, outs, flops


def main() -> None:
    args = shape_args(__doc__, SHAPES)
    device = torch.device("cuda")
    expert_ops.GATHER_BACKWARD = True  # the gathering variants gather (the copied ones pass no index)
    results = []
    for shape, t, _, load in shape_loads(args, SHAPES, device):
        calls, outs, flops = variant_calls(load, device)
        for kind in ("down", "gate_up"):
            for v in VARIANTS:  # once each: compiles, and the outputs to compare
                calls[v][kind]()
            want = outs["copy + wgrad"][kind]
            same = {v: bool(torch.equal(outs[v][kind], want)) for v in VARIANTS}
            times = interleaved_rounds({v: calls[v][kind] for v in VARIANTS}, args.rounds, args.seconds)
            base = statistics.median(times["copy + wgrad"])
            for v in VARIANTS:
                ms = statistics.median(times[v])
                results.append({"shape": shape, "tokens": t, "wgrad": kind, "variant": v, "ms": ms,
                                "rounds_ms": times[v], "tflops": flops[kind] / ms / 1e9,
                                "x_copy_then_wgrad": base / ms, "same_bits": same[v]})
    write_results(args.out, results)
    print("| shape | wgrad | variant | ms | TFLOP/s | x copy + wgrad | same bits |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['shape']} | {r['wgrad']} | {r['variant']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
              f"{r['x_copy_then_wgrad']:.2f} | {r['same_bits']} |")


if __name__ == "__main__":
    main()
