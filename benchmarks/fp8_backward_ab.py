"""The fp8-block expert backward against the BF16 one on the same load, at the power cap (one GPU).

    PYTHONPATH=src python3 benchmarks/fp8_backward_ab.py [--preset kimi-k2] [--experts 192] [--rounds 5]

``tokens x k`` rows spread evenly over --experts experts (kimi-k2 at 8192 tokens: 192 x 341, EP 2's per-rank
load): `expert_backward` (BF16) and `expert_backward_fp8_block` (its transposed weights made once, untimed,
as once per optimizer step) in interleaved rounds; the FP8 gradients' error against the BF16 ones. Prints ms
and the speed-up; writes DIR/fp8_backward_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from megamoe.bench.experts import make_load
from megamoe.bench.harness import error_stats
from megamoe.config import preset
from megamoe.ops.experts import ExpertForward, expert_backward, gate_up
from megamoe.ops.experts_fp8_bwd import expert_backward_fp8_block, transposed_weights

from sustained import interleaved_rounds  # benchmarks/, beside this script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    cfg, dev = preset(a.preset), torch.device("cuda")
    d, i = cfg.hidden, cfg.intermediate
    x, counts, offsets, wgu, wd = make_load(a.experts, a.tokens * cfg.top_k, d, i, dev)
    rows = x.shape[0]
    fwd = ExpertForward(torch.empty(rows, 2 * i, dtype=torch.bfloat16, device=dev),
                        torch.empty(rows, i, dtype=torch.bfloat16, device=dev), None)
    gate_up(x, counts, offsets, wgu, fwd.h, fwd.act)
    g = torch.Generator(device=dev).manual_seed(7)
    dy = torch.randn(rows, d, generator=g, device=dev).bfloat16()
    row_w = torch.rand(rows, generator=g, device=dev)
    wt = transposed_weights(wgu, wd)
    calls = {"bf16": lambda: expert_backward(dy, row_w, x, fwd.h, counts, offsets, wgu, wd),
             "fp8-block": lambda: expert_backward_fp8_block(dy, row_w, x, fwd.h, counts, offsets, wgu, wd,
                                                             weights_t=wt)}
    ref, got = calls["bf16"](), calls["fp8-block"]()
    errors = {}
    for name in ("d_x", "d_router", "d_w_gate_up", "d_w_down"):
        r, q = getattr(ref, name), getattr(got, name)
        errors[name] = {k: v for k, v in error_stats(q.reshape(-1, q.shape[-1]) if q.dim() > 1 else q,
                                                     r.reshape(-1, r.shape[-1]) if r.dim() > 1 else r).items()
                        if k in ("rel", "row", "finite")}
    del ref, got
    times = interleaved_rounds(calls, a.rounds, a.seconds)
    ms = {k: statistics.median(v) for k, v in times.items()}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fp8_backward_ab.json"), "w") as f:
        json.dump({"args": vars(a), "ms": ms, "rounds": times, "fp8_vs_bf16": errors}, f, indent=1)
    print(f"{a.preset}, {a.experts} experts x ~{rows // a.experts} rows, {a.rounds} rounds of {a.seconds} s")
    print("| backward | ms (median) | x vs bf16 |")
    print("|---|---|---|")
    for k, v in ms.items():
        print(f"| {k} | {v:.3f} | {ms['bf16'] / v:.2f} |")
    print("fp8-block against bf16:", {k: {m: round(float(x), 4) for m, x in e.items()} for k, e in errors.items()})


if __name__ == "__main__":
    main()
