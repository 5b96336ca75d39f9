"""The FP8-block backward's weight gradients against BF16 wgrads of the same rows, one GPU: which pays at a shape.

    PYTHONPATH=src python3 benchmarks/fp8_wgrad_ab.py [--shapes deepseek-v3,kimi-k2,qwen3-30b-a3b] [--rounds 5]

The FP8-block backward (``megamoe.ops.experts_fp8_bwd``) quantises four operands along each expert's tokens and runs
the FP8 wgrad: d_out's E4M3 rows (as pulled, dequantised and quantised again), act·w and d_h (BF16, from the dact),
x's E4M3 rows (the forward's ring, again). On one H100 at deepseek-v3 (255 rows an expert) its two wgrads took
13.1 ms and those quantisers ~2.2 ms of a 31.3 ms backward (benchmarks/results/2026-12-06-h100-step-gathers-wsum),
where the BF16 step's wgrads took ~11 ms (2026-12-05-step-timeline): at a few K steps a block, the FP8 wgrad's
per-step promotion and its block's store may cost more than its MMAs save. Per shape and wgrad (down:
``d_outᵀ · act_w``, gate/up: ``d_hᵀ · x``), in interleaved rounds:

- ``fp8: quantise + wgrad``: what the FP8-block backward runs (both token-axis quantisers, then the FP8 wgrad);
- ``fp8 wgrad``: the FP8 wgrad alone on operands quantised beforehand;
- ``bf16 wgrad, rows by token``: the BF16 wgrad reading one rank's BF16 d_out / x by token (on Hopper gathered
  on load, as the BF16 backward does with ``GATHER_BACKWARD``), nothing quantised;
- ``write floor``: the gradient's bytes zero-filled (each wgrad writes them once).

Each variant's gradient against the FP32 product of the BF16 rows (``rel``: the Frobenius norm of the error over
the reference's, every expert): the BF16 wgrad's rows are the originals, the FP8 ones quantised twice. The
gradients of one wgrad share one buffer (a kimi-k2 gate/up gradient is 22.5 GB), each checked after its first run.
"""

from __future__ import annotations

import statistics

import torch

from megamoe import runtime
from megamoe.ops import experts as expert_ops
from megamoe.ops.comm import QuantRows
from megamoe.ops.expert_wgrad import wgrad
from megamoe.ops.experts_fp8_bwd import quantize_tokens, token_blocks, wgrad_fp8
from megamoe.ops.quant import quantize_activations
from megamoe.planner.tiles import mean_rows
from megamoe.planner.tuning import DEFAULT_TUNING

from sustained import interleaved_rounds  # benchmarks/, beside this script
from wgrad_gather_ab import shape_args, shape_loads, write_results  # one rank's routed rows, the CLI, the record

#: shape: (preset, tokens) at EP 1
SHAPES = {"deepseek-v3": ("deepseek-v3", 8192), "kimi-k2": ("kimi-k2", 8192),
          "qwen3-30b-a3b": ("qwen3-30b-a3b", 8192)}
VARIANTS = ("fp8: quantise + wgrad", "fp8 wgrad", "bf16 wgrad, rows by token", "write floor")


def variant_calls(load, kind: str, out: torch.Tensor, device) -> tuple[dict, int]:
    """({variant: call}, flops) of one wgrad (``kind``: down or gate_up), every call writing ``out``."""
    rows, experts = load.tokens.shape[0], load.counts.shape[0]
    long = load.tokens.long()
    programs = runtime.num_programs(device)
    per_expert = mean_rows(rows, experts, None)
    bf16_tile = DEFAULT_TUNING.tile("wgrad", device, per_expert)
    fp8_tile = DEFAULT_TUNING.tile("wgrad", device, fmt="fp8-block")
    blocks = token_blocks(load.counts, load.offsets, rows)
    # the FP8 backward's operands: the token's E4M3 row (pulled d_out, the forward ring's x) and the BF16 dact outputs
    source = load.d_out if kind == "down" else load.x
    pulled = QuantRows(*quantize_activations(source[long], "fp8-block"), "fp8-block")
    a, b = (pulled, load.act_w) if kind == "down" else (load.d_h, pulled)

    def quantised():
        return (*quantize_tokens(a, blocks), *quantize_tokens(b, blocks))

    ready = quantised()

    def fp8(operands):
        wgrad_fp8(*operands, out, blocks, load.counts, fp8_tile, programs)

    def bf16():
        if kind == "down":
            wgrad(load.d_out, load.act_w, out, load.offsets, load.counts, bf16_tile, programs, a_index=load.tokens)
        else:
            wgrad(load.d_h, load.x, out, load.offsets, load.counts, bf16_tile, programs, b_index=load.tokens)

    calls = {"fp8: quantise + wgrad": lambda: fp8(quantised()), "fp8 wgrad": lambda: fp8(ready),
             "bf16 wgrad, rows by token": bf16, "write floor": out.zero_}
    m, n = out.shape[1], out.shape[2]
    return calls, 2 * rows * m * n


def relative_error(load, kind: str, out: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over every expert, ref the FP32 product of the BF16 rows (expert by expert)."""
    long = load.tokens.long()
    err = ref_norm = 0.0
    for e, (start, count) in enumerate(zip(load.offsets.tolist(), load.counts.tolist())):
        rows = slice(start, start + count)
        if kind == "down":
            ref = load.d_out[long[rows]].float().T @ load.act_w[rows].float()
        else:
            ref = load.d_h[rows].float().T @ load.x[long[rows]].float()
        err += float((out[e].float() - ref).square().sum())
        ref_norm += float(ref.square().sum())
    return (err / max(ref_norm, 1e-30)) ** 0.5


def main() -> None:
    args = shape_args(__doc__, SHAPES)
    device = torch.device("cuda")
    expert_ops.GATHER_BACKWARD = True  # the BF16 wgrad reads the rows by token, as one rank's backward does
    results = []
    for shape, t, cfg, load in shape_loads(args, SHAPES, device):
        for kind in ("down", "gate_up"):
            d, i = cfg.hidden, cfg.intermediate
            out = torch.empty((cfg.num_experts, d, i) if kind == "down" else (cfg.num_experts, 2 * i, d),
                              dtype=torch.bfloat16, device=device)
            calls, flops = variant_calls(load, kind, out, device)
            rel = {}
            for v, call in calls.items():  # once each: compiles, and the gradient checked
                out.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                rel[v] = None if v == "write floor" else relative_error(load, kind, out)
            times = interleaved_rounds(calls, args.rounds, args.seconds)
            floor = statistics.median(times["write floor"])
            for v in VARIANTS:
                ms = statistics.median(times[v])
                results.append({"shape": shape, "tokens": t, "wgrad": kind, "variant": v, "ms": ms,
                                "rounds_ms": times[v], "tflops": flops / ms / 1e9, "x_write_floor": ms / floor,
                                "rel": rel[v]})
            del out, calls
            torch.cuda.empty_cache()
    write_results(args.out, results)
    print("| shape | wgrad | variant | ms | TFLOP/s | x write floor | rel error |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        rel = "—" if r["rel"] is None else f"{r['rel']:.2e}"
        print(f"| {r['shape']} | {r['wgrad']} | {r['variant']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
              f"{r['x_write_floor']:.2f} | {rel} |")


if __name__ == "__main__":
    main()
