"""The FP8 recipes' own forward error on the bench's problem (CPU, no kernel): the routed experts with x, both
weights and act rounded to the E4M3 grid (MXFP8: 32-blocks, E8M0 scales; FP8-block: 1x128 activations, 128x128
weights), FP32 sums, against the same experts unrounded. No shared expert.

    PYTHONPATH=src python3 benchmarks/results/2026-12-06-mxfp8-as-bf16/recipe_error.py

Printed on 2026-12-06 (torch 2.13 CPU): qwen3-30b-a3b mxfp8 7.48e-02 fp8-block 6.01e-02; kimi-k2 mxfp8 7.55e-02
fp8-block 6.07e-02.
"""
import dataclasses

import torch
import torch.nn.functional as F

from megamoe.bench.problem import make_problem
from megamoe.config import PRESETS
from megamoe.reference.formats import fp8_block_dequantize, fp8_block_quantize, mxfp8_dequantize, mxfp8_quantize


def mx(t):
    return mxfp8_dequantize(*mxfp8_quantize(t, -1), -1, dtype=torch.float32)


def fb(t, block):
    return fp8_block_dequantize(*fp8_block_quantize(t, block), block).float()


def routed(p, qx, qw, qact):
    x, out = qx(p.x.float()), torch.zeros(p.x.shape, dtype=torch.float32)
    wgu, wd = qw(p.w_gate_up.float()), qw(p.w_down.float())
    for e in range(wgu.shape[0]):
        tok, slot = (p.top_experts == e).nonzero(as_tuple=True)
        h = x[tok] @ wgu[e].T
        i = h.shape[1] // 2
        act = qact(F.silu(h[:, :i]) * h[:, i:])
        out.index_add_(0, tok, (act @ wd[e].T) * p.router_weights[tok, slot, None].float())
    return out


def main():
    same = lambda t: t  # noqa: E731
    for name in ("qwen3-30b-a3b", "kimi-k2"):
        cfg = dataclasses.replace(PRESETS[name], num_experts=32, shared=())
        p = make_problem(cfg, 0, 1, 256, dtype=torch.bfloat16, seed=0, device="cpu")
        ref = routed(p, same, same, same)

        def rel(o):
            return f"{float((o - ref).abs().sum() / ref.abs().sum()):.2e}"

        blocks = lambda t: torch.stack([fb(w, (128, 128)) for w in t])  # noqa: E731
        print(name, "mxfp8", rel(routed(p, mx, mx, mx)),
              "fp8-block", rel(routed(p, lambda t: fb(t, (1, 128)), blocks, lambda t: fb(t, (1, 128)))))


if __name__ == "__main__":
    main()
