"""`megamoe bench`: check and time layer implementations side by side.

Each rank builds its seeded problem, computes the oracle once
(:mod:`megamoe.reference.ep`) and builds every implementation. Then, pass by
pass: warm-up rounds, ``steady`` seconds of every implementation back to back
(the GPU settles at its power cap's clock), and ``iters`` timed rounds, each
timing every (impl, expert format) once in the same order, so that drift of
the clock or the machine reaches every implementation alike. The first run of
each (impl, pass) is checked against the oracle (the output, or every
gradient). Times: CUDA events on GPUs (every round's time is the slowest
rank's), the wall clock between barriers on the CPU. One JSON record per
(impl, pass): p10 / p50 / p90, TFLOP/s, the time over the physical floor
(:mod:`megamoe.bench.machine`), the machine, the commit and the settings. The implementations' runners:
:mod:`megamoe.bench.runners`.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from functools import partial

import torch

from megamoe.baselines import deepep_torch
from megamoe.bench.accuracy import TOLERANCES, _flatten, bounds, compare, parked_on_host
from megamoe.bench.machine import ClockSample, clock_range, floor_ms, machine_info
from megamoe.bench.problem import RankProblem, make_problem, zipf_exponent
from megamoe.bench.runners import FP8_PEERS, PEER_FP8, RUNNERS, TAKES_EXPERT_FORMAT, _FP8PeerRunner, timed_pass
from megamoe.config import MoEConfig, preset
from megamoe.megakernel.replay import graph_counts
from megamoe.parallel.world import EPWorld
from megamoe.reference.ep import ep_reference_forward_backward

#: fwd: the forward alone; bwd: the backward alone (its forward untimed before it); step: forward + backward.
PASSES = ("fwd", "bwd", "step")
PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: Routed-expert formats of the megamoe implementations (the others are BF16 throughout).
EXPERT_FORMATS = ("bf16", "fp8-block", "mxfp8")
DEVICES = ("cpu", "cuda")
#: Timed rounds, warm-up rounds and steady seconds by device when not given. GPU: 20 rounds give p10 / p90 two
#: samples beyond them each; 2 s of back-to-back work per pass, where the H200 reaches its 700 W cap within
#: ~0.3 s (benchmarks/results/2026-11-30-replay, section 2) and 1 s was enough in 2026-12-02-backward-tiles.
#: CPU: few rounds and no steady phase (the kernels run under the Triton interpreter: its times say little).
DEFAULT_ITERS = {"cuda": 20, "cpu": 3}
DEFAULT_WARMUP = {"cuda": 3, "cpu": 1}
DEFAULT_STEADY_S = {"cuda": 2.0, "cpu": 0.0}


@dataclass(frozen=True)
class BenchOptions:
    """What one `megamoe bench` run measures (see the CLI for each option)."""

    preset: str
    tokens: tuple[int, ...]  # per rank (one value = the same on every rank)
    ep: int
    device: str
    precision: str = "bf16"
    impls: tuple[str, ...] = ("reference", "nccl-torch", "unfused")
    experts: tuple[str, ...] = ("bf16",)  # routed-expert formats of the megamoe impls, each run in turn
    passes: tuple[str, ...] = PASSES
    iters: int | None = None  # timed rounds (None: DEFAULT_ITERS of the device)
    warmup: int | None = None  # untimed rounds first (None: DEFAULT_WARMUP of the device)
    steady: float | None = None  # seconds of back-to-back rounds after the warm-up (None: DEFAULT_STEADY_S)
    seed: int = 0
    routing: str = "uniform"
    config: MoEConfig | None = field(default=None)
    progress: bool = False  # rank 0 prints a line on stderr per round

    def __post_init__(self) -> None:
        cfg = self.config or preset(self.preset)
        object.__setattr__(self, "config", cfg)
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        for name, defaults in (("iters", DEFAULT_ITERS), ("warmup", DEFAULT_WARMUP), ("steady", DEFAULT_STEADY_S)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, defaults[self.device])
        if self.device == "cuda" and torch.cuda.device_count() == 0:
            raise ValueError(f"device cuda: no CUDA GPU is visible (ep={self.ep} needs {self.ep} GPUs, 0 visible)")
        cfg.experts_per_rank(self.ep)
        zipf_exponent(self.routing)  # ValueError for an unknown routing
        if self.routing == "one-rank" and cfg.top_k > cfg.num_experts // self.ep:
            raise ValueError(f"routing one-rank sends each token's k={cfg.top_k} routes to one rank's experts: it "
                             f"needs k <= experts per rank ({cfg.num_experts // self.ep} at ep={self.ep})")
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"precision {self.precision!r} is not available yet for these implementations; "
                f"available: {', '.join(PRECISIONS)}"
            )
        for impl in self.impls:
            if impl not in RUNNERS:
                raise ValueError(f"unknown impl {impl!r}; known: {', '.join(RUNNERS)}")
        if not self.experts:
            raise ValueError("experts needs at least one format")
        for fmt in self.experts:
            if fmt not in EXPERT_FORMATS:
                raise ValueError(f"experts must be one of {', '.join(EXPERT_FORMATS)}, got {fmt!r}")
            if fmt != "bf16" and self.precision != "bf16":
                raise ValueError(f"experts={fmt} quantises BF16 inputs: precision must be bf16, got {self.precision}")
        for name in self.passes:
            if name not in PASSES:
                raise ValueError(f"unknown pass {name!r}; known: {', '.join(PASSES)}")
        if any(t < 0 for t in self.tokens):
            raise ValueError(f"tokens must be >= 0 (one count, or one per rank), got "
                             f"{', '.join(str(t) for t in self.tokens)}")
        if len(self.tokens) not in (1, self.ep):
            raise ValueError(f"tokens must be one count or one per rank (ep={self.ep}), got {self.tokens}")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError(f"iters must be >= 1 and warmup >= 0, got {self.iters}, {self.warmup}")
        if not (math.isfinite(self.steady) and self.steady >= 0):
            raise ValueError(f"steady must be a number of seconds >= 0, got {self.steady}")
        gpus = torch.cuda.device_count() if self.device == "cuda" else 0
        if self.device == "cuda" and self.ep > gpus:
            # ranks sharing a GPU run over gloo (NCCL refuses them) and split its SMs: the baselines cannot
            # run and no timing would mean anything
            raise ValueError(f"ep={self.ep} needs {self.ep} GPUs, {gpus} visible; more ranks than GPUs is for "
                             f"correctness runs (tests/test_megakernel.py::test_gpu_more_ranks_than_gpus_correct)")

    def tokens_of(self, rank: int) -> int:
        return self.tokens[0] if len(self.tokens) == 1 else self.tokens[rank]


# --------------------------------------------------------------------------- checking


# --------------------------------------------------------------------------- timing


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by linear interpolation between the closest ranks, as
    ``numpy.percentile``'s default: the median of an even count is the mean of the two middle samples."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def pass_work(world: EPWorld, p: RankProblem, name: str) -> tuple[float, float]:
    """(FLOPs on this rank's tokens, bytes this rank's routes send across ranks) for one pass."""
    flops, routed, cross = _pass_work_parts(world, p, name)
    return flops, cross


def _pass_work_parts(world: EPWorld, p: RankProblem, name: str) -> tuple[float, float, float]:
    """(FLOPs, of which the routed experts', cross-rank bytes) of this rank for one pass."""
    cfg = p.config
    routes = p.top_experts[p.top_experts >= 0]
    routed = cfg.routed_flops(routes.numel())
    flops = routed + cfg.shared_flops(p.tokens)
    remote = int((routes.long() // p.w_gate_up.shape[0] != world.rank).sum())
    cross = 2 * remote * cfg.hidden * p.x.element_size()  # dispatch + combine (or their mirrors)
    multiple = {"fwd": 1, "bwd": 2, "step": 3}[name]  # the backward does twice the forward's GEMM FLOPs
    return (flops * multiple, routed * multiple, cross * (2 if name == "step" else 1))


@dataclass
class _Run:
    """One (impl, routed-expert format) of a run: its runner and, per pass, its check and its times."""

    impl: str
    experts: str
    label: str
    runner: object
    tolerance: str
    checks: dict = field(default_factory=dict)
    checked_as: dict = field(default_factory=dict)  # pass -> the TOLERANCES key its check used
    times: dict = field(default_factory=dict)


def _iteration(world: EPWorld, run: _Run, name: str, want: dict, timed: bool) -> float | None:
    """One run of pass ``name``: its ms (between barriers) when ``timed``, else None and no barrier (the
    steady phase: back to back). The first run of each (impl, pass) is compared with the oracle."""
    runner = run.runner

    def call(fn):
        return timed_pass(world, fn) if timed else (None, fn())

    grads = None
    if name == "fwd":
        ms, out = call(runner.forward)
        got = {"out": out.detach()}
    elif name == "bwd":
        out = runner.train_forward()
        ms, grads = call(partial(runner.backward, out))
        got = _flatten(grads)
    else:
        out = None
        ms, grads = call(runner.step)
        got = _flatten(grads)
    if name not in run.checks:
        tolerance = "fp8-grads" if run.tolerance == "fp8" and name != "fwd" else run.tolerance
        run.checks[name] = compare(got, want[name], tolerance)
        run.checked_as[name] = tolerance
    del out, got, grads
    if name != "fwd":  # runners coexist: a runner's gradients go before the next one's come (as in a burst)
        for t in getattr(runner, "_all_leaves", lambda: ())():
            t.grad = None
    return ms


def _say(world: EPWorld, opts: BenchOptions, line: str) -> None:
    if opts.progress and world.rank == 0:
        print(f"  {line}", file=sys.stderr, flush=True)


def run_rank(world: EPWorld, opts: BenchOptions) -> list[dict]:
    """Check and time every (impl, pass) on this rank in interleaved rounds; returns the records (rank 0's
    are complete), ordered by impl, then pass."""
    cfg = opts.config
    p = make_problem(
        cfg, world.rank, world.size, opts.tokens_of(world.rank), dtype=PRECISIONS[opts.precision],
        device=world.device, seed=opts.seed, routing=opts.routing,
    )
    oracle_out, oracle_grads = ep_reference_forward_backward(world, p)
    grads_want = parked_on_host(_flatten(oracle_grads))
    del oracle_grads
    want = {"fwd": {"out": oracle_out}, "bwd": grads_want, "step": grads_want}
    device = world.device.type
    machine = world.all_gather_object(machine_info(device) if world.rank == 0 else None)[0]
    runs = []
    fp8 = any(fmt != "bf16" for fmt in opts.experts)
    backward = any(name in opts.passes for name in ("bwd", "step"))  # FP8 packs with the dgrads' transposes
    for impl in opts.impls:  # every runner first: they coexist for the rounds
        if impl == "deepep-torch" and (reason := deepep_torch.unavailable()) is not None:
            if world.rank == 0:
                print(f"  deepep-torch skipped: {reason}", file=sys.stderr, flush=True)
            continue
        formats = (opts.experts if impl in TAKES_EXPERT_FORMAT else
                   ("bf16", PEER_FP8) if impl in FP8_PEERS and fp8 else ("bf16",))
        for fmt in formats:
            quantized = fmt != "bf16"
            runner = (_FP8PeerRunner(world, p, FP8_PEERS[impl]) if fmt == PEER_FP8 else
                      RUNNERS[impl](world, p, fmt, backward=backward) if quantized else RUNNERS[impl](world, p))
            runs.append(_Run(impl, fmt, f"{impl} ({fmt} experts)" if quantized else impl, runner,
                             "fp8" if quantized else opts.precision))
    records = {}
    for name in opts.passes:
        active = [(k, run) for k, run in enumerate(runs) if name in getattr(run.runner, "passes", PASSES)]
        if not active:
            continue
        work = _pass_work_parts(world, p, name)
        _say(world, opts, f"{name}: {', '.join(run.label for _, run in active)}, every round in this order")
        for i in range(opts.warmup):
            _say(world, opts, f"warm-up {i + 1}/{opts.warmup} {name}")
            for _, run in active:
                _iteration(world, run, name, want, timed=True)
        steady_rounds = 0
        if opts.steady > 0:
            _say(world, opts, f"steady {name}: back to back for {opts.steady:g} s")
            start = time.perf_counter()
            while True:
                for _, run in active:
                    _iteration(world, run, name, want, timed=False)
                steady_rounds += 1
                if world.is_cuda:
                    torch.cuda.synchronize(world.device)
                # every rank stops after the same round: the slowest rank's clock decides
                if max(world.all_gather_object(time.perf_counter() - start)) >= opts.steady:
                    break
        samples = {}  # rank 0 asks nvidia-smi for the SM clocks as the first and the last round start
        graphs_before = graph_counts(world)
        for i in range(opts.iters):
            if world.rank == 0 and i in (0, opts.iters - 1):
                samples[i] = ClockSample(device)
            _say(world, opts, f"round {i + 1}/{opts.iters} {name}")
            for _, run in active:
                run.times.setdefault(name, []).append(_iteration(world, run, name, want, timed=True))
        clocks = [samples[i].result() if i in samples else None for i in (0, opts.iters - 1)]
        clocks = world.all_gather_object(clocks)[0]
        # the megakernels' CUDA graphs in the timed rounds (every kernel on the world, whichever impl): a capture
        # there is a device sync inside a timed pass, so a round's time is not the steady state's
        graphs_after = graph_counts(world)
        in_rounds = {key: graphs_after[key] - graphs_before[key] for key in graphs_after if key != "kernels"}
        timing = {"warmup": opts.warmup, "steady_s": opts.steady, "steady_rounds": steady_rounds,
                  "rounds": "interleaved", "sm_clock_mhz": clock_range(clocks),
                  "sm_clock_samples_mhz": {"start": clocks[0], "end": clocks[1]}, "graphs_in_rounds": in_rounds}
        for k, run in active:
            records[k, name] = _gather_record(world, opts, run, name, work, {**machine, **timing})
    for k, run in enumerate(runs):
        mine = {name: records[k, name] for name in opts.passes if (k, name) in records}
        if run.impl == "reference" and "fwd" in mine and "bwd" in mine:
            # the oracle's backward recomputes its forward: its bwd time is (forward + backward) minus the forward
            fwd, bwd = mine["fwd"], mine["bwd"]
            for key in ("time_ms", "time_ms_p10", "time_ms_p50", "time_ms_p90"):
                bwd[key] = max(bwd[key] - fwd["time_ms"], 0.0)
            bwd["tflops"] = bwd["flops"] / bwd["time_ms"] / 1e9 if bwd["time_ms"] else None
            bwd["x_floor"] = _over(bwd["time_ms"], bwd["floor_ms"])
    return [records[k, name] for k in range(len(runs)) for name in opts.passes if (k, name) in records]


def _over(time_ms: float, floor: float | None) -> float | None:
    return time_ms / floor if floor else None


def _gather_record(world, opts: BenchOptions, run: _Run, name: str, work, shared: dict) -> dict:
    times, check = run.times[name], run.checks[name]
    weights_quantize_ms = getattr(run.runner, "weights_quantize_ms", None)
    everyone = world.all_gather_object({"times": times, "check": check, "work": work,
                                        "quantize": weights_quantize_ms})
    slowest = [max(r["times"][i] for r in everyone) for i in range(len(times))]
    median = percentile(slowest, 0.5)
    flops = sum(r["work"][0] for r in everyone) / world.size
    cross = max(r["work"][2] for r in everyone)
    # the slowest rank's floor bounds the pass: the largest of the ranks' floors
    floors = [floor_ms(shared["device_name"], opts.precision, run.experts, *r["work"]) for r in everyone]
    floor = None if None in floors else max(floors)
    return {
        "impl": run.label,
        "preset": opts.preset,
        "precision": opts.precision,
        "pass": name,
        "ep": world.size,
        "tokens_per_rank": opts.tokens_of(0) if len(opts.tokens) == 1 else list(opts.tokens),
        "routing": opts.routing,
        "device": world.device.type,
        "time_ms": median,
        "time_ms_p10": percentile(slowest, 0.1),
        "time_ms_p50": median,
        "time_ms_p90": percentile(slowest, 0.9),
        "flops": flops,
        "tflops": flops / median / 1e9 if median else None,
        "floor_ms": floor,
        "x_floor": _over(median, floor),
        "cross_gbps": cross / median / 1e6 if median and world.size > 1 else None,
        "max_abs_err": max(r["check"]["max_abs_err"] for r in everyone),
        "rel_err": max(r["check"]["rel_err"] for r in everyone),
        "row_err": max(r["check"]["row_err"] for r in everyone),
        "row_group_err": max(r["check"]["row_group_err"] for r in everyone),
        "correct": all(r["check"]["correct"] for r in everyone),
        "worst_tensor": max(everyone, key=lambda r: r["check"]["rel_err"])["check"]["worst_tensor"],
        # why not correct: the first failed check of the first rank that failed (None when correct)
        "failed": next((f"rank {i} {r['check']['failed']}" for i, r in enumerate(everyone)
                        if r["check"].get("failed")), None),
        # the bounds the check held this pass to (compare): rel err <= rel_tol on every tensor, the worst row's
        # error <= row_tol (FP8 weight gradients: groups of rows), the output's max abs <= max_abs_tol (fwd)
        **bounds(run.checked_as[name], name),
        "iters": len(times),
        # FP8 experts: one quantisation of the routed weights (once per optimizer step, outside the pass)
        "weights_quantize_ms": None if weights_quantize_ms is None else max(r["quantize"] for r in everyone),
        **shared,
    }
