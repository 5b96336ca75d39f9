"""Two programs per SM against one: the expert GEMMs with 64-row tiles and a doubled persistent grid.

With one 128-row program per SM, the FP8-block kernels' per-K-step promotion (wait for the wgmma,
scale, add) and every kernel's epilogue leave the tensor cores idle: the program's two warpgroups
move in step. Two co-resident 64-row programs (4 warps each) let one program's tensor-core work run
under the other's serial part, at the price of twice the weight-tile traffic per FLOP. Two fit when
a program needs at most 32K registers (4 warps x 255) and ~113 KB of shared memory. This script
measures it in interleaved rounds (GPU clocks drift over a sequential sweep) on kimi-k2 shapes, both
loads, and checks each variant's output bitwise against the default tiles' output.

Run on the GPU machine from the repo root:
    PYTHONPATH=src python3 benchmarks/co_resident_ab.py --out $OUT/co_resident.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from experts_fp8_bench import D, I, LOADS, ROUTES, make_load
from megamoe.ops.experts import ExpertForward, down, gate_up
from megamoe.ops.tiles import TileConfig, plan_tiles
from megamoe.ops.experts_fp8 import ExpertForwardQuantized, down_fp8, gate_up_fp8, plan_tiles_fp8
from megamoe.ops.quant import quantize_activations, quantize_weights


def variants(sms: int) -> dict:
    """{(precision, stage): [(label, TileConfig, programs)]}; the first of each list is the default."""
    two = 2 * sms
    return {
        ("fp8-block", "gate_up"): [
            ("default", None, sms),
            ("64x128 4w 2st", TileConfig(64, 128, 128, 4, 2, 4), sms),
            ("64x128 4w 2st x2", TileConfig(64, 128, 128, 4, 2, 4), two),
            ("64x128 4w 2st g8 x2", TileConfig(64, 128, 128, 4, 2, 8), two),
        ],
        ("fp8-block", "down"): [
            ("default", None, sms),
            ("64x128 4w 3st", TileConfig(64, 128, 128, 4, 3, 8), sms),
            ("64x128 4w 3st x2", TileConfig(64, 128, 128, 4, 3, 8), two),
            ("64x128 4w 4st x2", TileConfig(64, 128, 128, 4, 4, 8), two),
        ],
        ("bf16", "gate_up"): [
            ("default", None, sms),
            ("64x128 4w 2st x2", TileConfig(64, 128, 64, 4, 2, 8), two),
            ("64x128 4w 2st g4 x2", TileConfig(64, 128, 64, 4, 2, 4), two),
        ],
        ("bf16", "down"): [
            ("default", None, sms),
            ("64x128 4w 3st x2", TileConfig(64, 128, 64, 4, 3, 8, flatten=True), two),
            ("64x128 4w 4st x2", TileConfig(64, 128, 64, 4, 4, 8, flatten=True), two),
            ("64x256 4w 2st x2", TileConfig(64, 256, 64, 4, 2, 8, flatten=True), two),
        ],
    }


def stage_calls(x, counts, offsets, wgu, wd, device):
    """{(precision, stage): (call(cfg, programs), output tensors to compare)} on one load."""
    x_q, x_s = quantize_activations(x, "fp8-block")
    gu_q, gu_s = quantize_weights(wgu, "fp8-block")
    dn_q, dn_s = quantize_weights(wd, "fp8-block")
    q = ExpertForwardQuantized(
        h=torch.empty(ROUTES, 2 * I, dtype=torch.bfloat16, device=device),
        act_q=torch.empty(ROUTES, I, dtype=torch.float8_e4m3fn, device=device),
        act_scale=torch.empty(ROUTES, I // 128, device=device),
        y=torch.empty(ROUTES, D, dtype=torch.bfloat16, device=device))
    b = ExpertForward(h=torch.empty(ROUTES, 2 * I, dtype=torch.bfloat16, device=device),
                      act=torch.empty(ROUTES, I, dtype=torch.bfloat16, device=device),
                      y=torch.empty(ROUTES, D, dtype=torch.bfloat16, device=device))
    # inputs of the down stages: the default gate/up's outputs (written once before any timing)
    gate_up_fp8(x_q, x_s, counts, offsets, gu_q, gu_s, q)
    gate_up(x, counts, offsets, wgu, b.h, b.act)
    return {
        ("fp8-block", "gate_up"): (
            lambda cfg, p: gate_up_fp8(x_q, x_s, counts, offsets, gu_q, gu_s, q, tiles=cfg, num_programs=p),
            (q.h, q.act_q.view(torch.uint8), q.act_scale)),
        ("fp8-block", "down"): (
            lambda cfg, p: down_fp8(q.act_q, q.act_scale, counts, offsets, dn_q, dn_s, q.y, tiles=cfg,
                                    num_programs=p),
            (q.y,)),
        ("bf16", "gate_up"): (
            lambda cfg, p: gate_up(x, counts, offsets, wgu, b.h, b.act, tiles=cfg, num_programs=p),
            (b.h, b.act)),
        ("bf16", "down"): (
            lambda cfg, p: down(b.act, counts, offsets, wd, b.y, tiles=cfg, num_programs=p),
            (b.y,)),
    }


def poison(outputs) -> None:
    for t in outputs:
        t.view(torch.uint8).fill_(0xFF)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="co_resident.json")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    t_start = time.time()
    flops = 6 * ROUTES * D * I
    records = []
    for load, experts in LOADS.items():
        x, counts, offsets, wgu, wd = make_load(experts, device)
        calls = stage_calls(x, counts, offsets, wgu, wd, device)
        for key, cands in variants(sms).items():
            precision, stage = key
            call, outputs = calls[key]
            share = 2 / 3 if stage == "gate_up" else 1 / 3
            default = (plan_tiles_fp8 if precision == "fp8-block" else plan_tiles)(stage, device)
            cands = [(label, cfg or default, p) for label, cfg, p in cands]
            expected, same = None, {}
            for label, cfg, p in cands:  # correctness: poisoned outputs, bits against the default tiles
                poison(outputs)
                call(cfg, p)
                torch.cuda.synchronize()
                got = [t.clone() for t in outputs]
                if expected is None:
                    expected = got
                same[label] = all(torch.equal(a, b) for a, b in zip(got, expected))
            times = {label: [] for label, _, _ in cands}
            for _ in range(args.rounds):
                for label, cfg, p in cands:
                    times[label].append(triton.testing.do_bench(lambda: call(cfg, p), warmup=10, rep=60,
                                                                return_mode="median"))
            for label, cfg, p in cands:
                ms = sorted(times[label])[len(times[label]) // 2]
                records.append({"load": load, "precision": precision, "stage": stage, "variant": label,
                                "tiles": cfg.__dict__, "programs": p, "ms": ms, "ms_rounds": times[label],
                                "tflops": share * flops / ms / 1e9, "bitwise_equal_default": same[label]})
                r = records[-1]
                print(f"{load:8} {precision:9} {stage:7} {label:22} P{p:<4} {ms:7.3f} ms {r['tflops']:6.0f} "
                      f"TFLOP/s same bits {same[label]}", flush=True)
        del x, wgu, wd, calls
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"machine": torch.cuda.get_device_name(), "sms": sms, "rounds": args.rounds,
                   "seconds": time.time() - t_start, "records": records}, f, indent=1)
    print(f"\n{'load':8} {'precision':9} {'stage':7} {'variant':22} {'P':>4} {'ms':>7} {'TFLOP/s':>7} {'vs default':>10} bits")
    base = {}
    for r in records:
        key = (r["load"], r["precision"], r["stage"])
        base.setdefault(key, r["ms"])
        print(f"{r['load']:8} {r['precision']:9} {r['stage']:7} {r['variant']:22} {r['programs']:4} {r['ms']:7.3f} "
              f"{r['tflops']:7.0f} {base[key] / r['ms']:10.3f} {'same' if r['bitwise_equal_default'] else 'DIFF'}")
    print(f"total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
