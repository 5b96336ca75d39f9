"""cuBLAS FP8 on the FP8-block kernels' dense shapes: how fast the tensor cores take these M, N, K here.

Run on the GPU machine from the repo root:
    python3 benchmarks/fp8_dense_ceiling.py --out $OUT/fp8_dense.json

`torch._scaled_mm` (E4M3, fp32 scales, bf16 out) with one scale per tensor and with one per row / column,
on kimi-k2's routed rows as one dense matrix (65,536 rows): gate/up [65536, 7168] x [7168, 4096], down
[65536, 2048] x [2048, 7168], and 8192^3 (../shared/BENCHMARKS.md's ceiling). Interleaved rounds. Neither has
the per-128-K block scales of fp8-block (cuBLAS has no such mode on Hopper), nor the expert grouping: an upper
bound for the grouped kernels, not a like-for-like.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

SHAPES = {"gate_up": (65536, 7168, 4096), "down": (65536, 2048, 7168), "square": (8192, 8192, 8192)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="fp8_dense.json")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dev = torch.device("cuda")
    calls = {}
    for name, (m, k, n) in SHAPES.items():
        a = (torch.randn(m, k, device=dev) / 4).to(torch.float8_e4m3fn)
        b = (torch.randn(n, k, device=dev) / 4).to(torch.float8_e4m3fn).T  # column-major, as cuBLAS wants
        one = torch.ones((), device=dev)
        rows, cols = torch.rand(m, 1, device=dev) + 0.5, torch.rand(1, n, device=dev) + 0.5
        calls[(name, "per-tensor")] = (2 * m * n * k, lambda a=a, b=b, s=one: torch._scaled_mm(
            a, b, s, s, out_dtype=torch.bfloat16))
        calls[(name, "per-row/column")] = (2 * m * n * k, lambda a=a, b=b, r=rows, c=cols: torch._scaled_mm(
            a, b, r, c, out_dtype=torch.bfloat16))
    times = {key: [] for key in calls}
    for _ in range(args.rounds):
        for key, (_, fn) in calls.items():
            times[key].append(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
    records = []
    for (name, scaling), (flops, _) in calls.items():
        ms = sorted(times[(name, scaling)])[args.rounds // 2]
        records.append({"shape": name, "mkn": SHAPES[name], "scaling": scaling, "ms": ms,
                        "ms_rounds": times[(name, scaling)], "tflops": flops / ms / 1e9})
        print(f"{name:8} {str(SHAPES[name]):22} {scaling:15} {ms:7.3f} ms {records[-1]['tflops']:6.0f} TFLOP/s")
    with open(args.out, "w") as f:
        json.dump({"machine": torch.cuda.get_device_name(), "torch": torch.__version__, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
