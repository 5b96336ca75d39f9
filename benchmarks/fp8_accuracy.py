"""The layer's gradient errors in each routed-expert precision against the FP32 oracle, per tensor, side by side
(CPU ranks: the Triton kernels under the interpreter).

    python3 benchmarks/fp8_accuracy.py [--presets tiny,kimi-k2/16,qwen3.5-397b/8] [--tokens 32] [--ranks 2]
        [--precisions bf16,fp8-block,mxfp8] [--out DIR]

A preset ``name/s`` is that preset scaled down: D and I divided by s and rounded to multiples of 128 (fp8-block's
blocks), the shared sizes by s (multiples of 32), at most 16 experts and k <= 4. `megamoe bench`'s problem (seed
0, uniform routing) on --ranks CPU ranks; ``megamoe.moe`` forward and backward with a random upstream gradient
against ``ep_reference_forward_backward`` (FP32). Prints a Markdown table (relative L1 / the worst row's relative
L2 per tensor, rank 0) and writes DIR/fp8_accuracy.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from megamoe.autograd import moe
from megamoe.bench.harness import _flatten, error_stats
from megamoe.bench.problem import make_problem
from megamoe.config import MoEConfig, preset
from megamoe.parallel.world import launch
from megamoe.reference.ep import ep_reference_forward_backward


def scaled(name: str) -> MoEConfig:
    """``name`` or ``name/s`` (see the module docstring)."""
    base, _, by = name.partition("/")
    cfg = preset(base)
    if not by:
        return cfg
    s = int(by)

    def to(v, m):
        return max(m, round(v / s / m) * m)

    return MoEConfig(hidden=to(cfg.hidden, 128), intermediate=to(cfg.intermediate, 128),
                     num_experts=min(cfg.num_experts, 16), top_k=min(cfg.top_k, 4),
                     shared=tuple(to(v, 32) for v in cfg.shared), activation=cfg.activation)


def run_rank(world, opts: dict) -> dict:
    out = {}
    for name in opts["presets"]:
        cfg = scaled(name)
        p = make_problem(cfg, world.rank, world.size, opts["tokens"], dtype=torch.bfloat16, seed=0)
        want_out, want = ep_reference_forward_backward(world, p)
        want = {"out": want_out, **_flatten(want)}
        per = {}
        for precision in opts["precisions"]:
            leaves = {k: getattr(p, k).detach().clone().requires_grad_()
                      for k in ("x", "router_weights", "w_gate_up", "w_down")}
            shared = [(a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()) for a, b in p.shared]
            y = moe(world, leaves["x"], p.top_experts, leaves["router_weights"], leaves["w_gate_up"],
                    leaves["w_down"], shared, cfg.activation, precision=precision)
            y.backward(p.d_out)
            grads = {k: t.grad for k, t in leaves.items()}
            grads["shared"] = [(a.grad, b.grad) for a, b in shared]
            got = {"out": y.detach(), **_flatten(grads)}
            per[precision] = {k: {m: float(v) for m, v in error_stats(got[k], ref).items() if m in ("rel", "row")}
                              for k, ref in want.items() if ref.numel()}
        out[name] = {"config": vars(cfg) | {"shared": list(cfg.shared)}, "errors": per}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny,kimi-k2/16,deepseek-v4-pro/16")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--precisions", default="bf16,fp8-block,mxfp8")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    opts = dict(presets=a.presets.split(","), tokens=a.tokens, precisions=a.precisions.split(","))
    r = launch(run_rank, a.ranks, opts)[0]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fp8_accuracy.json"), "w") as f:
        json.dump({"args": vars(a), "rank0": r}, f, indent=1)
    precisions = opts["precisions"]
    print(f"{a.tokens} tokens per rank, {a.ranks} CPU ranks, rank 0; relative L1 / worst row's relative L2")
    print("| shape | tensor | " + " | ".join(precisions) + " |")
    print("|---|---|" + "---|" * len(precisions))
    for name, res in r.items():
        c = res["config"]
        shape = f"{name} (D {c['hidden']}, I {c['intermediate']}, E {c['num_experts']}, k {c['top_k']})"
        for tensor in res["errors"][precisions[0]]:
            cells = [f"{res['errors'][p][tensor]['rel']:.2e} / {res['errors'][p][tensor]['row']:.2f}"
                     for p in precisions]
            print(f"| {shape} | {tensor} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
