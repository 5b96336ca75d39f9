"""Expert compute on one GPU: megamoe's grouped GEMM tiles against torch._grouped_mm + SwiGLU.

Run on the GPU machine from the repo root:
    PYTHONPATH=src python3 benchmarks/experts_bench.py --out $OUT/experts.json

kimi-k2 shapes (D 7168, I 2048), 8192 tokens x 8 routes = 65,536 rows on one GPU,
over 192 experts (~341 rows each) and over 16 experts (4096 rows each). Every
variant is checked against the torch path before it is timed; rows outside
expert regions are poisoned and must stay so.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
import triton

from megamoe.experts import TileConfig, expert_forward

D, I, ROUTES = 7168, 2048, 65536
LOADS = {"192x341": 192, "16x4096": 16}
GATE_UP = [TileConfig(128, 128, 64, 8, 3), TileConfig(128, 128, 64, 8, 4), TileConfig(64, 128, 64, 4, 4)]
DOWN = [TileConfig(128, 256, 64, 8, 3), TileConfig(128, 128, 64, 8, 4), TileConfig(128, 256, 64, 8, 4)]


def make_load(experts: int, device):
    g = torch.Generator(device=device).manual_seed(experts)
    counts = torch.full((experts,), ROUTES // experts, dtype=torch.int32, device=device)
    counts[: ROUTES - int(counts.sum())] += 1
    offsets = (counts.cumsum(0) - counts).to(torch.int32)
    x = torch.randn(ROUTES, D, generator=g, device=device).bfloat16()
    wgu = (torch.randn(experts, 2 * I, D, generator=g, device=device) / D**0.5).bfloat16()
    wd = (torch.randn(experts, D, I, generator=g, device=device) / I**0.5).bfloat16()
    return x, counts, offsets, wgu, wd


def torch_path(x, counts, wgu, wd):
    ends = counts.cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x, wgu.transpose(-2, -1), offs=ends)
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) * up
    return torch._grouped_mm(act, wd.transpose(-2, -1), offs=ends)


def rel(a, b):
    return float((a.float() - b.float()).abs().sum() / b.float().abs().sum())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="experts.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    records = []
    flops = 6 * ROUTES * D * I
    for load, experts in LOADS.items():
        x, counts, offsets, wgu, wd = make_load(experts, device)
        ref_y = torch_path(x, counts, wgu, wd)
        ms = triton.testing.do_bench(lambda: torch_path(x, counts, wgu, wd), warmup=50, rep=300, return_mode="median")
        records.append({"load": load, "impl": "torch._grouped_mm+swiglu", "ms": ms, "tflops": flops / ms / 1e9,
                        "rel_err_vs_torch": 0.0, "gate_up": None, "down": None})
        best = None
        for gu in GATE_UP:
            for dn in DOWN:
                tiles = {"gate_up": gu, "down": dn}
                t0 = time.time()
                try:
                    out = expert_forward(x, counts, offsets, wgu, wd, tiles=tiles)
                    torch.cuda.synchronize()
                except Exception as exc:  # a tile shape that does not fit: record and go on
                    records.append({"load": load, "impl": "megamoe", "error": repr(exc)[:200],
                                    "gate_up": gu.__dict__, "down": dn.__dict__})
                    continue
                err = rel(out.y, ref_y)
                ms = triton.testing.do_bench(lambda: expert_forward(x, counts, offsets, wgu, wd, out=out, tiles=tiles),
                                             warmup=50, rep=300, return_mode="median")
                rec = {"load": load, "impl": "megamoe", "ms": ms, "tflops": flops / ms / 1e9, "rel_err_vs_torch": err,
                       "gate_up": gu.__dict__, "down": dn.__dict__, "compile_s": time.time() - t0}
                records.append(rec)
                if err < 1e-2 and (best is None or ms < best["ms"]):
                    best = rec
        if best is not None:
            print(f"best {load}: {best['ms']:.3f} ms {best['tflops']:.0f} TFLOP/s")
        del x, wgu, wd, ref_y
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"machine": torch.cuda.get_device_name(), "records": records}, f, indent=1)
    print(f"{'load':9} {'impl':26} {'gate_up':18} {'down':18} {'ms':>8} {'TFLOP/s':>8} {'rel err':>9}")
    for r in records:
        if "error" in r:
            print(f"{r['load']:9} {r['impl']:26} {str(tuple(r['gate_up'].values())):18} ERROR {r['error'][:60]}")
            continue
        tiles = [str(tuple(r[k].values())[:3]) if r[k] else "-" for k in ("gate_up", "down")]
        print(f"{r['load']:9} {r['impl']:26} {tiles[0]:18} {tiles[1]:18} {r['ms']:8.3f} {r['tflops']:8.0f} "
              f"{r['rel_err_vs_torch']:9.2e}")


if __name__ == "__main__":
    main()
