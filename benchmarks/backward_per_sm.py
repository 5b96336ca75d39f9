"""The backward megakernel's dact, dx and wgrad tiles per compute SM against the standalone kernels on the same
rows, in interleaved rounds at the power cap (one GPU): issue 48's gate for the fused backward as the default.

    PYTHONPATH=src python3 benchmarks/backward_per_sm.py [--preset kimi-k2] [--tokens 8192] [--rounds 3]
        [--seconds 0.3] [--experts E] [--out DIR]
    python3 benchmarks/backward_per_sm.py --from DIR/backward_per_sm_<preset>_<tokens>[_<experts>].json  # no GPU

One rank runs the backward megakernel (TRACE build, ``one_rank_megakernel``: its compute workers run the tiles
they run at EP 2 and beyond, its comm workers copy local rows) through the backward's ring (one window at the
planner's ring). Each round runs backward passes for --seconds, then each standalone expert backward for --seconds
on the schedule's own expert counts (random rows): ``library`` the composed path's call (on Hopper the Gluon dact
and wgrads), ``triton`` with ``warp_specialized=False`` (the tiles the megakernel inlines); the standalone
kernels' device time per kind comes from a profiled call after the timed ones. The round's last pass is decoded
(`megamoe.tools.trace.summary`): the compute workers' mean time in dact, dx and wgrad tasks, waits excluded.
Per-SM rate of the megakernel against a standalone call = (standalone ms x SMs) / (megakernel ms x compute SMs).
Prints one table; writes DIR/backward_per_sm_<preset>_<tokens>[_<experts>].json. ``--from`` prints a recorded
run's table again.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

import torch

from megamoe.bench.experts import kernel_times
from megamoe.bench.problem import make_problem
from megamoe.config import preset
from megamoe.megakernel import MegaKernel, fuse_shared
from megamoe.megakernel.saved import SavedForward
from megamoe.ops.experts_bwd import expert_backward
from megamoe.planner import LayerShape
from megamoe.tools.trace import decode, summary

from ab_record import measure_or_replay  # benchmarks/, beside this script
from sustained import run_for

#: Kernel names of each kind in the standalone backward (Gluon and Triton).
KINDS = {"dact": ("dact_ws_kernel", "dact_swiglu_bwd_kernel"), "dx": ("dx_kernel",),
         "wgrad": ("wgrad_ws_kernel", "wgrad_kernel")}


def _role_ms(kernel: MegaKernel) -> dict[str, float]:
    record = {"ranks": [{"rank": 0, "programs": decode(kernel.trace, kernel.config.bwd_comm_sms)}]}
    row = next(r for r in summary(record) if r["role"] == "compute")
    return {**{kind: row.get(f"{kind}_ms", 0.0) for kind in KINDS}, "end": row["end_ms"],
            "dropped_events": row["dropped_events"]}


def _kind_ms(times: dict[str, float]) -> dict[str, float]:
    return {kind: sum(ms for name, ms in times.items() if any(name.startswith(k) for k in names))
            for kind, names in KINDS.items()}


def _measure(world, a) -> dict:
    cfg = preset(a.preset)
    if a.experts:  # another EP degree's rows per expert on one GPU
        cfg = dataclasses.replace(cfg, num_experts=a.experts)
    p = make_problem(cfg, world.rank, world.size, a.tokens, dtype=torch.bfloat16, device=world.device)
    fused = fuse_shared(p.shared)
    kernel = MegaKernel(world, LayerShape.of(cfg, world.size, a.tokens), trace=True, one_rank_megakernel=True,
                        replay=False)
    with torch.no_grad():
        _, ctx = kernel.forward(p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, fused, cfg.activation)
    saved = SavedForward(ctx.buffers.h, ctx.buffers.shared_h, ctx.schedule)

    def megakernel_pass():
        return kernel.backward(saved, p.d_out, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, fused,
                               cfg.activation, check=False, fused=True)

    megakernel_pass()
    kernel.check_errors()
    s = ctx.schedule
    counts, offsets = s.tokens_per_expert.clone(), s.offsets.clone()
    rows = int((offsets + counts).max())
    dev, d, i = p.w_gate_up.device, cfg.hidden, cfg.intermediate
    g = torch.Generator(device=dev).manual_seed(rows)
    dy, x = (torch.randn(rows, d, generator=g, device=dev).bfloat16() for _ in range(2))
    h = torch.randn(rows, 2 * i, generator=g, device=dev).bfloat16()
    w = torch.rand(rows, generator=g, device=dev)
    calls = {variant: (lambda ws=ws: expert_backward(dy, w, x, h, counts, offsets, p.w_gate_up, p.w_down,
                                                     warp_specialized=ws))
             for variant, ws in (("library", True), ("triton", False))}
    c = kernel.config
    compute_sms, sms = c.num_sms - c.bwd_comm_sms, c.num_sms
    passes, standalone = [], {v: [] for v in calls}
    for r in range(a.rounds + 1):  # round 0 warms up
        start, end, n = run_for(megakernel_pass, a.seconds, 1)
        torch.cuda.synchronize()
        if r:
            passes.append({**_role_ms(kernel), "pass_ms": 1e3 * (end - start) / n})
        for variant, fn in calls.items():
            start, end, n = run_for(fn, a.seconds, 2)
            if r:
                standalone[variant].append({**_kind_ms(kernel_times(fn, iters=2)), "call_ms": 1e3 * (end - start) / n})
    med = statistics.median
    table = []
    for variant, runs in standalone.items():
        for kind in KINDS:
            ms, mk = med([q[kind] for q in runs]), med([q[kind] for q in passes])
            table.append({"kind": kind, "variant": variant, "standalone_ms": ms, "megakernel_role_ms": mk,
                          "megakernel_pass_ms": med([q["pass_ms"] for q in passes]),
                          "per_sm_ratio": ms * sms / (mk * compute_sms) if mk else None})
    return {"preset": a.preset, "tokens": a.tokens, "rounds": a.rounds, "seconds": a.seconds, "rows": int(s.num_rows),
            "experts": int(counts.numel()), "sms": sms, "compute_sms": compute_sms, "config": str(c), "passes": passes,
            "standalone": standalone, "table": table}


def print_table(r: dict) -> None:
    """The run's record ``r`` (what _measure returns) as the run prints it."""
    rounds, seconds = r.get("rounds", len(r["passes"])), r.get("seconds", "?")  # older records have no seconds
    print(f"{r['preset']} bf16, {r['tokens']} tokens, {r['rows']} rows over {r['experts']} experts, {r['compute_sms']} "
          f"of {r['sms']} SMs compute; {rounds} interleaved rounds of {seconds} s")
    print("| kernel | standalone | standalone ms | megakernel ms in role | per-SM rate, megakernel / standalone |")
    print("|---|---|---|---|---|")
    for t in r["table"]:
        ratio = "-" if t["per_sm_ratio"] is None else f"{100 * t['per_sm_ratio']:.0f} %"
        print(f"| {t['kind']} | {t['variant']} | {t['standalone_ms']:.3f} | {t['megakernel_role_ms']:.3f} | {ratio} |")
    calls = (f"{v} {statistics.median(q['call_ms'] for q in runs):.2f} ms" for v, runs in r["standalone"].items())
    print(f"megakernel pass {statistics.median(q['pass_ms'] for q in r['passes']):.2f} ms; standalone calls "
          + ", ".join(calls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--experts", type=int, default=0, help="routed experts (default: the preset's)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--from", dest="from_", default="", help="a recorded backward_per_sm_*.json: print its table "
                                                                 "(no GPU)")
    a = parser.parse_args()
    measure_or_replay(a, _measure, print_table, f"backward_per_sm_{a.preset}_{a.tokens}" + (f"_{a.experts}" if a.experts else ""))

if __name__ == "__main__":
    main()
