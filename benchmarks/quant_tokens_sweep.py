"""The FP8 backward's token-axis quantiser (``experts_fp8_bwd.quantize_tokens``) over tile configs, on one GPU.

    PYTHONPATH=src python3 benchmarks/quant_tokens_sweep.py [--experts 192] [--budget-s 120] [--out DIR]

kimi-k2's backward load (8192 tokens x k 8 rows over --experts experts): the four operands the wgrads quantise
along each expert's tokens, gathered into 128-row spans and written transposed (dy and x ``[R, 7168]``, d_h
``[R, 4096]``, act·w ``[R, 2048]``), each with the default tile (``quant.default_config``) and the sweep's
``QuantConfig(block_m, block_k, num_warps)``. Every config's data and scales are compared with the default's bit
for bit; times are triton.testing.do_bench medians (L2 flushed). GB/s = (bf16 read + e4m3 and scales written)
/ time. Writes DIR/quant_tokens_sweep.json and prints a table per operand, fastest first.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from triton.testing import do_bench

from megamoe.config import preset
from megamoe.ops.experts_fp8_bwd import token_blocks
from megamoe.ops.quant import QuantConfig, default_config, quantize_activations

SWEEP = [(bm, bk, w) for bm in (128, 256) for bk in (32, 64, 128) for w in (1, 2, 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=192)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--budget-s", type=float, default=120.0)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    cfg, dev = preset("kimi-k2"), torch.device("cuda")
    rows = a.tokens * cfg.top_k
    counts = torch.full((a.experts,), rows // a.experts, dtype=torch.int32, device=dev)
    counts[: rows - int(counts.sum())] += 1
    offsets = (counts.cumsum(0) - counts).to(torch.int32)
    blocks = token_blocks(counts, offsets, rows)
    g = torch.Generator(device=dev).manual_seed(3)
    operands = {"dy, x [R, 7168]": cfg.hidden, "d_h [R, 4096]": 2 * cfg.intermediate,
                "act_w [R, 2048]": cfg.intermediate}
    start, records = time.monotonic(), []
    for name, cols in operands.items():
        t = torch.randn(rows, cols, generator=g, device=dev).bfloat16()
        run = lambda c, t=t: quantize_activations(t, "fp8-block", axis=0, transpose=True, rows=blocks.src,  # noqa: E731
                                             scale_transpose=False, config=c)
        ref = run(None)
        nbytes = t.numel() * 2 + ref[0].numel() + ref[1].numel() * 4
        default = default_config((128, 1))
        first = (default.block_m, default.block_k, default.num_warps)
        for bm, bk, w in [first] + [c for c in SWEEP if c != first]:
            if time.monotonic() - start > a.budget_s:
                break
            c = QuantConfig(bm, bk, w)
            try:
                got = run(c)
                torch.cuda.synchronize()
            except Exception as e:  # a tile that does not compile (registers, shared memory) is reported
                records.append({"operand": name, "config": [bm, bk, w], "error": f"{type(e).__name__}: {e}"[:160]})
                continue
            same = torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(got[1], ref[1])
            ms = do_bench(lambda: run(c), warmup=5, rep=40)
            records.append({"operand": name, "config": [bm, bk, w], "default": (bm, bk, w) == (
                default.block_m, default.block_k, default.num_warps), "ms": ms, "gbps": nbytes / ms / 1e6,
                "same_bits": same})
        del t, ref
    with open(os.path.join(a.out, "quant_tokens_sweep.json"), "w") as f:
        json.dump({"args": vars(a), "records": records}, f, indent=1)
    for name in operands:
        rs = sorted((r for r in records if r["operand"] == name and "ms" in r), key=lambda r: r["ms"])
        print(f"\n{name}, {a.experts} experts x ~{rows // a.experts} rows")
        print("| block_m x block_k, warps | ms | GB/s | bits |")
        print("|---|---|---|---|")
        for r in rs:
            bm, bk, w = r["config"]
            tag = " (default)" if r["default"] else ""
            print(f"| {bm} x {bk}, w{w}{tag} | {r['ms']:.3f} | {r['gbps']:.0f} | "
                  f"{'same' if r['same_bits'] else 'DIFFERENT'} |")
    for r in records:
        if "error" in r:
            print("failed:", r["operand"], r["config"], r["error"])


if __name__ == "__main__":
    main()
