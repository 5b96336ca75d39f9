"""Expert compute on one GPU: megamoe's grouped GEMM tiles against torch._grouped_mm + SwiGLU.

Run on the GPU machine from the repo root:
    PYTHONPATH=src python3 benchmarks/experts_bench.py --out $OUT/experts.json [--sweep]

kimi-k2 shapes (D 7168, I 2048), 8192 tokens x 8 routes = 65,536 rows on one GPU,
over 192 experts (~341 rows each) and over 16 experts (4096 rows each). Every
variant is checked against the torch path before it is timed; rows outside
expert regions are poisoned and must stay so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import torch.nn.functional as F
import triton

from megamoe.experts import ExpertForward, TileConfig, down, expert_backward, expert_forward, gate_up, plan_tiles

D, I, ROUTES = 7168, 2048, 65536
LOADS = {"192x341": 192, "16x4096": 16}
GATE_UP = [TileConfig(128, 128, 64, 8, s, g, f) for s in (3, 4) for g in (4, 16) for f in (False, True)]
DOWN = [TileConfig(128, 256, 64, 8, s, g, f) for s in (3, 4) for g in (8, 16) for f in (False, True)]


def make_load(experts: int, device):
    g = torch.Generator(device=device).manual_seed(experts)
    counts = torch.full((experts,), ROUTES // experts, dtype=torch.int32, device=device)
    counts[: ROUTES - int(counts.sum())] += 1
    offsets = (counts.cumsum(0) - counts).to(torch.int32)
    x = torch.randn(ROUTES, D, generator=g, device=device).bfloat16()
    wgu = (torch.randn(experts, 2 * I, D, generator=g, device=device) / D**0.5).bfloat16()
    wd = (torch.randn(experts, D, I, generator=g, device=device) / I**0.5).bfloat16()
    return x, counts, offsets, wgu, wd


def torch_path(x, counts, wgu, wd):
    ends = counts.cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x, wgu.transpose(-2, -1), offs=ends)
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) * up
    return torch._grouped_mm(act, wd.transpose(-2, -1), offs=ends)


def rel(a, b):
    return float((a.float() - b.float()).abs().sum() / b.float().abs().sum())


def kernel_times(fn, iters: int = 3) -> dict[str, float]:
    """Device time per kernel name (ms per call of fn), largest first, from the torch profiler."""
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


def backward_records(load, x, counts, offsets, wgu, wd, h):
    """dgrads + SwiGLU backward + wgrads: megamoe's tiles against autograd through the torch path."""
    g = torch.Generator(device=x.device).manual_seed(1)
    dy = torch.randn(x.shape, generator=g, device=x.device).bfloat16()
    row_w = torch.rand(x.shape[0], generator=g, device=x.device)
    leaves = [t.detach().requires_grad_() for t in (x, wgu, wd, row_w)]

    def torch_backward():
        for t in leaves:
            t.grad = None
        y = torch_path(leaves[0], counts, leaves[1], leaves[2])
        (y * leaves[3][:, None].to(y.dtype)).backward(dy)

    def torch_backward_only():
        for t in leaves:
            t.grad = None
        y = torch_path(leaves[0], counts, leaves[1], leaves[2])
        out = y * leaves[3][:, None].to(y.dtype)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out.backward(dy)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    torch_backward()
    want = {"d_x": leaves[0].grad, "d_w_gate_up": leaves[1].grad, "d_w_down": leaves[2].grad, "d_router": leaves[3].grad}
    got = expert_backward(dy, row_w, x, h, counts, offsets, wgu, wd)
    errs = {k: rel(getattr(got, k), v) for k, v in want.items()}
    torch_ms = sorted(torch_backward_only() for _ in range(15))[7]
    ms = triton.testing.do_bench(lambda: expert_backward(dy, row_w, x, h, counts, offsets, wgu, wd),
                                 warmup=30, rep=300, return_mode="median")
    flops = 2 * 6 * ROUTES * D * I
    kernels = kernel_times(lambda: expert_backward(dy, row_w, x, h, counts, offsets, wgu, wd))
    print(f"{load} megamoe backward by kernel (ms/iter): " + ", ".join(f"{k} {v:.2f}" for k, v in kernels.items()))
    flat = {kind: dataclasses.replace(plan_tiles(kind, x.device), flatten=True) for kind in ("dact", "dx", "wgrad")}
    kernels = kernel_times(lambda: expert_backward(dy, row_w, x, h, counts, offsets, wgu, wd, tiles=flat))
    print(f"{load} ... with flattened task loops: " + ", ".join(f"{k} {v:.2f}" for k, v in kernels.items()))
    torch_kernels = kernel_times(torch_backward)
    print(f"{load} torch fwd+bwd by kernel (ms/iter, top 6): " +
          ", ".join(f"{k[:40]} {v:.2f}" for k, v in list(torch_kernels.items())[:6]))
    return [
        {"load": load, "impl": "torch autograd backward", "ms": torch_ms, "tflops": flops / torch_ms / 1e9},
        {"load": load, "impl": "megamoe backward", "ms": ms, "tflops": flops / ms / 1e9,
         "rel_err_vs_torch": max(errs.values()), "errors": errs},
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="experts.json")
    parser.add_argument("--sweep", action="store_true", help="time every candidate tile shape, not only the planner's")
    args = parser.parse_args()
    device = torch.device("cuda")
    records = []
    flops = 6 * ROUTES * D * I
    for load, experts in LOADS.items():
        x, counts, offsets, wgu, wd = make_load(experts, device)
        ref_y = torch_path(x, counts, wgu, wd)
        ms = triton.testing.do_bench(lambda: torch_path(x, counts, wgu, wd), warmup=50, rep=300, return_mode="median")
        records.append({"load": load, "impl": "torch._grouped_mm+swiglu", "ms": ms, "tflops": flops / ms / 1e9})
        out = ExpertForward(torch.full((ROUTES, 2 * I), float("nan"), dtype=torch.bfloat16, device=device),
                            torch.full((ROUTES, I), float("nan"), dtype=torch.bfloat16, device=device),
                            torch.full((ROUTES, D), float("nan"), dtype=torch.bfloat16, device=device))
        expert_forward(x, counts, offsets, wgu, wd, out=out)
        torch.cuda.synchronize()
        err = rel(out.y, ref_y)
        all_written = not bool(out.y.isnan().any() or out.act.isnan().any() or out.h.isnan().any())
        stage_best = {}
        for stage, cands, call in (
            ("gate_up", GATE_UP if args.sweep else [plan_tiles("gate_up", device)], lambda cfg: gate_up(x, counts, offsets, wgu, out.h, out.act, tiles=cfg)),
            ("down", DOWN if args.sweep else [plan_tiles("down", device)], lambda cfg: down(out.act, counts, offsets, wd, out.y, tiles=cfg)),
        ):
            for cfg in cands:
                try:
                    ms = triton.testing.do_bench(lambda: call(cfg), warmup=30, rep=200, return_mode="median")
                except Exception as exc:
                    records.append({"load": load, "impl": f"megamoe {stage}", "error": repr(exc)[:200],
                                    "tiles": cfg.__dict__})
                    continue
                stage_flops = flops * (2 if stage == "gate_up" else 1) / 3
                records.append({"load": load, "impl": f"megamoe {stage}", "ms": ms, "tflops": stage_flops / ms / 1e9,
                                "tiles": cfg.__dict__})
                if stage not in stage_best or ms < stage_best[stage][0]:
                    stage_best[stage] = (ms, cfg)
        tiles = {k: v[1] for k, v in stage_best.items()}
        expert_forward(x, counts, offsets, wgu, wd, out=out, tiles=tiles)
        err_best = rel(out.y, ref_y)
        ms = triton.testing.do_bench(lambda: expert_forward(x, counts, offsets, wgu, wd, out=out, tiles=tiles),
                                     warmup=50, rep=300, return_mode="median")
        records.append({"load": load, "impl": "megamoe forward", "ms": ms, "tflops": flops / ms / 1e9,
                        "rel_err_vs_torch": max(err, err_best), "all_written": all_written,
                        "tiles": {k: v.__dict__ for k, v in tiles.items()}})
        records.extend(backward_records(load, x, counts, offsets, wgu, wd, out.h))
        del x, wgu, wd, ref_y, out
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"machine": torch.cuda.get_device_name(), "records": records}, f, indent=1)
    print(f"{'load':9} {'impl':26} {'tiles (m, n, k, warps, stages, group, flat)':40} {'ms':>8} {'TFLOP/s':>8} note")
    for r in records:
        t = r.get("tiles")
        t = str(tuple(t.values())) if t and "block_m" in t else ("; ".join(f"{k}={tuple(v.values())}" for k, v in t.items()) if t else "-")
        if "error" in r:
            print(f"{r['load']:9} {r['impl']:26} {t:40} ERROR {r['error'][:60]}")
            continue
        note = f"rel err {r['rel_err_vs_torch']:.2e}" if "rel_err_vs_torch" in r else ""
        if "all_written" in r:
            note += f" all rows written {r['all_written']}"
        print(f"{r['load']:9} {r['impl']:26} {t[:40]:40} {r['ms']:8.3f} {r['tflops']:8.0f} {note}")


if __name__ == "__main__":
    main()
