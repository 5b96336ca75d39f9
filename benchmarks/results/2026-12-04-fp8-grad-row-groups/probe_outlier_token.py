"""Why one FP8 weight-gradient row sits far from the oracle: `megamoe bench`'s tiny problem (seed 0, 256 tokens),
expert 1 (the worst rows of `fp8_layer_rows.py --preset tiny --tokens 256 --device cpu`), its d w_gate_up in FP32
from exact operands against the same with one FP8-block quantisation at a time (CPU, torch only).

    PYTHONPATH=src python3 benchmarks/results/2026-12-04-fp8-grad-row-groups/probe_outlier_token.py
"""
import torch

from megamoe.bench.problem import make_problem
from megamoe.config import preset
from megamoe.ops.experts_fp8_bwd import _token_wgrad, swiglu_backward
from megamoe.reference.formats import fp8_block_dequantize, fp8_block_quantize

cfg = preset("tiny")
p = make_problem(cfg, 0, 1, 256, dtype=torch.bfloat16, device=torch.device("cpu"), seed=0)
E, FEATURE = 1, 210  # expert 1's up feature 82 (210 - I): its worst row
tok, slot = (p.top_experts == E).nonzero(as_tuple=True)
x, w, dy = p.x[tok].float(), p.router_weights[tok, slot].float(), p.d_out[tok].float()
wgu, wd = p.w_gate_up[E].float(), p.w_down[E].float()  # [2I, D], [D, I]
h, g = x @ wgu.T, dy @ wd  # exact h and d_act (before the router weight)
d_h, _, _ = swiglu_backward(g, h, w, None)
ref = d_h.T @ x
typical = ref.norm(dim=1).pow(2).mean().sqrt()


def row_errors(got):
    return (got - ref).norm(dim=1) / torch.maximum(ref.norm(dim=1), typical)


def dq(t, block=(1, 128)):
    return fp8_block_dequantize(*fp8_block_quantize(t.bfloat16(), block), block)


h8 = (dq(x) @ dq(wgu, (128, 128)).T).bfloat16().float()  # the FP8 forward's h
g8 = dq(dy) @ dq(wd.T.contiguous(), (128, 128)).T  # the FP8 dact's d_act
d_h_g8 = swiglu_backward(g8, h, w, None)[0]
for name, got in (("wgrad operands quantised (1x128 along tokens)", _token_wgrad(d_h, x)),
                  ("h from the FP8 forward", swiglu_backward(g, h8, w, None)[0].T @ x),
                  ("d_act from the FP8 dact", d_h_g8.T @ x)):
    e = row_errors(got)
    top = torch.topk(e, 4)
    print(f"{name:48s} median {e.median():.4f} max {e.max():.3f} worst rows {top.indices.tolist()} "
          f"{[round(v, 3) for v in top.values.tolist()]}")
k = FEATURE - cfg.intermediate
silu = h[:, k] * torch.sigmoid(h[:, k])
largest = silu.abs().topk(3)
print(f"expert {E}: {len(tok)} rows; feature {FEATURE} (up {k}): silu(gate) largest {largest.values.tolist()}"
      f" at tokens {largest.indices.tolist()}")
contrib = (d_h_g8[:, FEATURE] - d_h[:, FEATURE])[:, None] * x  # each token's share of the row's error
t = int(contrib.norm(dim=1).argmax())
print(f"row {FEATURE} error {contrib.sum(0).norm() / typical:.3f}, without token {t}: "
      f"{(contrib.sum(0) - contrib[t]).norm() / typical:.3f}")
print(f"token {t}: d_act {g[t, k]:.4f}, its FP8 error {g8[t, k] - g[t, k]:.4f}, the column's median |d_act| "
      f"{g[:, k].abs().median():.3f}")
