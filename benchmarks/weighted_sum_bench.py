"""The megakernel's closing weighted sum (``weighted_sum_kernel``) across tiles, on one GPU.

    PYTHONPATH=src python3 benchmarks/weighted_sum_bench.py [--out FILE.json]

kimi-k2 (k 8, D 7168, a shared expert) and qwen3.5-397b (k 10, D 4096) at 8192 tokens, and the fine-grained
layers of one GPU (``--shapes``): random combine slots, ~5 % of the routes empty (-1); with "own" routes, half of
them (even experts: this rank's at EP 2) read their row from y instead, where the megakernel leaves it: the ring,
in expert order (a gather), as in a pass since 24c8091; "all own", every route from y (one rank's forward). Each
tile's output must equal the first tile's bit for bit (the k slots are summed in the same order whatever the
tile). GB/s = (slots + shared + out bytes) / median time (triton.testing.do_bench; the run recorded at e6b9ad6
took the median of 20 CUDA-event timings instead).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from megamoe.kernels.weighted_sum import weighted_sum_kernel
from megamoe.ops.weighted_sum import WEIGHTED_SUM_TILE

#: (BLOCK_T, BLOCK_D, num_warps); the first is the pass's (``WEIGHTED_SUM_TILE``: 2 x 1024, 2 warps)
TILES = [WEIGHTED_SUM_TILE, *(t for t in ((16, 512, 8), (32, 256, 4), (16, 256, 4), (8, 1024, 4), (8, 512, 4),
                                          (8, 1024, 8), (4, 2048, 8), (2, 4096, 8), (32, 512, 8), (64, 256, 8),
                                          (32, 256, 8), (16, 128, 4), (64, 128, 4),
                                          # several CTAs per SM (16 x 512 x 8 compiles to 170 registers: one)
                                          (4, 512, 2), (8, 256, 2), (2, 1024, 2), (4, 1024, 4))
                                if t != WEIGHTED_SUM_TILE)]
#: (tokens, k, D, shared): two wide layers, and the fine-grained ones of one GPU (qwen3-30b-a3b, SonicMoE's shapes)
SHAPES = {"kimi-k2": (8192, 8, 7168, True), "qwen3.5-397b": (8192, 10, 4096, True),
          "qwen3-30b-a3b": (8192, 8, 2048, False), "sonic-7b": (24576, 8, 1536, False),
          "sonic-d4096": (32768, 8, 4096, False)}


def _time_tiles(name, n, k, d, shared, y, combine, own_rows, top, weights, shared_y, nbytes) -> list[dict]:
    results, first = [], None
    experts = int(top.max()) + 1  # every id a route (the kernel skips ids past the experts)
    for bt, bd, warps in TILES:
        out = torch.full((n, d), float("nan"), device=y.device, dtype=torch.bfloat16)

        def run():
            weighted_sum_kernel[(triton.cdiv(n, bt), triton.cdiv(d, bd))](
                y, y.stride(0), combine, combine.stride(0), own_rows, top, weights, shared_y,
                shared_y.stride(0), out, out.stride(0), n, d, experts, TOP_K=k, HAS_SHARED=shared, BLOCK_T=bt,
                BLOCK_D=bd, num_warps=warps)
        ms = triton.testing.do_bench(run, return_mode="median")
        first = out.clone() if first is None else first
        results.append({"shape": name, "block_t": bt, "block_d": bd, "num_warps": warps,
                        "ms": ms, "gbps": nbytes / ms / 1e6, "same_bits": bool(torch.equal(out, first))})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for name in args.shapes.split(","):
        n, k, d, shared = SHAPES[name]
        combine = torch.randn(n * k, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        top = torch.randint(0, 64, (n, k), device="cuda", dtype=torch.int32, generator=gen)
        top = torch.where(torch.rand(n, k, device="cuda", generator=gen) < 0.05, -1, top)
        weights = torch.rand(n, k, device="cuda", generator=gen)
        shared_y = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        nbytes = (n * k * d + (2 if shared else 1) * n * d) * 2
        # own routes: rows of y in expert order (the ring), the rest in their combine slots (-1)
        flat = top.flatten().long()
        order = torch.argsort(torch.where(flat >= 0, flat, 1 << 20), stable=True)
        ring_row = torch.empty_like(order)
        ring_row[order] = torch.arange(n * k, device="cuda")
        own_rows = torch.where((flat >= 0) & (flat % 2 == 0), ring_row, -1).to(torch.int32)
        y = torch.randn(n * k, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        # slots only (EP >= 2's pushes; one rank's backward d_x), half the routes in y, every route in y (one rank's
        # forward)
        every = torch.where(flat >= 0, ring_row, -1).to(torch.int32)
        for mode, rows_in_y in (("", torch.full((n * k,), -1, device="cuda", dtype=torch.int32)),
                                (" own", own_rows), (" all own", every)):
            results += _time_tiles(f"{name}{mode}", n, k, d, shared, y, combine, rows_in_y, top, weights,
                                   shared_y, nbytes)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "results": results}, f, indent=1)
    print("| shape | BLOCK_T x BLOCK_D | warps | ms | GB/s | same bits |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['shape']} | {r['block_t']} x {r['block_d']} | {r['num_warps']} | {r['ms']:.3f} | "
              f"{r['gbps']:.0f} | {r['same_bits']} |")


if __name__ == "__main__":
    main()
