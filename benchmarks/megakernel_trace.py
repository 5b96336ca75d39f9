"""Inside one megakernel pass: when each program started and ended and how long it waited (globaltimer).

    PYTHONPATH=src python3 benchmarks/megakernel_trace.py --preset kimi-k2 --tokens 8192 [--config S,C,MB,RING]
        [--precision fp8-block]

One process per GPU. Rank 0 prints, for the communication and the compute workers: time from the first
program's start to their end (mean / max), nanoseconds spent in waits, the shared expert's end; then the
standalone expert kernels (`megamoe.ops.experts.expert_forward`, BF16 only) on the same routed rows, for comparison.
"""

from __future__ import annotations

import json

import torch

from megamoe.bench.problem import make_problem
from megamoe.config import preset
from megamoe.ops.experts import expert_forward
from megamoe.kernels import sync  # the trace's fields
from megamoe.planner import LayerShape
from megamoe.megakernel import MegaKernel, fuse_shared
from megamoe.parallel.world import launch

import megakernel_args  # benchmarks/, beside this script


def _ms(ns) -> float:
    return float(ns) / 1e6


def _trace(world, a):
    cfg = preset(a.preset)
    p = make_problem(cfg, world.rank, world.size, a.tokens, dtype=torch.bfloat16, device=world.device)
    fused = fuse_shared(p.shared)
    shape = LayerShape.of(cfg, world.size, a.tokens)
    kernel = MegaKernel(world, shape, megakernel_args.config_for(a, world, shape), precision=a.precision, trace=True,
                        one_rank_megakernel=True)
    c = kernel.config
    summaries = []
    for _ in range(a.passes):
        _, ctx = kernel.forward(p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, fused, cfg.activation,
                                buffers=kernel.scratch_buffers())
        t = kernel.trace.cpu()
        start_at = t[:, sync.TRACE_START.value].min()
        end = t[:, sync.TRACE_END.value] - start_at
        waited = t[:, sync.TRACE_WAIT_NS.value]
        comm, compute = slice(0, c.comm_sms), slice(c.comm_sms, None)
        summaries.append({
            "kernel_ms": _ms(end.max()),
            "comm_end_ms_mean": _ms(end[comm].float().mean()), "comm_end_ms_max": _ms(end[comm].max()),
            "comm_wait_ms_mean": _ms(waited[comm].float().mean()),
            "compute_end_ms_min": _ms(end[compute].min()),
            "compute_end_ms_mean": _ms(end[compute].float().mean()),
            "compute_end_ms_max": _ms(end[compute].max()),
            "compute_wait_ms_mean": _ms(waited[compute].float().mean()),
            "compute_wait_ms_max": _ms(waited[compute].max()),
            # of the compute workers' waits: on rows_ready (communication behind), on tile_done (a down task
            # before its row tile's gate/up is done); the rest on the shared expert's gate/up
            "compute_wait_rows_ms_mean": _ms(t[compute, sync.TRACE_WAIT_ROWS_NS.value].float().mean()),
            "compute_wait_tile_ms_mean": _ms(t[compute, sync.TRACE_WAIT_TILE_NS.value].float().mean()),
            "compute_waits_mean": float(t[compute, sync.TRACE_WAITS.value].float().mean()),
            "shared_end_ms_mean": _ms((t[compute, sync.TRACE_SHARED_END.value] - start_at).float().mean()),
        })
    # where the comm workers ran, and how many share a TPC (SMs 2i, 2i + 1) with a compute worker (odd comm_sms
    # counts ran 3-8 % slower: benchmarks/results/2026-11-30-own-outputs)
    sms = t[:, sync.TRACE_SM.value].tolist()
    comm_sms_on, compute_on = sms[: c.comm_sms], set(sms[c.comm_sms:])
    placement = {"comm_worker_sms": comm_sms_on,
                 "comm_workers_sharing_a_tpc_with_compute": sum(sm ^ 1 in compute_on for sm in comm_sms_on)}
    rows = int(ctx.schedule.num_rows)
    standalone = None
    if rows <= c.ring_rows and a.precision == "bf16":  # the ring holds every routed row: time the standalone kernels
        s = ctx.schedule
        args = (ctx.buffers.ring_x, s.tokens_per_expert, s.offsets, p.w_gate_up, p.w_down)
        expert_forward(*args)
        times = []
        for _ in range(3):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            expert_forward(*args)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        standalone = sorted(times)[1]
    return {"rank": world.rank, "config": str(c), "routed_rows": rows, "passes": summaries,
            "standalone_expert_forward_ms": standalone, **placement}


def main() -> None:
    a = megakernel_args.parse(__doc__)
    results = launch(_trace, torch.cuda.device_count(), a, device="cuda")
    text = json.dumps(results, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    for r in results:
        last = r["passes"][-1]
        print(f"rank {r['rank']} rows {r['routed_rows']} standalone experts {r['standalone_expert_forward_ms']} ms | "
              + " ".join(f"{k}={v:.3f}" for k, v in last.items()))
        print(f"rank {r['rank']} comm workers on SMs {r['comm_worker_sms']}; sharing a TPC with a compute worker: "
              f"{r['comm_workers_sharing_a_tpc_with_compute']}")


if __name__ == "__main__":
    main()
