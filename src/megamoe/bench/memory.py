"""What one rank's backward holds on a GPU, measured by the CUDA caching allocator, beside the planner's accounting:
the backward's ring and launcher buffers (allocated at the first backward), plus the peak a backward adds over
what was allocated before it, less the weight gradients it returns (weights-sized, which the plan leaves out)."""

from __future__ import annotations

import torch

from megamoe.autograd import moe
from megamoe.bench.problem import make_problem
from megamoe.config import MoEConfig
from megamoe.megakernel.forward import layer_kernel
from megamoe.planner import LayerShape
from megamoe.planner.memory import backward_memory


def backward_bytes(world, cfg: MoEConfig, tokens: int, *, fused: bool = False, seed: int = 0) -> dict:
    """One rank (collective): a training step (compile; the ring made), a forward, and around its backward the
    allocator's counters. Returns ``backward_bytes`` (ring + launcher + peak - weight gradients), its parts, the
    planner's ``planned`` entries and their sum ``planned_bytes``, and the config."""
    p = make_problem(cfg, world.rank, world.size, tokens, dtype=torch.bfloat16, device=world.device, seed=seed)
    leaves = [p.x.clone().requires_grad_(), p.router_weights.clone().requires_grad_(),
              p.w_gate_up.clone().requires_grad_(), p.w_down.clone().requires_grad_()]
    shared = [(g.clone().requires_grad_(), d.clone().requires_grad_()) for g, d in p.shared]

    def forward():
        for t in leaves + [t for pair in shared for t in pair]:
            t.grad = None
        return moe(world, leaves[0], p.top_experts, leaves[1], leaves[2], leaves[3], shared, cfg.activation,
                   max_tokens=tokens, check=False, fused_backward=fused)

    forward().backward(p.d_out)
    kernel = layer_kernel(world, LayerShape.of(cfg, world.size, tokens), None, "bf16")
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
    own = 0 if launcher is None else sum(t.numel() * t.element_size() for t in vars(launcher.buffers).values())
    planned = backward_memory(cfg, tokens, kernel.config.bwd_ring_rows, "bf16", world.size)
    return {"rank": world.rank, "backward_bytes": ring + own + peak - grads, "ring_bytes": ring,
            "launcher_bytes": own, "peak_bytes": peak, "weight_grad_bytes": grads, "planned": planned,
            "planned_bytes": sum(planned.values()), "config": str(kernel.config)}
