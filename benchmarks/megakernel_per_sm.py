"""The expert tiles inside the forward megakernel, per compute SM, against the standalone kernels on the same rows,
in interleaved rounds at the power cap (one GPU).

    PYTHONPATH=src python3 benchmarks/megakernel_per_sm.py [--preset kimi-k2] [--tokens 16384]
        [--precision bf16|fp8-block] [--rounds 3] [--seconds 0.3] [--stages 3,4] [--out DIR]
    python3 benchmarks/megakernel_per_sm.py --from DIR/megakernel_per_sm_<precision>_<tokens>[_<experts>].json  # no GPU

One rank runs the megakernel (TRACE build, ``one_rank_megakernel``: its compute workers run the tiles they run at
EP 2 and beyond). Each round runs megakernel passes for --seconds, then each standalone call for --seconds, on the
megakernel schedule's own expert counts (random rows, the same counts and offsets): ``library`` is the call the
one-rank layer makes (on Hopper the Gluon kernels where they are adopted), ``triton`` the same with
``warp_specialized=False`` (the tiles the megakernel inlines). The round's last pass is decoded
(`megamoe.tools.trace.summary`): the compute workers' mean time in gate/up and in down tasks, waits excluded.
Per-SM rate of the megakernel against a standalone call = (standalone ms x SMs) / (megakernel ms x compute SMs).
--stages A/Bs the ring depth of the megakernel's tiles (each depth runs its passes in every round).
Prints one table; writes DIR/megakernel_per_sm_<precision>_<tokens>[_<experts>].json. ``--from`` prints a recorded
run's table again.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

import torch

from megamoe.bench.experts import fp8_block_operands
from megamoe.bench.problem import make_problem
from megamoe.config import preset
from megamoe.megakernel import MegaKernel, fuse_shared
from megamoe.ops.experts import down, gate_up
from megamoe.ops.experts_fp8 import down_fp8, gate_up_fp8
from megamoe.planner import LayerShape
from megamoe.tools.trace import decode, summary

from ab_record import measure_or_replay  # benchmarks/, beside this script
from sustained import run_for


def _role_ms(kernel: MegaKernel) -> dict[str, float]:
    """The last pass's compute workers (`megamoe.tools.trace.summary`): mean ms per program in gate/up and down
    tasks; the pass's end."""
    record = {"ranks": [{"rank": 0, "programs": decode(kernel.trace, kernel.config.comm_sms)}]}
    row = next(r for r in summary(record) if r["role"] == "compute")
    return {"gate_up": row.get("gate_up_ms", 0.0), "down": row.get("down_ms", 0.0), "end": row["end_ms"],
            "dropped_events": row["dropped_events"]}


def _standalone_calls(precision: str, counts, offsets, rows: int, w_gate_up, w_down) -> dict:
    """{(kind, variant): fn} on random rows with the schedule's counts."""
    dev, d, i = w_gate_up.device, w_gate_up.shape[2], w_down.shape[2]
    g = torch.Generator(device=dev).manual_seed(rows)
    x = torch.randn(rows, d, generator=g, device=dev).bfloat16()
    if precision == "bf16":
        h = torch.empty(rows, 2 * i, dtype=torch.bfloat16, device=dev)
        act = torch.randn(rows, i, generator=g, device=dev).bfloat16()
        y = torch.empty(rows, d, dtype=torch.bfloat16, device=dev)
        return {("gate_up", "library"): lambda: gate_up(x, counts, offsets, w_gate_up, h=h, act=act),
                ("gate_up", "triton"): lambda: gate_up(x, counts, offsets, w_gate_up, h=h, act=act,
                                                       warp_specialized=False),
                ("down", "library"): lambda: down(act, counts, offsets, w_down, y)}
    q = fp8_block_operands(x, counts, offsets, w_gate_up, w_down)
    f = q.fwd
    gu = lambda **kw: gate_up_fp8(q.x_q, q.x_s, counts, offsets, q.wgu_q, q.wgu_s, f, **kw)  # noqa: E731
    dn = lambda **kw: down_fp8(f.act_q, f.act_scale, counts, offsets, q.wd_q, q.wd_s, f.y, **kw)  # noqa: E731
    return {("gate_up", "library"): gu, ("gate_up", "triton"): lambda: gu(warp_specialized=False),
            ("down", "library"): dn, ("down", "triton"): lambda: dn(warp_specialized=False)}


def _measure(world, a) -> dict:
    cfg = preset(a.preset)
    if a.experts:  # the rows per expert of another EP degree on one GPU (192 at 8192 tokens: kimi-k2 at EP 2)
        cfg = dataclasses.replace(cfg, num_experts=a.experts)
    p = make_problem(cfg, world.rank, world.size, a.tokens, dtype=torch.bfloat16, device=world.device)
    fused = fuse_shared(p.shared)
    kernel = MegaKernel(world, LayerShape.of(cfg, world.size, a.tokens), precision=a.precision, trace=True,
                        one_rank_megakernel=True, replay=False)
    buffers = kernel.scratch_buffers()

    def megakernel_pass():
        return kernel.forward(p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, fused, cfg.activation,
                              buffers=buffers)

    _, ctx = megakernel_pass()
    torch.cuda.synchronize()
    s = ctx.schedule
    rows = int(s.num_rows.item())
    counts, offsets = s.tokens_per_expert.clone(), s.offsets.clone()
    calls = _standalone_calls(a.precision, counts, offsets, int((offsets + counts).max()), p.w_gate_up, p.w_down)
    compute_sms, sms = kernel.config.num_sms - kernel.config.comm_sms, kernel.config.num_sms
    stages = [int(v) for v in a.stages.split(",")] if a.stages else [kernel.launcher.consts["num_stages"]]
    passes, standalone, stamps = {n: [] for n in stages}, {key: [] for key in calls}, []  # stamps: for clock logs
    for r in range(a.rounds + 1):  # round 0 warms up
        for depth in stages:  # the ring's depth of the compute workers' tiles (a launch constant)
            kernel.launcher.consts["num_stages"] = depth
            start, end, n = run_for(megakernel_pass, a.seconds, 1)
            torch.cuda.synchronize()
            stamps.append((f"megakernel/{depth}", start, end))
            if r:
                passes[depth].append({**_role_ms(kernel), "pass_ms": 1e3 * (end - start) / n})
        for key, fn in calls.items():
            start, end, n = run_for(fn, a.seconds, 4)
            stamps.append(("/".join(key), start, end))
            if r:
                standalone[key].append(1e3 * (end - start) / n)
    med = statistics.median
    table = []
    for depth, runs in passes.items():
        for (kind, variant), times in standalone.items():
            mk = med([q[kind] for q in runs])
            ms = med(times)
            table.append({"stages": depth, "kind": kind, "variant": variant, "standalone_ms": ms,
                          "megakernel_role_ms": mk, "megakernel_pass_ms": med([q["pass_ms"] for q in runs]),
                          "per_sm_ratio": ms * sms / (mk * compute_sms)})
    return {"rank": world.rank, "preset": a.preset, "tokens": a.tokens, "precision": a.precision, "rounds": a.rounds,
            "seconds": a.seconds, "rows": rows,
            "experts": int(counts.numel()), "sms": sms, "compute_sms": compute_sms, "config": str(kernel.config),
            "passes": passes, "standalone_ms_rounds": {f"{k}/{v}": t for (k, v), t in standalone.items()},
            "stamps": stamps, "table": table}


def print_table(r: dict) -> None:
    """The run's record ``r`` (what _measure returns) as the run prints it."""
    rounds = r.get("rounds", len(next(iter(r["passes"].values()))))
    seconds = r.get("seconds", "?")  # older records have no seconds
    print(f"{r['preset']} {r['precision']}, {r['tokens']} tokens, {r['rows']} rows over {r['experts']} experts, "
          f"{r['compute_sms']} of {r['sms']} SMs compute; {rounds} interleaved rounds of {seconds} s")
    print("| megakernel stages | pass ms | kernel | standalone | standalone ms | megakernel ms in role | "
          "per-SM rate, megakernel / standalone |")
    print("|---|---|---|---|---|---|---|")
    for t in r["table"]:
        print(f"| {t['stages']} | {t['megakernel_pass_ms']:.2f} | {t['kind']} | {t['variant']} | "
              f"{t['standalone_ms']:.3f} | {t['megakernel_role_ms']:.3f} | {100 * t['per_sm_ratio']:.0f} % |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--precision", choices=("bf16", "fp8-block"), default="bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--experts", type=int, default=0, help="routed experts (default: the preset's)")
    parser.add_argument("--stages", default="", help="ring depths of the megakernel's tiles to A/B, e.g. 3,4 "
                                                      "(default: the planner's)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--from", dest="from_", default="", help="a recorded megakernel_per_sm_*.json: print its "
                                                                 "table (no GPU)")
    a = parser.parse_args()
    measure_or_replay(a, _measure, print_table, f"megakernel_per_sm_{a.precision}_{a.tokens}" + (f"_{a.experts}" if a.experts else ""))

if __name__ == "__main__":
    main()
