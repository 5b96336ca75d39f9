"""The FP8-block down projection: the warp-specialised Gluon kernel against the Triton one.

Run on the GPU machine from the repo root:
    PYTHONPATH=src python3 benchmarks/fp8_gluon_ab.py --out $OUT/fp8_gluon.json

kimi-k2 shapes, both loads of experts_fp8_bench.py; the down stage's inputs are the Triton gate/up's
outputs. Each variant's y (poisoned first) is compared bitwise with the Triton kernel's; times from
interleaved rounds (the GPU's clock drifts over a sequential sweep).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from co_resident_ab import poison
from experts_fp8_bench import D, I, LOADS, ROUTES, make_load
from megamoe.experts import TileConfig
from megamoe.experts_fp8 import ExpertForwardQuantized, down_fp8, down_fp8_gluon, gate_up_fp8
from megamoe.kernels.quant import quantize_activations, quantize_weights


def variants(sms: int) -> list:
    """[(label, call(args, y))]: the first is the reference for the bits."""
    def gluon(block_n, stages, group=8):
        cfg = TileConfig(128, block_n, 128, 4, stages, group)
        return lambda a, y: down_fp8_gluon(*a, y, tiles=cfg)
    return [
        ("triton default", lambda a, y: down_fp8(*a, y)),
        ("gluon ws 128 4 slots", gluon(128, 4)),
        ("gluon ws 256 4 slots", gluon(256, 4)),
        ("gluon ws 256 3 slots", gluon(256, 3)),
        ("gluon ws 256 4 slots g4", gluon(256, 4, 4)),
        ("gluon ws 256 4 slots g16", gluon(256, 4, 16)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="fp8_gluon.json")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    t_start = time.time()
    flops = 2 * ROUTES * D * I
    records = []
    for load, experts in LOADS.items():
        x, counts, offsets, wgu, wd = make_load(experts, device)
        x_q, x_s = quantize_activations(x, "fp8-block")
        gu_q, gu_s = quantize_weights(wgu, "fp8-block")
        dn_q, dn_s = quantize_weights(wd, "fp8-block")
        q = ExpertForwardQuantized(h=None, act_q=torch.empty(ROUTES, I, dtype=torch.float8_e4m3fn, device=device),
                                   act_scale=torch.empty(ROUTES, I // 128, device=device),
                                   y=torch.empty(ROUTES, D, dtype=torch.bfloat16, device=device))
        gate_up_fp8(x_q, x_s, counts, offsets, gu_q, gu_s, q, store_h=False)
        down_args = (q.act_q, q.act_scale, counts, offsets, dn_q, dn_s)
        y = q.y
        expected, same, errors = None, {}, {}
        cands = variants(sms)
        for label, call in cands:
            poison([y])
            try:
                call(down_args, y)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 (a variant that does not build is reported, not fatal)
                errors[label] = repr(exc)[:300]
                print(f"{load} {label}: {errors[label]}", flush=True)
                continue
            if expected is None:
                expected = y.clone()
            same[label] = bool(torch.equal(y, expected))
            if not same[label]:
                diff = (y.float() - expected.float()).abs()
                same[label] = f"max abs diff {float(diff.nan_to_num(1e30).max()):.3e}, nan {int(y.isnan().sum())}"
        cands = [(label, call) for label, call in cands if label not in errors]
        times = {label: [] for label, _ in cands}
        for _ in range(args.rounds):
            for label, call in cands:
                times[label].append(triton.testing.do_bench(lambda: call(down_args, y), warmup=10, rep=60,
                                                            return_mode="median"))
        for label, _ in cands:
            ms = sorted(times[label])[len(times[label]) // 2]
            records.append({"load": load, "variant": label, "ms": ms, "ms_rounds": times[label],
                            "tflops": flops / ms / 1e9, "bitwise_equal_triton": same[label]})
        records += [{"load": load, "variant": label, "error": e} for label, e in errors.items()]
        del x, wgu, wd, gu_q, dn_q, q
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"machine": torch.cuda.get_device_name(), "sms": sms, "rounds": args.rounds,
                   "seconds": time.time() - t_start, "records": records}, f, indent=1)
    print(f"\n{'load':8} {'variant':24} {'ms':>7} {'TFLOP/s':>7} bits")
    for r in records:
        if "error" in r:
            print(f"{r['load']:8} {r['variant']:24} ERROR {r['error'][:80]}")
        else:
            print(f"{r['load']:8} {r['variant']:24} {r['ms']:7.3f} {r['tflops']:7.0f} {r['bitwise_equal_triton']}")
    print(f"total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
