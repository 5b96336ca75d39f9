"""The backward's peak memory per rank at several EP sizes with the same tokens per rank (ranks sharing one GPU),
beside the planner's accounting: issue 48's "memory per rank independent of R".

    PYTHONPATH=src python3 benchmarks/backward_memory.py [--preset qwen3-30b-a3b] [--tokens 8192] [--ranks 1,2,4]
        [--fused] [--out DIR]

For each R, R ranks on one GPU (``megamoe.launch``) each run ``megamoe.moe`` on ``make_problem``'s tokens (uniform
routing): two training steps (compile; the backward's ring and buffers made), then a forward, and around its
backward the CUDA caching allocator's counters: the peak bytes the backward adds on top of what was allocated
before it (its ring and launcher buffers are allocated already: they are counted apart, from their tensors), minus
the weight gradients it returns (weights-sized, like the weights the plan leaves out). Beside them the planner's
backward entries (``megamoe.planner.memory.backward_memory``) and its pass total. Prints one table (the largest
rank of each R); writes DIR/backward_memory_<preset>_<tokens>.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from megamoe.autograd import moe
from megamoe.bench.problem import make_problem
from megamoe.config import preset
from megamoe.megakernel.forward import layer_kernel
from megamoe.parallel.world import launch
from megamoe.planner import LayerShape
from megamoe.planner.memory import backward_memory, pass_memory


def _rank(world, a) -> dict:
    cfg = preset(a.preset)
    p = make_problem(cfg, world.rank, world.size, a.tokens, dtype=torch.bfloat16, device=world.device, seed=0)
    leaves = [p.x.clone().requires_grad_(), p.router_weights.clone().requires_grad_(),
              p.w_gate_up.clone().requires_grad_(), p.w_down.clone().requires_grad_()]
    shared = [(g.clone().requires_grad_(), d.clone().requires_grad_()) for g, d in p.shared]

    def forward():
        for t in leaves + [t for pair in shared for t in pair]:
            t.grad = None
        return moe(world, leaves[0], p.top_experts, leaves[1], leaves[2], leaves[3], shared, cfg.swiglu_limit,
                   max_tokens=a.tokens, check=False, fused_backward=a.fused)

    for _ in range(2):
        forward().backward(p.d_out)
    kernel = layer_kernel(world, LayerShape.of(cfg, world.size, a.tokens), None, "bf16")
    out = forward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out.backward(p.d_out)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grads = sum(t.numel() * t.element_size() for t in (leaves[2], leaves[3]))
    ring = kernel.backward_ring().nbytes
    launcher = kernel._backward
    fused = 0 if launcher is None else sum(t.numel() * t.element_size() for t in vars(launcher.buffers).values())
    planned = backward_memory(cfg, a.tokens, kernel.config.bwd_ring_rows, "bf16", world.size)
    return {"rank": world.rank, "peak_bytes": peak, "weight_grad_bytes": grads, "ring_bytes": ring, "fused_buffers_bytes": fused,
            "backward_bytes": ring + fused + peak - grads, "planned_backward_bytes": sum(planned.values()),
            "planned": planned, "planned_pass_bytes": sum(pass_memory(cfg, world.size, a.tokens, kernel.config,
                                                                       "bf16").values()),
            "config": str(kernel.config)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--fused", action="store_true", help="the backward megakernel (R >= 2) instead of the "
                                                              "composed kernels")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("backward_memory.py measures a GPU's allocator: no CUDA device here")
    results = {}
    for ranks in (int(r) for r in a.ranks.split(",")):
        results[ranks] = launch(_rank, ranks, a, device="cuda")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"backward_memory_{a.preset}_{a.tokens}{'_fused' if a.fused else ''}.json"),
              "w") as f:
        json.dump({"args": vars(a), "ranks": results}, f, indent=1)
    gib = 2**30
    print(f"{a.preset}, {a.tokens} tokens per rank, {'fused' if a.fused else 'composed'} backward, ranks on one GPU")
    print("| EP | backward bytes (ring + launcher + peak - weight grads), GiB | planned backward, GiB | ratio | "
          "peak over base, GiB | weight grads, GiB |")
    print("|---|---|---|---|---|---|")
    for ranks, rows in results.items():
        r = max(rows, key=lambda x: x["backward_bytes"])
        print(f"| {ranks} | {r['backward_bytes'] / gib:.3f} | {r['planned_backward_bytes'] / gib:.3f} | "
              f"{r['backward_bytes'] / r['planned_backward_bytes']:.3f} | {r['peak_bytes'] / gib:.3f} | "
              f"{r['weight_grad_bytes'] / gib:.3f} |")


if __name__ == "__main__":
    main()
