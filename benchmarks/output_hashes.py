"""SHA-256 of the layer's CPU outputs: `megamoe bench`'s default problem and the megakernel test cases.

    python3 benchmarks/output_hashes.py [--ranks 1,2,4] [--parts bench,cases]

Moving code must not move bits: run it before and after, compare the lines. On simulated CPU ranks
(processes over gloo, Triton under the interpreter): the default `megamoe bench` problem (tiny preset, 4
ranks, 256 tokens per rank, seed 0, uniform routing) through every implementation, forward and — where an
implementation has one — backward; then tests/test_megakernel.py's forward cases at each rank count with
the planner's config, a wrapping ring and two other configs. Prints one hash per item and one over all.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _first(*paths: str):
    """The first importable ``module:name`` of ``paths`` (the same function before and after a move)."""
    for path in paths:
        module, name = path.split(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {paths}")


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _grads(g: dict) -> list:
    flat = [g[k] for k in ("x", "router_weights", "w_gate_up", "w_down")]
    for a, b in g["shared"]:
        flat += [a, b]
    return flat


def _bench_default(world) -> dict:
    make_problem = _first("megamoe.bench.problem:make_problem")
    oracle = _first("megamoe.reference.ep:ep_reference_forward_backward",
                    "megamoe.ep_reference:ep_reference_forward_backward")
    megamoe_forward = _first("megamoe.megakernel.forward:megamoe_forward", "megamoe.megakernel:megamoe_forward")
    nccl_torch = _first("megamoe.baselines.nccl_torch:nccl_torch_moe")
    preset = _first("megamoe.config:preset")
    cfg = preset("tiny")
    p = make_problem(cfg, world.rank, world.size, 256, dtype=torch.bfloat16, device=world.device, seed=0)
    out, grads = oracle(world, p)
    hashes = {"reference fwd": _digest([out]), "reference bwd": _digest(_grads(grads))}
    args = (world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared, cfg.activation)
    with torch.no_grad():
        for precision in ("bf16", "fp8-block", "mxfp8"):
            hashes[f"megamoe {precision} fwd"] = _digest([megamoe_forward(*args, precision=precision)])
    leaves = [t.detach().clone().requires_grad_() for t in (p.x, p.router_weights, p.w_gate_up, p.w_down)]
    shared = [(a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()) for a, b in p.shared]
    y = nccl_torch(world, leaves[0], p.top_experts, leaves[1], leaves[2], leaves[3], shared, cfg.activation)
    y.backward(p.d_out)
    hashes["nccl-torch fwd"] = _digest([y])
    hashes["nccl-torch bwd"] = _digest([t.grad for t in leaves] + [t.grad for pair in shared for t in pair])
    return hashes


def _megakernel_cases(world, cases) -> dict:
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import test_megakernel as t  # the cases and their configs

    megamoe_forward = _first("megamoe.megakernel.forward:megamoe_forward", "megamoe.megakernel:megamoe_forward")
    MoEConfig = _first("megamoe.config:MoEConfig")
    hashes = {}
    for name, tokens, routing, drop, seed, limit, shared in cases:
        experts = 9 if world.size == 3 else t.CONFIG.num_experts
        cfg = MoEConfig(**{**t.CONFIG.__dict__, "activation": limit, "shared": shared, "num_experts": experts})
        p = t._problem(world, cfg, tokens, routing, drop, seed)
        args = (world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared, limit)
        outs = [megamoe_forward(*args)] + [megamoe_forward(*args, config=c) for c in (t.WRAPPING, *t.OTHERS)]
        hashes[f"R{world.size} {name}"] = _digest(outs)
    return hashes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="1,2,4", help="rank counts of the megakernel test cases")
    parser.add_argument("--parts", default="bench,cases",
                        help="what to hash: bench (the default problem, every implementation), cases (the megakernel "
                             "test cases); compare only runs of the same parts")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts or parts - {"bench", "cases"}:
        parser.error(f"--parts takes bench and / or cases, got {args.parts!r}")
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    launch = _first("megamoe.parallel.world:launch", "megamoe.world:launch")
    import test_megakernel as t

    every = {}
    if "bench" in parts:
        for rank, hashes in enumerate(launch(_bench_default, 4)):
            every.update({f"bench rank {rank} {k}": v for k, v in hashes.items()})
    for ranks in (int(r) for r in args.ranks.split(",")) if "cases" in parts else ():
        for rank, hashes in enumerate(launch(_megakernel_cases, ranks, t.CASES[ranks])):
            every.update({f"cases rank {rank} {k}": v for k, v in hashes.items()})
    for key, value in every.items():
        print(f"{value}  {key}")
    print(f"{hashlib.sha256(repr(sorted(every.items())).encode()).hexdigest()[:16]}  all")


if __name__ == "__main__":
    main()
