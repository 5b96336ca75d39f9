"""Where a training step (or its backward) goes on the GPU: every kernel named and grouped, side by side.

    PYTHONPATH=src python3 benchmarks/backward_kernels.py [--preset kimi-k2] [--tokens 8192] [--ranks 1]
        [--impl nccl-torch,megamoe] [--pass step|bwd] [--routing uniform|zipf|zipf-A|one-rank]
        [--experts bf16|fp8-block|mxfp8] [--host] [--steady 2] [--rounds 3] [--out DIR]
    python3 benchmarks/backward_kernels.py --from DIR/backward_kernels_<preset>_<tokens>_<pass>.json  # no GPU

`megamoe bench`'s problem (seed 0, uniform routing unless --routing) and runners (megamoe's routed experts in
--experts, bf16 by default). Each implementation first runs two steps (its compiles and its CUDA graph's capture),
then steps back to back for --steady seconds (the GPU at its power cap, as a training loop sees it), then two
profiled passes not kept (the profiler moves allocations: graphs re-capture there), then --rounds profiled passes,
the implementations interleaved round by round. A pass is a whole step (forward + backward, the default) or a
backward after an untimed forward (``--pass bwd``), under torch.profiler (CUDA activity; with --host the host's
operators too). Rank 0 prints, per implementation, the pass's wall time between CUDA events (median of
the rounds), its kernels' time grouped by kind (expert GEMM tiles, quantisers, row copies, weighted sums, schedule,
elementwise, memsets and copies), the time no kernel ran (launch gaps, host work, allocations), the largest
kernels, and the gaps between device work (``gaps``: whether each one waited for the host's launch, the host
operator around that launch with --host, and the host's syncs, allocations and graph captures) and at the pass's
two ends (the host's time to its first launch, with --host what it ran meanwhile, Python frames included); writes
DIR/backward_kernels_<preset>_<tokens>_<pass>.json (every kernel of the median round) and
DIR/<preset>_<tokens>_<pass>_<impl>.json.gz (``_<routing>`` after the pass unless uniform, then ``_<experts>``
unless bf16; that round's Chrome / Perfetto trace). Each runner's gradients are dropped after its pass, so that two
implementations' gradients need not fit at once. ``--from`` prints a recorded run's report again.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import statistics
import tempfile
import time
from collections import defaultdict

import torch

from megamoe.bench.problem import make_problem, zipf_exponent
from megamoe.bench.runners import RUNNERS, TAKES_EXPERT_FORMAT
from megamoe.config import preset
from megamoe.megakernel.replay import graph_counts
from megamoe.precision import PRECISIONS
from megamoe.parallel.world import launch

#: Kernel kinds by name, first match wins (Triton kernels keep their function names; cuBLAS's and PyTorch's are
#: matched by their families).
KINDS = (
    ("expert GEMM tiles", r"gate_up|down_|_down|dact|dx_|wgrad|forward_ws|forward_fp8_ws|grouped|gemm|_mm|nvjet|"
                          r"cutlass|xmma|sm90|megakernel"),
    ("quantisers", r"quant|scale|e4m3|fp8|mx"),
    ("schedule / routing", r"schedule|row_tiles|rout|histogram|sort|bincount|cumsum|scan|barrier"),
    ("row copies (pull / push / all-to-all)", r"pull|push|dispatch|combine|copy_rows|all_to_all|nccl|gather|scatter"),
    ("weighted sums", r"weighted_sum"),
    ("memsets / copies", r"memset|memcpy|fill|zero"),
    ("elementwise / reductions", r"elementwise|vectorized|reduce|silu|mul|add|index"),
)


def kind(name: str) -> str:
    low = name.lower()
    for label, pattern in KINDS:
        if re.search(pattern, low):
            return label
    return "other"


def profiled(fn, host: bool = False) -> tuple[float, list[dict], dict]:
    """``fn()`` under torch.profiler: its wall ms between CUDA events, its kernels (name, start and duration in
    µs) and the Chrome trace (with ``host``, the host's operators too: what each gap waited on)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if host else [])
    with torch.profiler.profile(activities=activities, with_stack=host) as prof:  # with --host: Python frames too
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    return start.elapsed_time(end), trace_kernels(trace), trace


def trace_kernels(trace: dict) -> list[dict]:
    """The device work of a Chrome trace (kernels, memsets, memcpys): name, start and duration in µs."""
    return [dict(name=e["name"], ts=float(e["ts"]), dur=float(e["dur"]))
            for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]


def account(ms: float, kernels: list[dict]) -> dict:
    """The pass's kernel time by kind and name, and the time no kernel ran (wall - union of kernel spans)."""
    spans = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels)
    busy, reach = 0.0, float("-inf")
    for a, b in spans:
        if b > reach:
            busy += b - max(a, reach)
            reach = b
    by_kind, by_name, launches = defaultdict(float), defaultdict(float), defaultdict(int)
    for k in kernels:
        by_kind[kind(k["name"])] += k["dur"] / 1e3
        by_name[k["name"][:100]] += k["dur"] / 1e3
        launches[k["name"][:100]] += 1
    return {"ms": ms, "busy_ms": busy / 1e3, "idle_ms": max(ms - busy / 1e3, 0.0), "launches": len(kernels),
            "kinds": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "kernels": [{"name": n, "kind": kind(n), "ms": t, "launches": launches[n]}
                        for n, t in sorted(by_name.items(), key=lambda kv: -kv[1])]}


#: The host calls that stop the host or grow memory (each one a likely gap's cause when it sits in the step).
STALLS = re.compile(r"Synchronize|^cudaMemcpy$|^cudaMalloc|^cudaFree|^cudaHostAlloc|^cudaFreeHost|Capture|^cudaGraph")


def gaps(trace: dict, min_us: float = 5.0) -> dict:
    """Where the GPU ran nothing between two pieces of device work, and why: for each gap of at least ``min_us``,
    the work after it, and how long after the gap began the host's call that launched it returned (``late``; the
    launch came before the gap ended, so a positive ``late`` is a host-bound gap, a negative one a gap the device
    waited through on its own) with the innermost host operator around that call (a trace with host activity,
    ``--host``; else none). Also the host calls in the trace that stall the host or grow memory (``STALLS``)."""
    events = trace["traceEvents"]
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                    key=lambda e: e["ts"])
    calls = {e["args"]["correlation"]: e for e in events
             if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = sorted((e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e),
                 key=lambda e: e["ts"])
    found = []
    reach = device[0]["ts"] if device else 0.0
    for e in device:
        if e["ts"] - reach >= min_us:
            call = calls.get(e.get("args", {}).get("correlation"))
            late = None if call is None else call["ts"] + call["dur"] - reach
            found.append({"us": e["ts"] - reach, "before": e["name"][:80], "late_us": late,
                          "api": None if call is None else call["name"], "host_op": _host_op(ops, call)})
        reach = max(reach, e["ts"] + e["dur"])
    host_bound = sum(g["us"] for g in found if g["late_us"] is not None and g["late_us"] > 0)
    ends = _ends(events, device)
    stalls = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and STALLS.search(e["name"]):
            stalls[e["name"]][0] += 1
            stalls[e["name"]][1] += e.get("dur", 0.0)
    return {"gaps": found, "gap_ms": sum(g["us"] for g in found) / 1e3, "host_bound_ms": host_bound / 1e3,
            "stalls": {name: {"calls": n, "ms": us / 1e3} for name, (n, us) in sorted(stalls.items())}, **ends}


def _ends(events: list[dict], device: list[dict], top: int = 12) -> dict:
    """The pass's two ends, from its CUDA events' records (the first and the last ``cudaEventRecord*`` call):
    ``lead_us``, from the start event's record returning to the first device work (the GPU idle, as the pass
    starts after a sync: the host's time to its first launch), ``tail_us``, from the last device work's end to the
    end event's record (positive: the GPU waited for the host to finish the pass; negative: the host was that far
    ahead), and with host activity the host operators and Python frames over the lead (``lead_ops``: each one's
    time inside it, nested ones counted in each enclosing one, longest first). None without the records."""
    records = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                      and e["name"].startswith("cudaEventRecord")), key=lambda e: e["ts"])
    if len(records) < 2 or not device:
        return {"lead_us": None, "tail_us": None, "lead_ops": []}
    lead_from = records[0]["ts"] + records[0].get("dur", 0.0)
    lead_to = device[0]["ts"]
    inside = defaultdict(float)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function") and "dur" in e:
            overlap = min(e["ts"] + e["dur"], lead_to) - max(e["ts"], lead_from)
            if overlap > 0:
                inside[e["name"][:80]] += overlap
    return {"lead_us": lead_to - lead_from, "tail_us": records[-1]["ts"] - max(e["ts"] + e["dur"] for e in device),
            "lead_ops": [{"name": n, "us": us} for n, us in sorted(inside.items(), key=lambda kv: -kv[1])[:top]]}


def _host_op(ops: list[dict], call: dict | None) -> str | None:
    """The innermost host operator on ``call``'s thread whose span holds it (None without host activity)."""
    if call is None:
        return None
    best = None
    for op in ops:
        if op["ts"] > call["ts"]:
            break
        if op.get("tid") == call.get("tid") and op["ts"] + op["dur"] >= call["ts"] + call.get("dur", 0.0):
            best = op  # later starts are nested deeper
    return None if best is None else best["name"][:80]


#: profiled passes per implementation before the kept rounds (their captures and allocations settle there)
PROFILED_WARMUP = 2


def drop_grads(runner) -> None:
    for t in getattr(runner, "_all_leaves", tuple)():
        t.grad = None


def run_rank(world, opts: dict) -> dict:
    cfg = preset(opts["preset"])
    p = make_problem(cfg, world.rank, world.size, opts["tokens"], dtype=torch.bfloat16, device=world.device, seed=0,
                     routing=opts["routing"])
    per_expert = torch.bincount(p.top_experts[p.top_experts >= 0].flatten(), minlength=cfg.num_experts)
    out = {"rows_per_expert": {"min": int(per_expert.min()), "median": float(per_expert.float().median()),
                               "max": int(per_expert.max()), "experts": cfg.num_experts}}
    # megamoe's routed experts in --experts (FP8: the weights' pack made once, outside the profiled steps)
    runners = {impl: RUNNERS[impl](world, p, *([opts["experts"]] if impl in TAKES_EXPERT_FORMAT else []))
               for impl in opts["impl"]}
    for impl, runner in runners.items():  # compile, then the steady state a training loop sees
        for _ in range(2):  # compiles and the kernels' CUDA graph capture go before the steady clock starts
            runner.step()
            drop_grads(runner)
        torch.cuda.synchronize()
        t0, steps = time.perf_counter(), 0
        while time.perf_counter() - t0 < opts["steady"] or steps < 3:
            runner.step()
            drop_grads(runner)
            steps += 1
        torch.cuda.synchronize()
    out["graphs_after_steady"] = graph_counts(world)
    rounds = defaultdict(list)
    # two profiled passes each first, not kept: under the profiler the allocator hands out other addresses, so the
    # graphs' keys change once and re-capture there (2026-12-06-h100-backward-graphs: inside the kept rounds)
    for r in range(PROFILED_WARMUP + opts["rounds"]):
        if r == PROFILED_WARMUP:
            out["graphs_before_rounds"] = graph_counts(world)
        for impl, runner in runners.items():
            world.barrier("profile")
            if opts["pass"] == "step":
                ms, kernels, trace = profiled(runner.step, opts["host"])
            else:
                y = runner.train_forward()
                torch.cuda.synchronize()
                ms, kernels, trace = profiled(lambda: runner.backward(y), opts["host"])
                del y
            if r >= PROFILED_WARMUP:
                rounds[impl].append((ms, kernels, trace))
            drop_grads(runner)
    out["graphs_after_rounds"] = graph_counts(world)  # captures between the two: a step re-capturing its graph
    for impl, got in rounds.items():
        ms, kernels, trace = sorted(got, key=lambda r: r[0])[len(got) // 2]
        out[impl] = account(ms, kernels)
        out[impl]["gaps"] = gaps(trace)
        out[impl]["rounds_ms"] = [r[0] for r in got]
        if world.rank == 0 and opts["out"]:
            name = (f"{record_name(opts['preset'], opts['tokens'], opts['pass'], opts['routing'], opts['experts'])}"
                    f"_{impl}.json.gz")
            with gzip.open(os.path.join(opts["out"], name), "wt") as f:
                json.dump(trace, f)
    return out


def record_name(preset: str, tokens: int, pass_: str, routing: str, experts: str = "bf16") -> str:
    """``<preset>_<tokens>_<pass>``, with ``_<routing>`` unless uniform and ``_<experts>`` unless bf16 (the records
    before those options were uniform and bf16)."""
    return (f"{preset}_{tokens}_{pass_}" + ("" if routing == "uniform" else f"_{routing}")
            + ("" if experts == "bf16" else f"_{experts}"))


def print_report(args: dict, r: dict, top: int) -> None:
    """Rank 0's record ``r`` of a run with ``args`` (the JSON's "args" and "rank0") as the run prints it."""
    print(f"{args['preset']}, {args['tokens']} tokens/rank, {args['ranks']} rank(s), pass {args['pass_']}, "
          f"{args.get('routing', 'uniform')} routing, megamoe's experts {args.get('experts', 'bf16')}; routed "
          f"rows per expert: {r['rows_per_expert']}")
    if "graphs_after_rounds" in r:  # records before 2026-12-06 have none
        before = f", before the kept rounds {r['graphs_before_rounds']}" if "graphs_before_rounds" in r else ""
        print(f"megamoe's CUDA graphs after the steady steps {r['graphs_after_steady']}{before}, after the profiled "
              f"rounds {r['graphs_after_rounds']}")
    for impl in args["impl"].split(","):
        x = r[impl]
        print(f"{impl}: {x['ms']:.2f} ms between events (rounds {', '.join(f'{v:.2f}' for v in x['rounds_ms'])}; "
              f"median of {statistics.median(x['rounds_ms']):.2f}), kernels busy {x['busy_ms']:.2f} ms, no kernel "
              f"{x['idle_ms']:.2f} ms, {x['launches']} launches")
        for label, ms in x["kinds"].items():
            print(f"  {ms:8.3f} ms  {100 * ms / x['ms']:5.1f} %  {label}")
        for k in x["kernels"][:top]:
            print(f"    {k['ms']:8.3f} ms  x{k['launches']:<4} {k['name']}")
        if "gaps" in x:  # records before 2026-12-06 have none
            print_gaps(x["gaps"], top)


def print_gaps(g: dict, top: int) -> None:
    print(f"  gaps between device work: {g['gap_ms']:.3f} ms, {g['host_bound_ms']:.3f} ms of it waiting for the host's "
          f"launch; host stalls: " + (", ".join(f"{n} x{s['calls']} {s['ms']:.3f} ms" for n, s in g["stalls"].items())
                                      or "none"))
    for gap in sorted(g["gaps"], key=lambda x: -x["us"])[:top]:
        late = "" if gap["late_us"] is None else f", launched {gap['late_us']:+.1f} us into it by {gap['api']}"
        op = f" in {gap['host_op']}" if gap["host_op"] else ""
        print(f"    {gap['us']:8.1f} us before {gap['before'][:60]}{late}{op}")
    if g.get("lead_us") is not None:  # records before 2026-12-07 have none
        print(f"  the pass's ends: {g['lead_us']:.1f} us from the start event's record to the first device work, "
              f"{g['tail_us']:+.1f} us from the last device work's end to the end event's record")
        for op in g["lead_ops"][:top]:
            print(f"    {op['us']:8.1f} us of the lead in {op['name']}")


def routing(text: str) -> str:
    """--routing's type: a routing ``make_problem`` knows (``zipf_exponent``'s ValueError otherwise)."""
    zipf_exponent(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--impl", default="nccl-torch,megamoe")
    parser.add_argument("--pass", dest="pass_", choices=("step", "bwd"), default="step")
    parser.add_argument("--routing", type=routing, default="uniform",
                        help="the bench problem's routing: uniform, zipf, zipf-A (popularity exponent A) or one-rank")
    parser.add_argument("--experts", choices=PRECISIONS, default="bf16", help="megamoe's routed-expert format")
    parser.add_argument("--steady", type=float, default=2.0, help="seconds of steps before the profiled rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--host", action="store_true", help="profile the host's operators too: each gap's host op")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--from", dest="from_", default="", help="a recorded backward_kernels_*.json: print its "
                                                                 "report (no GPU)")
    a = parser.parse_args()
    if a.from_:
        with open(a.from_) as f:
            rec = json.load(f)
        print_report(rec["args"], rec["rank0"], a.top)
        return
    os.makedirs(a.out, exist_ok=True)
    opts = dict(preset=a.preset, tokens=a.tokens, impl=a.impl.split(","), pass_=a.pass_, steady=a.steady,
                rounds=a.rounds, out=a.out, routing=a.routing, experts=a.experts,
                host=a.host)
    opts["pass"] = opts.pop("pass_")
    r = launch(run_rank, a.ranks, opts, device="cuda")[0]
    name = f"backward_kernels_{record_name(a.preset, a.tokens, a.pass_, a.routing, a.experts)}.json"
    args = {k: v for k, v in vars(a).items() if k != "from_"}
    with open(os.path.join(a.out, name), "w") as f:
        json.dump({"args": args, "rank0": r}, f, indent=1)
    print_report(args, r, a.top)


if __name__ == "__main__":
    main()
