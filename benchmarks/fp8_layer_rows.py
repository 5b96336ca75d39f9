"""Where the FP8 layer's weight gradients are furthest from the FP32 oracle: the worst rows, by expert and
feature, on one GPU (or CPU ranks for a small preset).

    PYTHONPATH=src python3 benchmarks/fp8_layer_rows.py [--preset glm-5] [--tokens 8192] [--experts fp8-block]
        [--device cuda] [--top 8] [--out DIR]

`megamoe bench`'s problem (seed 0, uniform routing) at EP 1 through its megamoe runner in each format of
--experts and bf16; each row of d w_gate_up `[L, 2I, D]` and d w_down `[L, D, I]` against the oracle's, as
`error_stats` measures rows (the error's norm over max(the row's norm, the RMS row norm)). Prints the worst
rows with their expert, feature (gate or up half), the expert's routed rows and the BF16 error of the same
row; writes DIR/fp8_layer_rows.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from megamoe.bench.problem import make_problem
from megamoe.bench.runners import RUNNERS
from megamoe.config import preset
from megamoe.parallel.world import launch
from megamoe.reference.ep import ep_reference_forward_backward


def row_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row of ``[..., C]``: ||got - ref|| / max(||ref||, RMS row norm of ref)."""
    g, r = got.reshape(-1, got.shape[-1]), ref.reshape(-1, ref.shape[-1])
    norms, diffs = [], []
    for a, b in zip(g.split(8192), r.split(8192)):  # fp32 a slice at a time: the gradients are GBs
        b = b.float()
        norms.append(b.norm(dim=1))
        diffs.append((a.float() - b).norm(dim=1))
    norms, diffs = torch.cat(norms), torch.cat(diffs)
    return diffs / torch.maximum(norms, norms.pow(2).mean().sqrt())


def run_rank(world, opts: dict) -> dict:
    cfg = preset(opts["preset"])
    p = make_problem(cfg, world.rank, world.size, opts["tokens"], dtype=torch.bfloat16, device=world.device, seed=0)
    _, oracle = ep_reference_forward_backward(world, p)
    rows_of = torch.bincount(p.top_experts[p.top_experts >= 0].flatten().long(), minlength=cfg.num_experts)
    result = {}
    errors = {}
    for fmt in ("bf16", *opts["experts"]):
        runner = RUNNERS["megamoe"](world, p, fmt) if fmt != "bf16" else RUNNERS["megamoe"](world, p)
        grads = runner.backward(runner.train_forward())
        errors[fmt] = {name: row_errors(grads[name], oracle[name]) for name in ("w_gate_up", "w_down")}
        del runner, grads
        torch.cuda.synchronize() if world.device.type == "cuda" else None
        torch.cuda.empty_cache() if world.device.type == "cuda" else None
    two_i = 2 * cfg.intermediate
    for fmt in opts["experts"]:
        for name, err in errors[fmt].items():
            per = two_i if name == "w_gate_up" else cfg.hidden
            worst = torch.topk(err, opts["top"]).indices.tolist()
            rows = []
            for r in worst:
                e, f = divmod(r, per)
                rows.append({"row": r, "expert": e, "feature": f,
                             "half": ("gate" if f < cfg.intermediate else "up") if name == "w_gate_up" else "-",
                             "expert_rows": int(rows_of[e]), "err": float(err[r]),
                             "bf16_err": float(errors["bf16"][name][r])})
            result[f"{fmt} {name}"] = {"median": float(err.median()), "p99": float(err.quantile(0.99))
                                       if err.numel() < 2**24 else None, "max": float(err.max()), "worst": rows}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="glm-5")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", default="fp8-block")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    opts = {"preset": a.preset, "tokens": a.tokens, "experts": a.experts.split(","), "top": a.top}
    result = launch(run_rank, 1, opts, device=a.device)[0]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fp8_layer_rows.json"), "w") as f:
        json.dump({"args": vars(a), "result": result}, f, indent=1)
    for key, r in result.items():
        print(f"{key}: row error median {r['median']:.3g}, p99 {r['p99']}, max {r['max']:.3g}")
        for w in r["worst"]:
            print(f"   expert {w['expert']:4d} feature {w['feature']:5d} {w['half']:4s} rows {w['expert_rows']:4d}"
                  f"  err {w['err']:.3f}  (bf16 {w['bf16_err']:.4f})")


if __name__ == "__main__":
    main()
