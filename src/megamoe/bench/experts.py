"""`megamoe bench-experts`: the expert GEMM tiles alone against torch._grouped_mm + SwiGLU.

One GPU, no communication: ``tokens x k`` routed rows spread evenly over each
requested expert count (kimi-k2 at 8192 tokens: 65,536 rows over 192 experts,
~341 rows each, and over 16, 4096 each). Forward and backward in BF16; the
forward also in FP8-block and MXFP8 (``formats``: operands quantised once, not
timed; checked against the torch path with the FP8 tolerance and against the
kernels' fp32 twin on the first and last experts). Every variant is checked
before it is timed, and the forward's outputs start poisoned (NaN) so every row
must be written. On the CPU (interpreter) the same checks run on small shapes;
times there mean nothing.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F

from megamoe.config import MoEConfig
from megamoe.ops.experts import ExpertForward, ExpertForwardQuantized, down, expert_forward, gate_up
from megamoe.ops.experts_bwd import expert_backward
from megamoe.planner.tiles import TileConfig, plan_tiles
from megamoe.planner.tuning import Tuning
from megamoe.ops.experts_fp8 import expert_forward_fp8_block, expert_forward_fp8_block_reference, gate_up_fp8
from megamoe.ops.experts_mxfp8 import expert_forward_mxfp8, expert_forward_mxfp8_reference
from megamoe.ops.quant import quantize_activations, quantize_weights

#: Quantised expert formats: (the kernels' forward, its fp32 twin).
QUANTIZED_FORWARD = {
    "fp8-block": (expert_forward_fp8_block, expert_forward_fp8_block_reference),
    "mxfp8": (expert_forward_mxfp8, expert_forward_mxfp8_reference),
}
FORMATS = ("bf16", *QUANTIZED_FORWARD)

#: Tile candidates for --sweep (BM, BN, BK, warps, stages, group, flatten).
#: 64-row tiles (one warpgroup) compute fewer padding rows when experts hold few rows (~171 at kimi-k2 EP 1:
#: 192 rows in 64-row tiles, 256 in 128-row ones).
SWEEP = {
    "gate_up": [TileConfig(128, 128, 64, 8, s, g, f) for s in (3, 4) for g in (4, 16) for f in (False, True)]
    + [TileConfig(64, 128, 64, 4, s, 8) for s in (3, 4)],
    "down": [TileConfig(128, 256, 64, 8, s, g, f) for s in (3, 4) for g in (8, 16) for f in (False, True)]
    + [TileConfig(64, 256, 64, 4, s, 8, True) for s in (3, 4)],
}
#: Rounds of a GPU sweep (every candidate once per round; each candidate's median over rounds).
SWEEP_ROUNDS = 3
#: Backward variants for --sweep: each changes one kernel's tiles from the planner's.
BACKWARD_SWEEP = {
    "dact 3 stages": {"dact": TileConfig(128, 128, 64, 8, 3, 8)},
    "dact 4 stages flatten": {"dact": TileConfig(128, 128, 64, 8, 4, 8, True)},
    "dx 4 stages": {"dx": TileConfig(128, 256, 64, 8, 4, 8)},
    "wgrad 128x128": {"wgrad": TileConfig(128, 128, 64, 8, 3, 8)},
    "wgrad BK 64": {"wgrad": TileConfig(128, 256, 64, 8, 3, 8, True)},
    "wgrad not flattened": {"wgrad": TileConfig(128, 256, 32, 8, 5, 8)},
}


def make_load(experts: int, routes: int, d: int, i: int, device):
    """``routes`` rows spread evenly over ``experts`` experts; random bf16 inputs and weights."""
    g = torch.Generator(device=device).manual_seed(experts)
    counts = torch.full((experts,), routes // experts, dtype=torch.int32, device=device)
    counts[: routes - int(counts.sum())] += 1
    offsets = (counts.cumsum(0) - counts).to(torch.int32)
    x = torch.randn(routes, d, generator=g, device=device).bfloat16()
    wgu = (torch.randn(experts, 2 * i, d, generator=g, device=device) / d**0.5).bfloat16()
    wd = (torch.randn(experts, d, i, generator=g, device=device) / i**0.5).bfloat16()
    return x, counts, offsets, wgu, wd


@dataclasses.dataclass(frozen=True)
class BackwardLoad:
    """An expert backward's operands on :func:`make_load`'s load: the forward run once for h and act, a random
    upstream gradient and router weights (seed 7). ``args``: :func:`~megamoe.ops.experts_bwd.expert_backward`'s."""

    dy: torch.Tensor
    row_weights: torch.Tensor
    x: torch.Tensor
    h: torch.Tensor
    act: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor

    @property
    def args(self) -> tuple:
        return (self.dy, self.row_weights, self.x, self.h, self.counts, self.offsets, self.w_gate_up, self.w_down)


def backward_load(cfg: MoEConfig, experts: int, tokens: int, device) -> BackwardLoad:
    """``tokens x top_k`` rows of ``cfg``'s expert shapes over ``experts`` experts, ready for a backward."""
    d, i = cfg.hidden, cfg.intermediate
    x, counts, offsets, wgu, wd = make_load(experts, tokens * cfg.top_k, d, i, device)
    rows = x.shape[0]
    fwd = ExpertForward(torch.empty(rows, 2 * i, dtype=torch.bfloat16, device=device),
                        torch.empty(rows, i, dtype=torch.bfloat16, device=device), None)
    gate_up(x, counts, offsets, wgu, fwd.h, fwd.act)
    g = torch.Generator(device=device).manual_seed(7)
    dy = torch.randn(rows, d, generator=g, device=device).bfloat16()
    return BackwardLoad(dy, torch.rand(rows, generator=g, device=device), x, fwd.h, fwd.act, counts, offsets, wgu, wd)


@dataclasses.dataclass(frozen=True)
class Fp8BlockOperands:
    """A load's FP8-block operands, quantised once (untimed), and their gate/up's outputs (the down's input)."""

    x_q: torch.Tensor
    x_s: torch.Tensor
    wgu_q: torch.Tensor
    wgu_s: torch.Tensor
    wd_q: torch.Tensor
    wd_s: torch.Tensor
    fwd: ExpertForwardQuantized


def fp8_block_operands(x, counts, offsets, wgu, wd) -> Fp8BlockOperands:
    rows, i = x.shape[0], wd.shape[2]
    x_q, x_s = quantize_activations(x, "fp8-block")
    wgu_q, wgu_s = quantize_weights(wgu, "fp8-block")
    wd_q, wd_s = quantize_weights(wd, "fp8-block")
    fwd = ExpertForwardQuantized(torch.empty(rows, 2 * i, dtype=torch.bfloat16, device=x.device),
                                 torch.empty(rows, i, dtype=torch.float8_e4m3fn, device=x.device),
                                 torch.empty(rows, i // 128, device=x.device), torch.empty_like(x))
    gate_up_fp8(x_q, x_s, counts, offsets, wgu_q, wgu_s, fwd)
    return Fp8BlockOperands(x_q, x_s, wgu_q, wgu_s, wd_q, wd_s, fwd)


def torch_path(x, counts, wgu, wd):
    """The baseline: torch._grouped_mm gate/up, eager SwiGLU, torch._grouped_mm down."""
    ends = counts.cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x, wgu.transpose(-2, -1), offs=ends)
    gate, up = h.chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, wd.transpose(-2, -1), offs=ends)


def rel(a, b) -> float:
    """sum|a-b| / sum|b|, in chunks (weight gradients are GBs: no full-size float copies)."""
    from megamoe.bench.accuracy import error_stats

    return error_stats(a, b)["rel"]


def median_ms(fn, device: torch.device) -> float:
    """Median time of ``fn()``: triton's do_bench (CUDA events) on GPUs; one wall-clock call on the CPU."""
    if device.type == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=30, rep=200, return_mode="median")
    t0 = time.perf_counter()  # the interpreter is slow: one untimed call would double the run
    fn()
    return (time.perf_counter() - t0) * 1e3


def kernel_times(fn, iters: int = 3) -> dict[str, float]:
    """Device ms per call of ``fn`` for each kernel name, largest first (torch profiler; GPU only)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.key] = totals.get(event.key, 0.0) + event.device_time_total / 1e3 / iters
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def _forward_records(load, x, counts, offsets, wgu, wd, sweep: bool,
                     formats: tuple[str, ...] = ()) -> tuple[list[dict], ExpertForward]:
    rows, d = x.shape
    i = wd.shape[2]
    device = x.device
    flops = 6 * rows * d * i
    ref_y = torch_path(x, counts, wgu, wd)
    records = [{"load": load, "impl": "torch._grouped_mm+swiglu", "pass": "fwd",
                "ms": (ms := median_ms(lambda: torch_path(x, counts, wgu, wd), device)), "tflops": flops / ms / 1e9}]
    out = ExpertForward(*(torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=device)
                          for n in (2 * i, i, d)))
    expert_forward(x, counts, offsets, wgu, wd, out=out)
    all_written = not any(bool(t.isnan().any()) for t in (out.h, out.act, out.y))
    err = rel(out.y, ref_y)
    best = {}
    stages = {
        "gate_up": lambda cfg: gate_up(x, counts, offsets, wgu, out.h, out.act, tuning=Tuning(gate_up=cfg)),
        "down": lambda cfg: down(out.act, counts, offsets, wd, out.y, tuning=Tuning(down=cfg)),
    }
    # a sweep times its candidates in interleaved rounds: timed one after another they drift as the GPU heats
    # toward its power cap (benchmarks/results/2026-11-30-replay, section 2)
    rounds = SWEEP_ROUNDS if sweep and device.type == "cuda" else 1
    for stage, call in stages.items():
        candidates = SWEEP[stage] if sweep else [plan_tiles(stage, device, rows / counts.numel())]
        times = [[] for _ in candidates]
        for _ in range(rounds):
            for cfg, ts in zip(candidates, times):
                ts.append(median_ms(lambda: call(cfg), device))
        for cfg, ts in zip(candidates, times):
            ms = statistics.median(ts)
            stage_flops = flops * (2 if stage == "gate_up" else 1) / 3
            records.append({"load": load, "impl": f"megamoe {stage}", "pass": "fwd", "ms": ms,
                            "tflops": stage_flops / ms / 1e9, "tiles": dataclasses.asdict(cfg)})
            if stage not in best or ms < best[stage][0]:
                best[stage] = (ms, cfg)
    tiles = {stage: cfg for stage, (_, cfg) in best.items()}
    expert_forward(x, counts, offsets, wgu, wd, out=out, tuning=Tuning(**tiles))
    err = max(err, rel(out.y, ref_y))
    ms = median_ms(lambda: expert_forward(x, counts, offsets, wgu, wd, out=out, tuning=Tuning(**tiles)), device)
    records.append({"load": load, "impl": "megamoe", "pass": "fwd", "ms": ms, "tflops": flops / ms / 1e9,
                    "rel_err_vs_torch": err, "all_written": all_written,
                    "tiles": {k: dataclasses.asdict(v) for k, v in tiles.items()}})
    for fmt in formats:
        if fmt != "bf16":
            records.append(_quantized_forward_record(load, fmt, x, counts, offsets, wgu, wd, ref_y, ms))
    return records, out


def _quantized_forward_record(load, fmt, x, counts, offsets, wgu, wd, ref_y, bf16_ms) -> dict:
    """One forward record of ``fmt``: time, speed-up over the BF16 kernels, errors, every row written."""
    forward, twin = QUANTIZED_FORWARD[fmt]
    rows, d = x.shape
    i = wd.shape[2]
    device = x.device
    flops = 6 * rows * d * i
    x_q, x_s = quantize_activations(x, fmt)
    args = (x_q, x_s, counts, offsets, *quantize_weights(wgu, fmt), *quantize_weights(wd, fmt))
    # poisoned: NaN floats, 0xFF bytes (an E4M3 / E8M0 NaN, which no kernel writes)
    act_scale = (torch.full((rows, i // 128), float("nan"), device=device) if fmt == "fp8-block"
                 else torch.full((rows, i // 32), 0xFF, dtype=torch.uint8, device=device))
    out = ExpertForwardQuantized(
        h=torch.full((rows, 2 * i), float("nan"), dtype=torch.bfloat16, device=device),
        act_q=torch.full((rows, i), 0xFF, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn),
        act_scale=act_scale,
        y=torch.full((rows, d), float("nan"), dtype=torch.bfloat16, device=device))
    forward(*args, out=out)
    scale_unwritten = out.act_scale.isnan() if fmt == "fp8-block" else out.act_scale == 0xFF
    all_written = not (bool(out.h.isnan().any()) or bool(out.y.isnan().any())
                       or bool((out.act_q.view(torch.uint8) == 0xFF).any()) or bool(scale_unwritten.any()))
    experts = sorted({0, counts.numel() - 1})
    ref = twin(*args, experts=experts)
    mask = torch.zeros(rows, dtype=torch.bool, device=device)
    for e in experts:
        mask[int(offsets[e]): int(offsets[e]) + int(counts[e])] = True
    err_twin = rel(out.y[mask], ref.y[mask])
    ms = median_ms(lambda: forward(*args, out=out), device)
    return {"load": load, "impl": f"megamoe {fmt}", "pass": "fwd", "ms": ms, "tflops": flops / ms / 1e9,
            "vs_bf16": bf16_ms / ms, "rel_err_vs_torch": rel(out.y, ref_y), "rel_err_vs_twin": err_twin,
            "all_written": all_written}


def _backward_records(load, x, counts, offsets, wgu, wd, h, profile: bool, sweep: bool) -> list[dict]:
    rows, d = x.shape
    i = wd.shape[2]
    device = x.device
    g = torch.Generator(device=device).manual_seed(1)
    dy = torch.randn(x.shape, generator=g, device=device).bfloat16()
    row_w = torch.rand(rows, generator=g, device=device)
    leaves = [t.detach().requires_grad_() for t in (x, wgu, wd, row_w)]

    def torch_forward():
        for t in leaves:
            t.grad = None
        y = torch_path(leaves[0], counts, leaves[1], leaves[2])
        return y * leaves[3][:, None].to(y.dtype)

    torch_forward().backward(dy)
    want = {"d_x": leaves[0].grad, "d_w_gate_up": leaves[1].grad, "d_w_down": leaves[2].grad,
            "d_router": leaves[3].grad}
    got = expert_backward(dy, row_w, x, h, counts, offsets, wgu, wd)
    errors = {name: rel(getattr(got, name), ref) for name, ref in want.items()}
    del got
    # torch's backward alone: its forward runs untimed before each timing
    torch_times = [_backward_ms(torch_forward(), dy) for _ in range(11 if device.type == "cuda" else 1)]
    flops = 12 * rows * d * i
    torch_ms = statistics.median(torch_times)
    ms = median_ms(lambda: expert_backward(dy, row_w, x, h, counts, offsets, wgu, wd), device)
    record = {"load": load, "impl": "megamoe", "pass": "bwd", "ms": ms, "tflops": flops / ms / 1e9,
              "rel_err_vs_torch": max(errors.values()), "errors": errors}
    if profile and device.type == "cuda":
        record["kernels_ms"] = kernel_times(lambda: expert_backward(dy, row_w, x, h, counts, offsets, wgu, wd))
    records = [{"load": load, "impl": "torch autograd", "pass": "bwd", "ms": torch_ms, "tflops": flops / torch_ms / 1e9},
               record]
    for name, tiles in (BACKWARD_SWEEP.items() if sweep else ()):
        call = lambda: expert_backward(dy, row_w, x, h, counts, offsets, wgu, wd, tuning=Tuning(**tiles))  # noqa: E731
        variant = call()
        err = max(rel(getattr(variant, k), ref) for k, ref in want.items())
        del variant  # weight-sized gradients: keep one set alive at a time
        ms = median_ms(call, device)
        entry = {"load": load, "impl": f"megamoe ({name})", "pass": "bwd", "ms": ms, "tflops": flops / ms / 1e9,
                 "rel_err_vs_torch": err}
        if profile and device.type == "cuda":
            entry["kernels_ms"] = kernel_times(call)
        records.append(entry)
    return records


def _backward_ms(out: torch.Tensor, grad: torch.Tensor) -> float:
    if not out.is_cuda:
        t0 = time.perf_counter()
        out.backward(grad)
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out.backward(grad)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def run(cfg: MoEConfig, routes: int, expert_counts: tuple[int, ...], device: torch.device, *,
        sweep: bool = False, passes: tuple[str, ...] = ("fwd", "bwd"), profile: bool = False,
        formats: tuple[str, ...] = ("bf16",)) -> list[dict]:
    """Records for every load (expert count) and pass; see the module docstring. ``formats`` beyond bf16
    add their forward (the BF16 kernels always run: they are what the others are compared with)."""
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise ValueError(f"formats must be among {FORMATS}, got {sorted(unknown)}")
    quantized = [f for f in formats if f != "bf16"]
    block = max([128 if f == "fp8-block" else 32 for f in quantized], default=1)
    if cfg.hidden % block or cfg.intermediate % block:
        raise ValueError(f"{', '.join(quantized)} need hidden and intermediate multiples of {block}, "
                         f"got {cfg.hidden} and {cfg.intermediate}")
    records = []
    for experts in expert_counts:
        if experts < 1 or routes < experts:
            raise ValueError(f"each load needs 1 <= experts <= routes, got {experts} experts for {routes} routes")
        load = f"{experts}x{routes // experts}"
        x, counts, offsets, wgu, wd = make_load(experts, routes, cfg.hidden, cfg.intermediate, device)
        fwd, out = _forward_records(load, x, counts, offsets, wgu, wd, sweep and "fwd" in passes,
                                    tuple(formats) if "fwd" in passes else ())
        records += fwd if "fwd" in passes else []
        if "bwd" in passes:
            records += _backward_records(load, x, counts, offsets, wgu, wd, out.h, profile, sweep)
        del x, wgu, wd, out
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


#: rel L1 against the torch path: both sides are BF16 computations, so their errors add (backward: more roundings);
#: FP8 operands: the layer's FP8 tolerance (1e-1 relative), and the kernels against their own fp32 twin.
TOLERANCE = {"fwd": 1e-2, "bwd": 2e-2}
QUANTIZED_TOLERANCE = {"rel_err_vs_torch": 1e-1, "rel_err_vs_twin": 2e-2}


def failures(records: list[dict]) -> list[dict]:
    """Records whose result disagrees with the torch path (or the fp32 twin) or left rows unwritten."""
    def bad(r):
        if "rel_err_vs_twin" in r:
            return any(r[k] > tol for k, tol in QUANTIZED_TOLERANCE.items())
        return r.get("rel_err_vs_torch", 0.0) > TOLERANCE[r["pass"]]
    return [r for r in records if bad(r) or r.get("all_written") is False]


def format_table(records: list[dict]) -> str:
    lines = [f"{'load':10} {'pass':4} {'impl':26} {'ms':>9} {'TFLOP/s':>8}  note"]
    for r in records:
        note = f"rel err {r['rel_err_vs_torch']:.2e}" if "rel_err_vs_torch" in r else ""
        if "rel_err_vs_twin" in r:
            note += f" (vs fp32 twin {r['rel_err_vs_twin']:.2e}), x{r['vs_bf16']:.2f} of bf16"
        if "all_written" in r:
            note += f", every row written: {r['all_written']}"
        if "tiles" in r and "block_m" in r["tiles"]:
            note += " tiles " + ",".join(str(v) for v in r["tiles"].values())
        if "kernels_ms" in r:
            note += " | " + ", ".join(f"{k.split('_kernel')[0]} {v:.2f}" for k, v in list(r["kernels_ms"].items())[:3])
        lines.append(f"{r['load']:10} {r['pass']:4} {r['impl']:26} {r['ms']:9.3f} {r['tflops']:8.1f}  {note}")
    return "\n".join(lines)
