"""The expert GEMM tiles against cuBLAS on dense shapes of the same N and K, at the power cap (one GPU).

    PYTHONPATH=src python3 benchmarks/gemm_vs_dense.py [--preset kimi-k2] [--experts 192,16] [--rounds 5]
                                                       [--seconds 0.5] [--out DIR]

For each load (``tokens x k`` rows spread evenly over each expert count; kimi-k2 at 8192 tokens: 192 x 341
and 16 x 4096) every kernel of the layer's expert compute runs beside its dense peer, all of them in
interleaved rounds (``sustained.interleaved_rounds``: each round runs every call back to back for
--seconds, after a warm-up round, so all of them see the 700 W steady state):

| kernel | ours | dense peer (cuBLAS, same M = all rows, N, K) |
|---|---|---|
| gate/up + SwiGLU | ``experts.gate_up`` | ``x [M, D] @ W [D, 2I]`` |
| down | ``experts.down`` | ``act [M, I] @ W [I, D]`` |
| backward (dact + SwiGLU', dx, both wgrads) | ``experts.expert_backward`` | the four dense GEMMs in sequence |
| fp8-block gate/up, down | ``experts_fp8.gate_up_fp8`` / ``down_fp8`` | ``torch._scaled_mm`` row/column scales |

``torch._grouped_mm`` on the same grouped problem runs beside them (what torch users get), and cuBLAS's batched
GEMM (``torch.bmm``) on equal groups of ``rows // experts`` rows: what the library reaches on the grouped shape
itself (its partial tiles and per-expert weight panels), the fairer yardstick where groups are small. The backward's
kernels are split afterwards with the torch profiler (still at the cap: it runs right after the rounds).
Prints one table (ms, TFLOP/s, % of the dense and the bmm peers' rates); writes DIR/gemm_vs_dense.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess

import torch

from megamoe.bench.experts import fp8_block_operands, kernel_times, make_load
from megamoe.config import preset
from megamoe.ops.experts import ExpertForward, down, gate_up
from megamoe.ops.experts_bwd import expert_backward
from megamoe.ops.experts_fp8 import down_fp8, gate_up_fp8

from sustained import interleaved_rounds  # benchmarks/, beside this script


def load_calls(experts: int, routes: int, d: int, i: int, dev) -> tuple[dict, dict, dict]:
    """{name: fn}, {name: FLOPs}, {name: peer name} of one load."""
    x, counts, offsets, wgu, wd = make_load(experts, routes, d, i, dev)
    rows = x.shape[0]
    ends = counts.cumsum(0).to(torch.int32)
    out = ExpertForward(torch.empty(rows, 2 * i, dtype=torch.bfloat16, device=dev),
                        torch.empty(rows, i, dtype=torch.bfloat16, device=dev),
                        torch.empty(rows, d, dtype=torch.bfloat16, device=dev))
    gate_up(x, counts, offsets, wgu, out.h, out.act)
    g = torch.Generator(device=dev).manual_seed(7)
    dy = torch.randn(rows, d, generator=g, device=dev).bfloat16()
    row_w = torch.rand(rows, generator=g, device=dev)
    # dense operands: one expert's weights stand for all (the dense GEMM has one B)
    w_gu, w_dn = wgu[0].T.contiguous(), wd[0].T.contiguous()  # [D, 2I], [I, D]
    d_h = torch.randn(rows, 2 * i, generator=g, device=dev).bfloat16()
    c_gu, c_dn = torch.empty(rows, 2 * i, dtype=torch.bfloat16, device=dev), torch.empty_like(x)
    c_dact, c_wd = torch.empty(rows, i, dtype=torch.bfloat16, device=dev), torch.empty(d, i, dtype=torch.bfloat16,
                                                                                         device=dev)
    c_wgu = torch.empty(2 * i, d, dtype=torch.bfloat16, device=dev)

    def dense_backward():
        torch.mm(dy, wd[0], out=c_dact)            # d_act [M, I]: K = D
        torch.mm(d_h, wgu[0], out=c_dn)            # d_x [M, D]: K = 2I
        torch.mm(dy.T, out.act, out=c_wd)          # dW_down [D, I]: K = M
        torch.mm(d_h.T, x, out=c_wgu)              # dW_gate_up [2I, D]: K = M

    # cuBLAS on the same grouped problem with equal groups (batched GEMMs of m = rows // experts rows each): what
    # the library reaches on these shapes, partial tiles and per-expert weight panels included
    m = rows // experts
    xb, dyb = x[:m * experts].view(experts, m, d), dy[:m * experts].view(experts, m, d)
    actb, d_hb = out.act[:m * experts].view(experts, m, i), d_h[:m * experts].view(experts, m, 2 * i)

    def bmm_backward():
        torch.bmm(dyb, wd)                              # d_act [E, m, I]
        torch.bmm(d_hb, wgu)                            # d_x [E, m, D]
        torch.bmm(dyb.transpose(1, 2), actb)            # dW_down [E, D, I]
        torch.bmm(d_hb.transpose(1, 2), xb)             # dW_gate_up [E, 2I, D]

    fwd = 2 * rows * d * i
    fwd_bmm = 2 * m * experts * d * i
    calls = {
        "gate_up": lambda: gate_up(x, counts, offsets, wgu, out.h, out.act),
        "gate_up dense": lambda: torch.mm(x, w_gu, out=c_gu),
        "gate_up grouped_mm": lambda: torch._grouped_mm(x, wgu.transpose(-2, -1), offs=ends),
        "down": lambda: down(out.act, counts, offsets, wd, out.y),
        "down dense": lambda: torch.mm(out.act, w_dn, out=c_dn),
        "down grouped_mm": lambda: torch._grouped_mm(out.act, wd.transpose(-2, -1), offs=ends),
        "backward": lambda: expert_backward(dy, row_w, x, out.h, counts, offsets, wgu, wd),
        "backward dense": dense_backward,
        "gate_up bmm": lambda: torch.bmm(xb, wgu.transpose(1, 2)),
        "down bmm": lambda: torch.bmm(actb, wd.transpose(1, 2)),
        "backward bmm": bmm_backward,
    }
    flops = {"gate_up": 2 * fwd, "down": fwd, "backward": 6 * fwd}  # dact 1, dx 2, wgrads 1 + 2
    # fp8-block: operands quantised once, untimed
    q = fp8_block_operands(x, counts, offsets, wgu, wd)
    x_q, x_s, wgu_q, wgu_s, wd_q, wd_s, q_out = q.x_q, q.x_s, q.wgu_q, q.wgu_s, q.wd_q, q.wd_s, q.fwd
    a_gu, a_dn = x_q, q_out.act_q
    b_gu = wgu_q[0].T  # [D, 2I] column-major, as cuBLAS takes B
    b_dn = wd_q[0].T   # [I, D]
    r_gu, r_dn = torch.rand(rows, 1, device=dev) + 0.5, torch.rand(rows, 1, device=dev) + 0.5
    s_gu, s_dn = torch.rand(1, 2 * i, device=dev) + 0.5, torch.rand(1, d, device=dev) + 0.5
    calls.update({
        "fp8 gate_up": lambda: gate_up_fp8(x_q, x_s, counts, offsets, wgu_q, wgu_s, q_out),
        "fp8 gate_up dense": lambda: torch._scaled_mm(a_gu, b_gu, r_gu, s_gu, out_dtype=torch.bfloat16),
        "fp8 down": lambda: down_fp8(q_out.act_q, q_out.act_scale, counts, offsets, wd_q, wd_s, q_out.y),
        "fp8 down dense": lambda: torch._scaled_mm(a_dn, b_dn, r_dn, s_dn, out_dtype=torch.bfloat16),
    })
    flops.update({"fp8 gate_up": 2 * fwd, "fp8 down": fwd})
    for name in list(calls):  # every name's FLOPs are its kernel's (bmm: its m * experts rows)
        base = name.removesuffix(" dense").removesuffix(" grouped_mm").removesuffix(" bmm")
        flops[name] = flops[base] * (fwd_bmm / fwd if name.endswith(" bmm") else 1)
    backward = lambda: expert_backward(dy, row_w, x, out.h, counts, offsets, wgu, wd)  # noqa: E731
    return calls, flops, {"backward": backward}


def backward_timeline(fn, path: str, iters: int = 3) -> dict:
    """One steady call's wall time against its kernels' (CUDA events, then the torch profiler with host
    activity, whose Chrome trace goes to ``path``): where the backward's time outside its kernels goes."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) / iters
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    kernels, host = 0.0, {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels += event.device_time_total / 1e3 / iters
        elif event.key.startswith("cuda") or event.key.startswith("aten::"):
            host[event.key] = round(event.cpu_time_total / 1e3 / iters, 3)
    top = dict(sorted(host.items(), key=lambda kv: -kv[1])[:8])
    return {"wall_ms": wall, "kernels_ms": kernels, "host_ms": top}


def machine() -> dict:
    query = "name,driver_version,power.limit,clocks.max.sm"
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        line = "unknown"
    return {"nvidia_smi": line, "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", default="192,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    os.makedirs(a.out, exist_ok=True)  # before the run: its records go there
    cfg = preset(a.preset)
    dev = torch.device("cuda")
    records, lines = [], []
    for experts in (int(e) for e in a.experts.split(",")):
        load = f"{experts}x{a.tokens * cfg.top_k // experts}"
        calls, flops, split = load_calls(experts, a.tokens * cfg.top_k, cfg.hidden, cfg.intermediate, dev)
        before = torch.cuda.memory_stats()
        times = interleaved_rounds(calls, a.rounds, a.seconds)
        after = torch.cuda.memory_stats()
        # device allocations during the rounds: a cudaMalloc / cudaFree syncs and takes ms (the backward's weight
        # gradients are 17 GB a call at kimi-k2)
        allocator = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc",
                                                                     "num_device_free", "num_sync_all_streams")}
        kernels = kernel_times(split["backward"])
        timeline = backward_timeline(split["backward"], os.path.join(a.out, f"backward_trace_{load}.json"))
        for name, ts in times.items():
            ms = statistics.median(ts)
            records.append({"load": load, "call": name, "ms": ms, "ms_rounds": ts, "tflops": flops[name] / ms / 1e9})
        records.append({"load": load, "call": "backward kernels", "kernels_ms": kernels,
                        "allocator_in_rounds": allocator,
                        "timeline": timeline})
        by = {r["call"]: r for r in records if r["load"] == load and "ms" in r}
        for name, r in by.items():
            base = name.removesuffix(" dense").removesuffix(" grouped_mm").removesuffix(" bmm")
            rate = lambda peer: f"{100 * r['tflops'] / by[peer]['tflops']:.0f} %" if peer in by else ""  # noqa: E731
            dense, bmm = (rate(base + " dense"), rate(base + " bmm")) if name == base else ("", "")
            lines.append(f"| {load} | {name} | {r['ms']:.3f} | {min(r['ms_rounds']):.3f}-{max(r['ms_rounds']):.3f} "
                         f"| {r['tflops']:.0f} | {dense} | {bmm} |")
        lines.append(f"| {load} | backward kernels | " + ", ".join(f"{k[:28]} {v:.2f}" for k, v in
                                                                 list(kernels.items())[:6]) + " | | | |")
        lines.append(f"| {load} | backward timeline | wall {timeline['wall_ms']:.2f} ms/call, kernels "
                     f"{timeline['kernels_ms']:.2f}, host calls {timeline['host_ms']} | allocator in rounds "
                     f"{allocator} | | |")
        del calls, split
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "gemm_vs_dense.json"), "w") as f:
        json.dump({"machine": machine(), "preset": a.preset, "tokens": a.tokens, "rounds": a.rounds,
                   "seconds": a.seconds, "records": records}, f, indent=1)
    print(f"{a.preset}, {a.rounds} interleaved rounds of {a.seconds} s per call (steady state)")
    print("| load | call | ms (median) | min-max | TFLOP/s | % of dense rate | % of bmm rate |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
