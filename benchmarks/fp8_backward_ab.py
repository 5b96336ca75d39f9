"""The FP8 expert backwards (fp8-block, mxfp8) against the BF16 one on the same load, at the power cap (one GPU).

    PYTHONPATH=src python3 benchmarks/fp8_backward_ab.py [--preset kimi-k2] [--experts 192] [--rounds 5]
        [--variants plan,triton,wgrad-128x128x3,...] [--mx-variants plan,...] [--out DIR]

``tokens x k`` rows spread evenly over --experts experts (kimi-k2 at 8192 tokens: 192 x 341, EP 2's per-rank
load). In interleaved rounds: `expert_backward` (BF16); `expert_backward_fp8_block` and
`expert_backward_mxfp8` with the planner's tiles and with each of --variants' / --mx-variants' pinned kinds
(transposed weights made once, untimed, as once per optimizer step); the four GEMMs dense through cuBLAS in
BF16 (`torch.mm`) and in E4M3 with row/column scales (`torch._scaled_mm`), M or K = all rows: the ceilings.
Each plan's gradients against the BF16 ones, each variant's bits against its plan's, and each format's
kernels in one steady call (torch profiler). Writes DIR/fp8_backward_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from megamoe.bench.experts import backward_load
from megamoe.bench.harness import error_stats
from megamoe.config import preset
from megamoe.ops.experts_bwd import expert_backward
from megamoe.ops.expert_weights import transposed_weights
from megamoe.ops.experts_fp8_bwd import expert_backward_fp8_block, expert_backward_mxfp8
from megamoe.ops.tiles import TileConfig

from backward_tiles_ab import gaps  # benchmarks/, beside this script
from sustained import interleaved_rounds

#: fp8-block variants: name -> {kind: TileConfig}; the planner's tiles for every kind not named.
VARIANTS = {
    "plan": {},
    "wgrad-128x128x3": {"wgrad": TileConfig(128, 128, 128, num_warps=8, num_stages=3)},
    "wgrad-128x128x4-flat": {"wgrad": TileConfig(128, 128, 128, num_warps=8, num_stages=4, flatten=True)},
}
#: (and "triton": the planner's tiles in the Triton kernels where Hopper runs Gluon ones, warp_specialized=False,
#: in FP8-block and in BF16)
#: mxfp8 variants, as VARIANTS
MX_VARIANTS = {
    "plan": {},
    "wgrad-128x128x64-flat": {"wgrad": TileConfig(128, 128, 64, num_warps=8, num_stages=3, flatten=True)},
    "wgrad-128x128x32x4-flat": {"wgrad": TileConfig(128, 128, 32, num_warps=8, num_stages=4, flatten=True)},
}


def fp8_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 rows of ``t`` with one fp32 scale per row (``_scaled_mm``'s row-wise mode)."""
    t = t.float().contiguous()
    scale = t.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
    return (t / scale).to(torch.float8_e4m3fn), scale


def dense_calls(dy, act, d_h, x, wd, wgu):
    """The backward's four GEMMs dense, M (dgrads) or K (wgrads) = all rows: cuBLAS BF16 and row-wise E4M3."""
    rows, d = dy.shape
    i = act.shape[1]
    outs = [torch.empty(rows, i, dtype=torch.bfloat16, device=dy.device), torch.empty_like(x),
            torch.empty(d, i, dtype=torch.bfloat16, device=dy.device),
            torch.empty(2 * i, d, dtype=torch.bfloat16, device=dy.device)]

    def bf16():
        torch.mm(dy, wd[0], out=outs[0])
        torch.mm(d_h, wgu[0], out=outs[1])
        torch.mm(dy.T, act, out=outs[2])
        torch.mm(d_h.T, x, out=outs[3])

    # A row-major [M, K], B column-major (its [N, K] rows transposed), per-row / per-column scales
    pairs = [(dy, wd[0].T), (d_h, wgu[0].T), (dy.T.contiguous(), act.T.contiguous()),
             (d_h.T.contiguous(), x.T.contiguous())]
    quantised = [(fp8_rowwise(a), fp8_rowwise(b_rows)) for a, b_rows in pairs]

    def fp8():
        for (a, sa), (b, sb) in quantised:
            torch._scaled_mm(a, b.T, sa, sb.T, out_dtype=torch.bfloat16)

    return {"dense bf16 (cuBLAS)": bf16, "dense e4m3 (_scaled_mm)": fp8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--mx-variants", default=",".join(MX_VARIANTS))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    os.makedirs(a.out, exist_ok=True)  # before the run: the profiled call's trace goes there
    cfg, dev = preset(a.preset), torch.device("cuda")
    d, i = cfg.hidden, cfg.intermediate
    load = backward_load(cfg, a.experts, a.tokens, dev)
    args, x, wgu, wd, rows = load.args, load.x, load.w_gate_up, load.w_down, load.x.shape[0]
    g = torch.Generator(device=dev).manual_seed(8)
    d_h = torch.randn(rows, 2 * i, generator=g, device=dev).bfloat16()  # the dense peers' dgrad operand
    wt = {"fp8-block": transposed_weights(wgu, wd), "mxfp8": transposed_weights(wgu, wd, "mxfp8")}
    calls = {"bf16": lambda: expert_backward(*args)}

    for name in a.variants.split(","):
        kw = {"warp_specialized": False} if name == "triton" else {"tiles": VARIANTS[name]}
        if name == "triton":
            calls["bf16 triton"] = lambda: expert_backward(*args, warp_specialized=False)
        calls[f"fp8-block {name}"] = (lambda kw=kw: expert_backward_fp8_block(*args, weights_t=wt["fp8-block"], **kw))
    for name in filter(None, a.mx_variants.split(",")):
        calls[f"mxfp8 {name}"] = (lambda t=MX_VARIANTS[name]: expert_backward_mxfp8(
            *args, weights_t=wt["mxfp8"], tiles=t))
    ref = calls["bf16"]()
    errors, status, plan_grads = {}, {}, None
    for name in list(calls):
        if name == "bf16":
            continue
        try:
            got = calls[name]()
            torch.cuda.synchronize()
        except Exception as e:  # a variant that does not compile (shared memory, registers) is reported
            status[name] = f"failed: {type(e).__name__}: {str(e)[:120]}"
            del calls[name]
            continue
        if name.endswith("plan"):
            errors[name] = {k: {m: v for m, v in error_stats(getattr(got, k), getattr(ref, k)).items()
                                if m in ("rel", "row", "finite")}
                            for k in ("d_x", "d_router", "d_w_gate_up", "d_w_down")}
        if name.endswith("plan"):
            plan_grads = got
        elif name.startswith("bf16 "):
            same = all(torch.equal(getattr(got, k), getattr(ref, k)) for k in ("d_x", "d_router", "d_w_gate_up",
                                                                             "d_w_down"))
            status[name] = f"same bits as bf16: {same}"
        else:
            same = all(torch.equal(getattr(got, k), getattr(plan_grads, k))
                       for k in ("d_x", "d_router", "d_w_gate_up", "d_w_down"))
            status[name] = f"same bits as plan: {same}"
        del got
    del ref, plan_grads
    calls.update(dense_calls(load.dy, load.act, d_h, x, wd, wgu))
    times = interleaved_rounds(calls, a.rounds, a.seconds)
    ms = {k: statistics.median(v) for k, v in times.items()}
    timelines = {name: gaps(calls[name], a.out) for name in ("bf16", "bf16 triton", "fp8-block plan",
                                                             "fp8-block triton", "mxfp8 plan") if name in calls}
    with open(os.path.join(a.out, "fp8_backward_ab.json"), "w") as f:
        json.dump({"args": vars(a), "ms": ms, "rounds": times, "status": status, "vs_bf16": errors,
                   "timelines": timelines,
                   "variants": {n: {k: vars(c) for k, c in VARIANTS[n].items()} for n in a.variants.split(",")
                                if n in VARIANTS},
                   "mx_variants": {n: {k: vars(c) for k, c in MX_VARIANTS[n].items()}
                                   for n in filter(None, a.mx_variants.split(","))}},
                  f, indent=1, default=str)
    flops = 12 * rows * d * i
    print(f"{a.preset}, {a.experts} experts x ~{rows // a.experts} rows, {a.rounds} rounds of {a.seconds} s")
    print("| backward | ms (median) | TFLOP/s | x vs bf16 | |")
    print("|---|---|---|---|---|")
    for k, v in ms.items():
        print(f"| {k} | {v:.3f} | {flops / v / 1e9:.0f} | {ms['bf16'] / v:.2f} | {status.get(k, '')} |")
    for k, s in status.items():
        if k not in ms:
            print(f"| {k} | — | | | {s} |")
    for name, e in errors.items():
        print(name, "against bf16:", {k: {m: round(float(x), 4) for m, x in v.items()} for k, v in e.items()})
    for name, t in timelines.items():
        if not t:
            continue
        print(f"{name}, one steady call: kernels {t['busy_ms']:.2f} ms busy of a {t['span_ms']:.2f} ms span")
        merged: dict[str, float] = {}
        for kname, kms in t["kernels"]:
            merged[kname] = merged.get(kname, 0.0) + kms
        for kname, kms in sorted(merged.items(), key=lambda kv: -kv[1])[:12]:
            print(f"  {kms:8.3f} ms  {kname}")


if __name__ == "__main__":
    main()
