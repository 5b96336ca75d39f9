"""Expert forward tiles A against B at the power cap: interleaved rounds of sustained calls, one GPU.

    PYTHONPATH=src python3 benchmarks/tiles_ab.py --preset kimi-k2 --experts 384 [--rounds 6] [--seconds 0.5]
        [--precision bf16|fp8-block|mxfp8]

A sweep that times candidates one after another drifts: under sustained GEMMs an H200 sits at its 700 W
cap and its SM clock falls from 1980 to ~1400 MHz over the first second (benchmarks/results/2026-11-30-replay,
clock_probe), so later candidates run hotter. Here every round runs each variant for --seconds back to back,
after a first round that only warms up, and the table gives each variant's median ms over the rounds. Variants:
128-row tiles (8 warps) and 64-row tiles (one warpgroup) for gate/up and down, in BF16, FP8-block or MXFP8
(operands quantised once, untimed), and on Hopper the 128-row tiles with ``SKIP_EMPTY_HALF`` (a tile of at most
64 rows in one warpgroup) and in BF16 128-row tiles with down in the warp-specialised Gluon kernel (cooperative, in
ping-pong, the deepest ping-pong with ``SKIP_EMPTY_HALF`` too); every variant's output is compared with the
first's.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from megamoe import runtime
from megamoe.bench.experts import make_load
from megamoe.config import preset
from megamoe.megakernel.buffers import scale_dtype
from megamoe.ops import experts as expert_ops
from megamoe.ops.experts import ExpertForward, expert_forward, forward_ws, gate_up, warp_specialized_forward
from megamoe.ops.experts_fp8 import ExpertForwardQuantized, expert_forward_fp8_block
from megamoe.ops.experts_mxfp8 import expert_forward_mxfp8
from megamoe.ops.quant import quantize_activations, quantize_weights
from megamoe.planner.tiles import TileConfig
from megamoe.planner.tuning import Tuning
from megamoe.precision import SCALE_BLOCK

from sustained import interleaved_rounds, rounds_table  # benchmarks/, beside this script

BF16_128 = {"gate_up": TileConfig(128, 128, 64, 8, 3, 4), "down": TileConfig(128, 256, 64, 8, 3, 8, True)}
BF16_64 = {"gate_up": TileConfig(64, 128, 64, 4, 4, 8), "down": TileConfig(64, 256, 64, 4, 4, 8, True)}
FP8_128 = {"gate_up": TileConfig(128, 128, 128, 8, 3, 4), "down": TileConfig(128, 128, 128, 8, 4, 8)}
# one warpgroup: a 64x128 product per K step beside its 64x128 accumulator (64 + 64 registers a thread)
FP8_64 = {"gate_up": TileConfig(64, 128, 128, 4, 4, 8), "down": TileConfig(64, 128, 128, 4, 4, 8)}
MX_128 = {"gate_up": TileConfig(128, 64, 64, 8, 3, 4), "down": TileConfig(128, 128, 64, 8, 3, 8)}  # the planner's
MX_64 = {"gate_up": TileConfig(64, 64, 64, 4, 4, 8), "down": TileConfig(64, 128, 64, 4, 4, 8)}
PING_PONG_STAGES = (4, 5, 6)  # ping-pong needs a ring deep enough to cover a hand-over (2026-12-04-forward-ping-pong)


def variants(big: dict, small: dict) -> dict[str, dict]:
    """128-row tiles, 64-row gate/up, 64-row down, 64-row both."""
    return {"128-row": big, "64-row gate/up": {**big, "gate_up": small["gate_up"]},
            "64-row down": {**big, "down": small["down"]}, "64-row both": small}


VARIANTS = {"bf16": variants(BF16_128, BF16_64), "fp8-block": variants(FP8_128, FP8_64),
            "mxfp8": variants(MX_128, MX_64)}
FORWARD = {"fp8-block": expert_forward_fp8_block, "mxfp8": expert_forward_mxfp8}


def quantized_call(fmt: str, x, counts, offsets, wgu, wd):
    """A function of (out, tiles) that runs ``fmt``'s expert forward on operands quantised here, once, and a
    function making NaN-poisoned outputs (the E4M3 act is fully written by any tile shape)."""
    rows, i, d = x.shape[0], wd.shape[2], wd.shape[1]
    operands = (*quantize_activations(x, fmt), counts, offsets, *quantize_weights(wgu, fmt), *quantize_weights(wd, fmt))

    def make_out():
        nan = float("nan")
        return ExpertForwardQuantized(
            torch.full((rows, 2 * i), nan, dtype=torch.bfloat16, device=x.device),
            torch.empty(rows, i, dtype=torch.float8_e4m3fn, device=x.device),
            torch.zeros(rows, i // SCALE_BLOCK[fmt], dtype=scale_dtype(fmt), device=x.device).fill_(
                nan if scale_dtype(fmt).is_floating_point else 0xFF),
            torch.full((rows, d), nan, dtype=torch.bfloat16, device=x.device))

    return (lambda out, tiles: FORWARD[fmt](*operands, out=out, tuning=Tuning(**tiles))), make_out


def skipping_empty_halves(call):
    """``call`` run with ``megamoe.ops.experts.SKIP_EMPTY_HALF`` on (read at each launch), then off again."""
    def run():
        expert_ops.SKIP_EMPTY_HALF = True
        try:
            call()
        finally:
            expert_ops.SKIP_EMPTY_HALF = False
    return run


def variant_calls(precision: str, x, counts, offsets, wgu, wd) -> tuple[dict, dict]:
    """{variant: fn} of ``precision``'s tile variants on one load, each called once, and {variant: its y}; on
    Hopper the 128-row tiles also with ``SKIP_EMPTY_HALF`` (a tile of at most 64 rows in one warpgroup: the Gluon
    gate/up, FP8's down too), and BF16's "Gluon down": 128-row tiles with down in the warp-specialised Gluon kernel
    (gate/up's; the library runs down in Triton: 2 % faster on kimi-k2's 341-row experts), and that kernel in
    ping-pong (whole 128 x 128 tiles a warpgroup, in turn) at PING_PONG_STAGES ring depths, with and without
    ``SKIP_EMPTY_HALF``."""
    expert_ops.SKIP_EMPTY_HALF = False  # the other variants' switch, whatever the environment's
    rows, i, d = x.shape[0], wd.shape[2], wd.shape[1]
    quantized = quantized_call(precision, x, counts, offsets, wgu, wd) if precision in FORWARD else None
    outs, calls = {}, {}
    for name, tiles in VARIANTS[precision].items():
        if quantized is None:
            out = ExpertForward(*(torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=x.device)
                                  for n in (2 * i, i, d)))
            call = (lambda out=out, tiles=tiles: expert_forward(x, counts, offsets, wgu, wd, out=out, tuning=Tuning(**tiles)))
        else:
            forward, make_out = quantized
            out = make_out()
            call = (lambda out=out, tiles=tiles: forward(out, tiles))
        calls[name] = call
        call()
        outs[name] = out.y
        if name == "128-row" and precision != "mxfp8" and warp_specialized_forward(x.device, BF16_128["gate_up"]):
            out = make_out() if quantized is not None else ExpertForward(
                *(torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=x.device) for n in (2 * i, i, d)))
            call = skipping_empty_halves((lambda out=out, tiles=tiles: expert_forward(
                x, counts, offsets, wgu, wd, out=out, tuning=Tuning(**tiles))) if quantized is None else (
                lambda out=out, tiles=tiles: quantized[0](out, tiles)))
            calls["128-row, empty halves skipped"] = call
            call()
            outs["128-row, empty halves skipped"] = out.y
    down_tile = BF16_128["down"]
    if precision == "bf16" and warp_specialized_forward(x.device, down_tile):
        out = ExpertForward(*(torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=x.device)
                              for n in (2 * i, i, d)))
        programs = runtime.num_programs(x.device)

        def gluon_down(out=out):
            gate_up(x, counts, offsets, wgu, out.h, out.act, tuning=Tuning(gate_up=BF16_128["gate_up"]))
            forward_ws(out.act, wd, out.y, counts, offsets, down_tile, programs)
        calls["Gluon down"] = gluon_down
        gluon_down()
        outs["Gluon down"] = out.y
        for stages in PING_PONG_STAGES:  # whole 128 x 128 tiles a warpgroup, in turn
            out = ExpertForward(*(torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=x.device)
                                  for n in (2 * i, i, d)))
            pp_tile = dataclasses.replace(down_tile, block_n=128)

            def ping_pong(out=out, stages=stages, pp_tile=pp_tile):
                gate_up(x, counts, offsets, wgu, out.h, out.act, tuning=Tuning(gate_up=BF16_128["gate_up"]))
                forward_ws(out.act, wd, out.y, counts, offsets, pp_tile, programs, stages=stages, ping_pong=True)
            name = f"Gluon down ping-pong, {stages} stages"
            calls[name] = ping_pong
            ping_pong()
            outs[name] = out.y
            if stages == PING_PONG_STAGES[-1]:
                out = ExpertForward(*(torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=x.device)
                                      for n in (2 * i, i, d)))
                skipping = skipping_empty_halves(lambda out=out, stages=stages, pp_tile=pp_tile: ping_pong(
                    out, stages, pp_tile))
                calls[f"{name}, empty halves skipped"] = skipping
                skipping()
                outs[f"{name}, empty halves skipped"] = out.y
    return calls, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--precision", choices=tuple(VARIANTS), default="bf16")
    a = parser.parse_args()
    cfg = preset(a.preset)
    device = torch.device("cuda")
    x, counts, offsets, wgu, wd = make_load(a.experts, a.tokens * cfg.top_k, cfg.hidden, cfg.intermediate, device)
    rows, d, i = x.shape[0], cfg.hidden, cfg.intermediate
    calls, outs = variant_calls(a.precision, x, counts, offsets, wgu, wd)
    first = next(iter(outs.values()))
    same = {name: bool(torch.equal(y, first)) for name, y in outs.items()}
    times = interleaved_rounds(calls, a.rounds, a.seconds)
    flops = 6 * rows * d * i
    print(f"{a.preset} {a.precision}, {a.experts} experts x ~{rows // a.experts} rows, {a.rounds} rounds of "
          f"{a.seconds} s each")
    print(rounds_table(times, flops, same, "128-row"))


if __name__ == "__main__":
    main()
