"""MXFP8 expert forward on one GPU: dequantise-on-load vs FP8 MMA with per-32 rescale vs BF16, same run.

Run on the GPU machine from the repo root (< 2 minutes):
    PYTHONPATH=src CUDA_VISIBLE_DEVICES=0 python3 benchmarks/experts_mxfp8_bench.py --out $OUT/mxfp8.json

kimi-k2 shapes (D 7168, I 2048), 65,536 routed rows over 192 experts (~341 each) and 16 (4096 each).
Inputs are quantised with megamoe.ops.quant (not timed). Each variant's y is checked against the fp32
twin on a few experts (rel L1 <= 2e-2) and against BF16 expert_forward (<= 1e-1). FLOPs = 6 * R * D * I.
Also times the rescale variant's literal integer-exponent form (int_exp) per stage.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from megamoe.ops.experts import expert_forward
from megamoe.ops.experts_mxfp8 import (ExpertForwardQuantized, down_mxfp8, expert_forward_mxfp8, expert_forward_mxfp8_reference, gate_up_mxfp8, plan_tiles_mxfp8)
from megamoe.ops.quant import quantize_activations, quantize_weights

D, I, ROUTES = 7168, 2048, 65536
LOADS = {"192x341": 192, "16x4096": 16}
VARIANTS = ("dequant", "rescale")


def make_load(experts: int, device):
    g = torch.Generator(device=device).manual_seed(experts)
    counts = torch.full((experts,), ROUTES // experts, dtype=torch.int32, device=device)
    counts[: ROUTES - int(counts.sum())] += 1
    offsets = (counts.cumsum(0) - counts).to(torch.int32)
    x = torch.randn(ROUTES, D, generator=g, device=device).bfloat16()
    wgu = (torch.randn(experts, 2 * I, D, generator=g, device=device) / D**0.5).bfloat16()
    wd = (torch.randn(experts, D, I, generator=g, device=device) / I**0.5).bfloat16()
    return x, counts, offsets, wgu, wd


def rel(a, b):
    return float((a.float() - b.float()).abs().sum() / b.float().abs().sum())


def bench(fn, rep=100):
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def poisoned(device):
    return ExpertForwardQuantized(
        h=torch.full((ROUTES, 2 * I), float("nan"), dtype=torch.bfloat16, device=device),
        act_q=torch.full((ROUTES, I), 0xFF, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn),
        act_scale=torch.full((ROUTES, I // 32), 0xFE, dtype=torch.uint8, device=device),
        y=torch.full((ROUTES, D), float("nan"), dtype=torch.bfloat16, device=device),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="mxfp8.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    t_start = time.time()
    flops = 6 * ROUTES * D * I
    records = []
    for load, experts in LOADS.items():
        x, counts, offsets, wgu, wd = make_load(experts, device)
        x_q, x_s = quantize_activations(x, "mxfp8")
        gu_q, gu_s = quantize_weights(wgu, "mxfp8", axis=-1)  # along D
        dn_q, dn_s = quantize_weights(wd, "mxfp8", axis=-1)  # along I
        qargs = (x_q, x_s, counts, offsets, gu_q, gu_s, dn_q, dn_s)
        bf16 = expert_forward(x, counts, offsets, wgu, wd)
        ms_bf16 = bench(lambda: expert_forward(x, counts, offsets, wgu, wd))
        records.append({"load": load, "impl": "bf16 expert_forward", "ms": ms_bf16, "tflops": flops / ms_bf16 / 1e9})
        subset = [0, 1, experts - 1]
        ref = expert_forward_mxfp8_reference(*qargs, experts=subset)
        rows = torch.zeros(ROUTES, dtype=torch.bool, device=device)
        for e in subset:
            o, c = int(offsets[e]), int(counts[e])
            rows[o : o + c] = True
        ref_y, ref_s = ref.y[rows], ref.act_scale[rows]
        del ref
        out = poisoned(device)
        for variant in VARIANTS:
            out.y.fill_(float("nan"))
            out.act_scale.fill_(0xFE)
            expert_forward_mxfp8(*qargs, variant=variant, out=out)
            torch.cuda.synchronize()
            written = not bool(out.y.isnan().any() or out.h.isnan().any() or (out.act_scale == 0xFE).any())
            err_bf16, err_twin = rel(out.y, bf16.y), rel(out.y[rows], ref_y)
            scale_eq = float((out.act_scale[rows] == ref_s).float().mean())
            ok = err_bf16 <= 1e-1 and err_twin <= 2e-2 and written
            print(f"{load} {variant}: y rel L1 vs bf16 {err_bf16:.2e}, vs fp32 twin {err_twin:.2e} (experts {subset});"
                  f" act_scale equal {scale_eq:.3f}; all written {written} -> {'OK' if ok else 'FAIL'}", flush=True)
            stages = {}
            for int_exp in ((False, True) if variant == "rescale" else (False,)):
                tag = f"mxfp8 {variant}{' int_exp' if int_exp else ''}"
                stages[int_exp] = {
                    "gate_up": bench(lambda: gate_up_mxfp8(x_q, x_s, counts, offsets, gu_q, gu_s, out,
                                                           variant=variant, int_exp=int_exp)),
                    "down": bench(lambda: down_mxfp8(out.act_q, out.act_scale, counts, offsets, dn_q, dn_s, out.y,
                                                     variant=variant, int_exp=int_exp)),
                }
                for stage, share in (("gate_up", 2 / 3), ("down", 1 / 3)):
                    ms = stages[int_exp][stage]
                    records.append({"load": load, "impl": f"{tag} {stage}", "ms": ms,
                                    "tflops": share * flops / ms / 1e9,
                                    "tiles": plan_tiles_mxfp8(stage, variant, device).__dict__})
            for store_h in (True, False):
                ms = bench(lambda: expert_forward_mxfp8(*qargs, variant=variant, out=out, store_h=store_h), rep=200)
                records.append({"load": load, "impl": f"mxfp8 {variant} forward{'' if store_h else ' (no h)'}",
                                "ms": ms, "tflops": flops / ms / 1e9, "vs_bf16": ms_bf16 / ms,
                                "rel_err_vs_bf16": err_bf16, "rel_err_vs_twin": err_twin,
                                "act_scale_equal_frac": scale_eq, "all_written": written, "ok": ok})
        fwd = {r["impl"]: r["ms"] for r in records if r["load"] == load and r["impl"].endswith("forward")}
        records.append({"load": load, "impl": "rescale / dequant time", "ratio":
                        fwd["mxfp8 rescale forward"] / fwd["mxfp8 dequant forward"]})
        del x, wgu, wd, gu_q, dn_q, out, bf16
        torch.cuda.empty_cache()
    winner = {}
    for load in LOADS:
        r = next(r for r in records if r["load"] == load and "ratio" in r)
        winner[load] = "dequant" if r["ratio"] > 1 else "rescale"
    with open(args.out, "w") as f:
        json.dump({"machine": torch.cuda.get_device_name(), "seconds": time.time() - t_start, "faster": winner,
                   "planner": {v: {k: plan_tiles_mxfp8(k, v, device).__dict__ for k in ("gate_up", "down")}
                               for v in VARIANTS}, "records": records}, f, indent=1)
    print(f"\n{'load':9} {'impl':34} {'ms':>7} {'TFLOP/s':>8} note")
    for r in records:
        if "ratio" in r:
            print(f"{r['load']:9} {r['impl']:34} ratio {r['ratio']:.2f}")
            continue
        note = (f"x{r['vs_bf16']:.2f} vs bf16, err bf16 {r['rel_err_vs_bf16']:.1e} twin {r['rel_err_vs_twin']:.1e}"
                f"{'' if r['ok'] else ' FAIL'}") if "vs_bf16" in r else ""
        print(f"{r['load']:9} {r['impl']:34} {r['ms']:7.3f} {r['tflops']:8.0f} {note}")
    print(f"faster: {winner}; total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
