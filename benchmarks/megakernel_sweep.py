"""The megakernel's forward across its two main knobs: minibatch rows and communication SMs.

Run on the GPUs (repo root; the script starts one rank per GPU; the runs recorded in benchmarks/results are in
benchmarks/recipes.md):

    PYTHONPATH=src python3 benchmarks/megakernel_sweep.py --impl megamoe --preset kimi-k2 --tokens 8192 --out OUT

Every rank builds `megamoe bench`'s problem (seed 0, uniform routing). Two one-knob sweeps around
`megamoe plan`'s KernelConfig, each with the planner's own value added so its plot marker is measured:
minibatch (ring = the planner's, rounded up to whole minibatches) and comm_sms. Each point: CUDA
events as the harness times a pass (slowest rank's median); every iteration's output compared
bitwise with the first point's (the kernel promises the same bits for every config) and, by the
harness's error statistics, with nccl-torch's layer (an independent BF16 implementation). Writes OUT/sweep.json, OUT/sweep.md and two
PNGs, prints the table last, exits 1 when a point differs. Without matplotlib (the GPU machine)
`--replot OUT/sweep.json` draws the plots later. Without a GPU it runs on CPU ranks under the Triton
interpreter (a smoke run: `--preset tiny --tokens 32 --ep 2 --sms 8 --iters 1 --warmup 0`); `--impl unfused`
runs every point without overlap (``KernelConfig.overlap=False``: the megakernel's steps one launch after another).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace

import torch
import triton

if not torch.cuda.is_available():  # CPU ranks run Triton kernels under the interpreter: set before any import of them
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megamoe import planner  # noqa: E402
from megamoe.baselines.nccl_torch import nccl_torch_moe  # noqa: E402
from megamoe.bench.accuracy import TOLERANCES, compare, error_stats  # noqa: E402
from megamoe.bench.harness import pass_work, percentile  # noqa: E402
from megamoe.bench.runners import timed_pass  # noqa: E402
from megamoe.bench.problem import make_problem  # noqa: E402
from megamoe.bench.report import run_metadata  # noqa: E402
from megamoe.config import preset  # noqa: E402
from megamoe.planner.tiles import plan_tiles  # noqa: E402
from megamoe.planner.tuning import COMM_TUNING, Tuning  # noqa: E402
from megamoe.parallel.world import launch  # noqa: E402
from megamoe.planner.rules import GEMM_TFLOPS, H200_SMS  # noqa: E402

MINIBATCHES = (256, 512, 1024, 2048, 4096, 8192)
COMM_SMS = (8, 12, 16, 20, 24, 32, 48)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def sweep_points(args) -> tuple[planner.Plan, list[tuple[str, planner.KernelConfig]]]:
    """The planner's plan and every (sweep, config) to run; invalid configs raise here, before any launch."""
    # The expert GEMMs' tile (128x256 on Hopper, 32x32 under the interpreter): the kernel accepts no other,
    # and megamoe_forward(config=None) plans with it too.
    tile = plan_tiles("down", torch.device(args.device))
    plan = planner.plan(preset(args.preset), args.ep, args.tokens, num_sms=args.sms, precision=args.precision,
                        tile_m=tile.block_m, tile_n=tile.block_n)
    base = plan.config
    if args.grid:  # every (minibatch, comm_sms) pair: where the two knobs interact
        return plan, [("grid", replace(base, minibatch=rows, ring_rows=-(-base.ring_rows // rows) * rows,
                                       comm_sms=sms))
                      for rows in sorted({*args.minibatch, base.minibatch})
                      for sms in sorted({*args.comm_sms, base.comm_sms})]
    points = []
    for rows in sorted({*args.minibatch, base.minibatch}):
        ring = -(-base.ring_rows // rows) * rows  # the planner's ring, in whole minibatches of this size
        points.append(("minibatch", replace(base, minibatch=rows, ring_rows=ring)))
    if args.comm_sms:  # an empty list: the planner's point once, not twice
        points += [("comm_sms", replace(base, comm_sms=sms)) for sms in sorted({*args.comm_sms, base.comm_sms})]
    return plan, points


@torch.no_grad()
def run_rank(world, args, points) -> list[dict] | None:
    """Time and check every point on this rank; rank 0 returns the points (slowest rank's times)."""
    cfg = preset(args.preset)
    p = make_problem(cfg, world.rank, world.size, args.tokens, dtype=torch.bfloat16, device=world.device, seed=0)
    inputs = (world, p.x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down, p.shared, cfg.activation)
    baseline_out = nccl_torch_moe(*inputs)
    from megamoe.megakernel import megamoe_forward
    tuning = None  # an experiment: the comm workers' copy tile
    if args.comm_rows:
        tuning = Tuning(comm=replace(COMM_TUNING, tile_rows=args.comm_rows))
    if args.impl == "megamoe":
        from megamoe.ops.expert_weights import quantize_experts

        # FP8: the weights quantised once, as after an optimizer step (`megamoe bench` does the same)
        experts_q = None if args.precision == "bf16" else quantize_experts(p.w_gate_up, p.w_down, args.precision)

        calls = [0]

        def forward(config):  # no host sync in the pass: N is the same on every rank; checks on the first
            calls[0] += 1
            return megamoe_forward(*inputs, config=config, precision=args.precision, max_tokens=args.tokens,
                                   experts_q=experts_q, check=calls[0] == 1, tuning=tuning)
        if args.graph:
            forward = graphed(forward, lambda config: megamoe_forward(
                *inputs, config=config, precision=args.precision, max_tokens=args.tokens, experts_q=experts_q,
                check=False, tuning=tuning))
    else:
        def forward(config):  # the point's config without overlap: its steps one launch after another
            return megamoe_forward(*inputs, config=replace(config, overlap=False), max_tokens=args.tokens,
                                   tuning=tuning)
    # The harness has tolerances for bf16 only; other precisions get the same statistics and no verdict.
    tolerance = args.precision if args.precision in TOLERANCES else "bf16"
    flops = sum(world.all_gather_object(pass_work(world, p, "fwd")[0])) / world.size  # mean per GPU
    first_out, results = None, []
    for sweep, config in points:
        times, identical, off_by, check = [], True, 0.0, None
        for it in range(args.warmup + args.iters):
            ms, out = timed_pass(world, lambda: forward(config))
            if first_out is None:
                first_out = out.clone()  # a copy: an implementation may hand back a buffer it reuses
            if not torch.equal(out, first_out):  # how far off tells rounding from wrong rows
                identical, off_by = False, max(off_by, error_stats(out, first_out)["max_abs"])
            if check is None:  # the first iteration's errors; later ones are bitwise-checked
                check = compare({"out": out}, {"out": baseline_out}, tolerance)
            if it >= args.warmup:
                times.append(ms)
            del out
        everyone = world.all_gather_object({"times": times, "identical": identical, "off_by": off_by,
                                            "check": check})
        slowest = [max(r["times"][i] for r in everyone) for i in range(len(times))]
        median = percentile(slowest, 0.5)
        results.append({
            "sweep": sweep, **asdict(config),
            "time_ms": median, "time_ms_p10": percentile(slowest, 0.1), "time_ms_p90": percentile(slowest, 0.9),
            "tflops": flops / median / 1e9 if median else None,
            "bitwise_equal": all(r["identical"] for r in everyone),
            "max_abs_vs_first": max(r["off_by"] for r in everyone),
            "max_abs_err": max(r["check"]["max_abs_err"] for r in everyone),
            "rel_err": max(r["check"]["rel_err"] for r in everyone),
            "row_err": max(r["check"]["row_err"] for r in everyone),
            "correct": all(r["check"]["correct"] for r in everyone) if args.precision in TOLERANCES else None,
            "iters": len(times),
        })
    return results if world.rank == 0 else None


def graphed(eager, capture):
    """``forward(config)`` replaying a CUDA graph of ``capture(config)``: each new config first runs ``eager``
    (compiles, builds the kernel, checks), then is captured once; the previous config's graph is dropped
    first, since the world keeps one MegaKernel per layer shape, of one config at a time (``world.resources``)."""
    state = {"config": None, "graph": None, "out": None}

    def forward(config):
        if state["config"] == config:
            state["graph"].replay()
            return state["out"]
        state.update(config=None, graph=None, out=None)
        out = eager(config)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = capture(config)
        state.update(config=config, graph=graph, out=captured)
        return out

    return forward


def markdown(run: dict) -> str:
    """A short Markdown table of the run; the planner's value of the swept knob carries a *."""
    m, base = run["meta"], run["plan"]
    lines = [
        f"# megakernel sweep · {m['impl']} · {m['preset']} · EP {m['ep']} · {m['tokens_per_rank']} tokens/rank · "
        f"{m['precision']}",
        "",
        f"- machine: {m['machine']}; torch {m['torch']}; triton {m['triton']}; commit: {m['commit']}; "
        f"date: {m['date']}",
        f"- command: `{m['command']}`",
        f"- planner: num_sms {base['num_sms']}, comm_sms {base['comm_sms']}, minibatch {base['minibatch']}, "
        f"ring {base['ring_rows']} (* below); errors vs {m.get('baseline', 'the unfused layer')}",
        "",
        "| sweep | minibatch | ring | comm_sms | ms (median) | p10–p90 | TFLOP/s | bitwise = first "
        "| rel err | max abs | correct |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in run["points"]:
        mark = {k: " *" if r["sweep"] in (k, "grid") and r[k] == base[k] else "" for k in ("minibatch", "comm_sms")}
        tflops = "—" if r["tflops"] is None else f"{r['tflops']:.3g}"
        bitwise = "yes" if r["bitwise_equal"] else f"NO (max abs {r['max_abs_vs_first']:.1e})"
        lines.append(
            f"| {r['sweep']} | {r['minibatch']}{mark['minibatch']} | {r['ring_rows']} "
            f"| {r['comm_sms']}{mark['comm_sms']} "
            f"| {r['time_ms']:.3f} | {r['time_ms_p10']:.3f}–{r['time_ms_p90']:.3f} | {tflops} | {bitwise} "
            f"| {r['rel_err']:.2e} | {r['max_abs_err']:.2e} | {r['correct']} |"
        )
    return "\n".join(lines) + "\n"


def plot(run: dict, out_dir: str) -> list[str]:
    """sweep_minibatch.png and sweep_comm_sms.png: median time (p10–p90 bars), the planner's point starred."""
    import matplotlib

    matplotlib.use("Agg")  # no display on the benchmark machines
    import matplotlib.pyplot as plt

    m, paths = run["meta"], []
    for knob, label in (("minibatch", "minibatch rows"), ("comm_sms", "communication SMs")):
        points = sorted((r for r in run["points"] if r["sweep"] == knob), key=lambda r: r[knob])
        if not points:
            continue
        xs, ms = [r[knob] for r in points], [r["time_ms"] for r in points]
        bars = [[t - r["time_ms_p10"] for t, r in zip(ms, points)], [r["time_ms_p90"] - t for t, r in zip(ms, points)]]
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        ax.errorbar(xs, ms, yerr=bars, marker="o", capsize=3, label=f"{m['impl']} forward (p10–p90)")
        chosen = run["plan"][knob]
        ax.axvline(chosen, color="tab:red", linestyle=":", linewidth=1)
        ax.plot([chosen], [ms[xs.index(chosen)]], "r*", markersize=14, label=f"planner: {chosen}")
        if knob == "minibatch":
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set(xlabel=label, ylabel="time (ms, slowest rank's median)",
               title=f"{m['preset']} · EP {m['ep']} · {m['tokens_per_rank']} tokens/rank · {m['precision']} · "
                     f"{m['machine']}")
        ax.title.set_fontsize(9)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        paths.append(os.path.join(out_dir, f"sweep_{knob}.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def write_plots(run: dict, out_dir: str) -> None:
    try:
        print("plots:", ", ".join(plot(run, out_dir)))
    except ImportError:  # the GPU machine may lack matplotlib and cannot install it: plot later with --replot
        print(f"matplotlib is missing: no plots; draw them with --replot {os.path.join(out_dir, 'sweep.json')}")


def main() -> int:
    gpus = torch.cuda.device_count()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impl", choices=("megamoe", "unfused"), default="megamoe")
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    parser.add_argument("--ep", type=int, default=gpus or 2, help="ranks (default: every GPU, or 2 CPU ranks)")
    parser.add_argument("--sms", type=int, default=None, help="num_sms (default: the GPU's SMs, an H200's on CPU)")
    parser.add_argument("--precision", default="bf16", choices=sorted(GEMM_TFLOPS))
    parser.add_argument("--minibatch", type=_ints, default=list(MINIBATCHES))
    parser.add_argument("--comm-sms", type=_ints, default=list(COMM_SMS),
                        help="'' sweeps none: with --minibatch '' only the planner's point runs")
    parser.add_argument("--comm-rows", type=int, default=0,
                        help="rows per comm copy step (default: the kernel's COMM_TUNING)")
    parser.add_argument("--graph", action="store_true",
                        help="time passes replayed from a CUDA graph (megamoe on GPUs; each point captured once)")
    parser.add_argument("--grid", action="store_true", help="every (minibatch, comm_sms) pair, not two one-knob sweeps")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="megakernel_sweep")
    parser.add_argument("--replot", metavar="SWEEP_JSON", help="only redraw the plots and table of a recorded run")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            run = json.load(f)
        write_plots(run, os.path.dirname(os.path.abspath(args.replot)))
        print(markdown(run))
        return 0

    if args.graph and (not gpus or args.impl != "megamoe"):
        parser.error("--graph times CUDA-graph replays of the megakernel: it needs --impl megamoe and a GPU")
    args.device = device = "cuda" if gpus else "cpu"
    args.sms = args.sms or (torch.cuda.get_device_properties(0).multi_processor_count if gpus else H200_SMS)
    try:
        plan, points = sweep_points(args)
    except ValueError as exc:  # a bad knob value: say which before starting any rank
        parser.error(str(exc))
    except StopIteration:  # megamoe.planner's search for comm_sms came up empty (small layers on few SMs)
        parser.error(f"megamoe plan finds no comm_sms that keeps up on {args.sms} SMs; give more --sms")
    print(f"megakernel sweep: {args.impl}, {args.preset}, EP {args.ep} on {device}, {len(points)} points, "
          f"{args.warmup}+{args.iters} iterations each")
    results = launch(run_rank, args.ep, args, points, device=device)[0]
    meta = run_metadata(device)
    run = {
        "meta": {**meta, "impl": args.impl + ("-graph" if args.graph else ""), "preset": args.preset, "ep": args.ep,
                 "tokens_per_rank": args.tokens, "baseline": "nccl-torch's layer",
                 "precision": args.precision, "device": device,
                 "torch": torch.__version__,
                 "triton": triton.__version__, "command": " ".join(["python3", *sys.argv])},
        "plan": {**asdict(plan.config), "reasoning": plan.reasoning},
        "points": results,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(run, f, indent=1)
    table = markdown(run)
    with open(os.path.join(args.out, "sweep.md"), "w") as f:
        f.write(table)
    write_plots(run, args.out)
    print(table)
    bad = [r for r in results if not r["bitwise_equal"] or r["correct"] is False]
    if bad:
        print(f"{len(bad)} point(s) differ from the first point's bits or from nccl-torch's layer")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
