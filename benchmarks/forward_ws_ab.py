"""The forward expert tiles in the warp-specialised Gluon kernel against the Triton plan and cuBLAS, at the power cap.

    PYTHONPATH=src python3 benchmarks/forward_ws_ab.py [--kind gate_up|down] [--experts 192] [--rounds 7]
        [--variants plan,ws,...] [--out DIR]

``tokens x k`` rows spread evenly over --experts experts (kimi-k2 at 8192 tokens: 192 x ~341). ``plan`` is
``experts.gate_up(warp_specialized=False)`` / ``experts.down`` at the planner's tile (the Triton kernels); ``ws*``
the same 128-row tasks in ``megamoe.kernels.forward_warp_specialized`` (``experts.forward_ws``) at the plan's
BLOCK_N and GROUP_M, with a BLOCK_K, a ring depth (default: the plan's stages) and one wgmma left in flight or not;
``dense`` cuBLAS on all rows at once (the same N and K), ``torch._grouped_mm`` the grouped problem. Every ws
variant's outputs are compared with the plan's bit for bit. One expert count per process (the outputs take GBs).
Prints ms, TFLOP/s and % of dense; writes DIR/forward_ws_ab.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics

import torch

from megamoe.bench.experts import make_load
from megamoe.config import SWIGLU, Activation, preset
from megamoe.ops.experts import down, forward_ws, gate_up
from megamoe.ops.tiles import plan_tiles
from megamoe.runtime import num_programs

from sustained import interleaved_rounds  # benchmarks/, beside this script

#: name -> (BLOCK_K, stages or None for the deepest ring, one wgmma group left in flight)
VARIANTS = {
    "ws": (64, None, True),  # what gate_up runs on Hopper: the planner's stages, one wgmma in flight
    "ws-wait": (64, None, False),
    "ws-s4": (64, 4, False),
    "ws-s4-inflight": (64, 4, True),
    "ws-s2": (64, 2, False),
    "ws-32": (32, 6, False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=192)
    parser.add_argument("--kind", choices=("gate_up", "down"), default="gate_up")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--variants", default="plan," + ",".join(VARIANTS))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    cfg, dev = preset(a.preset), torch.device("cuda")
    d, i, experts = cfg.hidden, cfg.intermediate, a.experts
    x, counts, offsets, wgu, wd = make_load(experts, a.tokens * cfg.top_k, d, i, dev)
    rows = x.shape[0]
    limit = Activation("swiglu-clamped", limit=7.0)  # the clamp's epilogue (kimi-k2 has none; a few instructions)
    programs = num_programs(dev)
    ends = counts.cumsum(0).to(torch.int32)
    if a.kind == "gate_up":
        a_in, w, n, k = x, wgu, 2 * i, d
        outs = {name: (torch.empty(rows, 2 * i, dtype=torch.bfloat16, device=dev),
                       torch.empty(rows, i, dtype=torch.bfloat16, device=dev)) for name in ("plan", "ws")}
        plan = lambda: gate_up(x, counts, offsets, wgu, *outs["plan"], activation=limit,  # noqa: E731
                               warp_specialized=False)
    else:
        a_in = torch.randn(rows, i, generator=torch.Generator(device=dev).manual_seed(5), device=dev).bfloat16()
        w, n, k = wd, d, i
        outs = {name: (torch.empty(rows, d, dtype=torch.bfloat16, device=dev),) for name in ("plan", "ws")}
        plan = lambda: down(a_in, counts, offsets, wd, *outs["plan"])  # noqa: E731
    tile = plan_tiles(a.kind, dev)  # the 128-row tile: BLOCK_N and GROUP_M
    calls, status = {}, {}
    for name in a.variants.split(","):
        if name == "plan":
            calls[name], status[name] = plan, f"planner's tile {plan_tiles(a.kind, dev, rows / experts)}"
            plan()
            continue
        bk, stages, in_flight = VARIANTS[name]
        t = dataclasses.replace(tile, block_k=bk)

        def call(t=t, stages=stages, in_flight=in_flight):
            out = outs["ws"]
            forward_ws(a_in, w, out[0], counts, offsets, t, programs, act=out[1] if len(out) > 1 else None,
                       activation=limit if len(out) > 1 else SWIGLU, stages=stages, mma_in_flight=in_flight)
        for out in outs["ws"]:
            out.fill_(float("nan"))
        try:
            call()
            torch.cuda.synchronize()
        except Exception as e:  # shared memory, a compile error: reported, not timed
            status[name] = f"failed: {type(e).__name__}: {str(e)[:160]}"
            continue
        same = all(torch.equal(p, q) for p, q in zip(outs["plan"], outs["ws"]))
        diffs = [float((p.float() - q.float()).abs().nan_to_num(1e9).max()) for p, q in zip(outs["plan"], outs["ws"])]
        status[name] = "same bits" if same else "DIFFERENT bits: max |diff| " + ", ".join(f"{v:.3g}" for v in diffs)
        calls[name] = call
    w_dense = w[0].T.contiguous()  # [K, N]: one expert's weights as a dense peer of the same N and K
    dense_out = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)
    calls["dense"] = lambda: torch.mm(a_in, w_dense, out=dense_out)
    w_t = w.transpose(1, 2)
    calls["torch._grouped_mm"] = lambda: torch._grouped_mm(a_in, w_t, offs=ends)
    status["dense"] = status["torch._grouped_mm"] = ""
    try:
        calls["torch._grouped_mm"]()
    except Exception as e:  # noqa: BLE001 -- reported, not timed
        status["torch._grouped_mm"] = f"failed: {type(e).__name__}: {str(e)[:160]}"
        del calls["torch._grouped_mm"]
    times = interleaved_rounds(calls, a.rounds, a.seconds)
    flops = 2 * rows * n * k
    dense_ms = statistics.median(times["dense"])
    records, lines = [], []
    for name, st in status.items():
        ts = times.get(name)
        ms = statistics.median(ts) if ts else None
        records.append({"experts": experts, "rows": rows, "kind": a.kind, "variant": name, "ms": ms, "ms_rounds": ts,
                        "status": st, "variant_args": VARIANTS.get(name)})
        lines.append(f"| {experts} x {rows // experts} | {name} | " + (
            f"{ms:.3f} | {flops / ms / 1e9:.0f} | {100 * dense_ms / ms:.0f} % |" if ms else "— | | |") + f" {st} |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "forward_ws_ab.json"), "w") as f:
        json.dump({"args": vars(a), "records": records}, f, indent=1)
    print(f"{a.preset} {a.kind}, {a.rounds} interleaved rounds of {a.seconds} s")
    print("| load | variant | ms | TFLOP/s | % of dense | result |")
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
