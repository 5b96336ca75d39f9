"""The FP8-block forward tiles: the Triton kernels against the warp-specialised Gluon kernel and _scaled_mm, at the cap.

    PYTHONPATH=src python3 benchmarks/fp8_forward_ab.py [--kind gate_up|down] [--experts 192] [--rounds 5] [--out DIR]

``tokens x k`` rows spread evenly over --experts experts (kimi-k2 at 8192 tokens: 384 x ~171 is EP 1, 192 x
~341 EP 2). ``triton``: ``gate_up_fp8`` / ``down_fp8`` with ``warp_specialized=False`` at the planner's tile for the
load's mean rows; ``library``: the same call as the layer makes it (on Hopper the Gluon kernel where the planner
gives 128-row tiles); ``ws-128``: the Gluon kernel at 128-row tiles whatever the planner says (where it gives
64-row gate/up tiles, <= 192 rows per expert); ``dense``: ``torch._scaled_mm`` (row / column scales) on all rows at
once, the same N and K. Outputs are compared with ``triton``'s bit for bit. One kind and load per process. Prints
ms, TFLOP/s and % of dense; writes DIR/fp8_forward_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from megamoe.bench.experts import fp8_block_operands, make_load
from megamoe.config import preset
from megamoe.ops.experts import ExpertForwardQuantized
from megamoe.ops.experts_fp8 import down_fp8, gate_up_fp8, plan_tiles_fp8
from megamoe.ops.tiles import TileConfig

from sustained import interleaved_rounds  # benchmarks/, beside this script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=192)
    parser.add_argument("--kind", choices=("gate_up", "down"), default="gate_up")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    cfg, dev = preset(a.preset), torch.device("cuda")
    d, i = cfg.hidden, cfg.intermediate
    x, counts, offsets, wgu, wd = make_load(a.experts, a.tokens * cfg.top_k, d, i, dev)
    rows = x.shape[0]
    q = fp8_block_operands(x, counts, offsets, wgu, wd)  # the Triton kernels' gate/up outputs: down's inputs
    del x, wgu, wd
    gate_up = a.kind == "gate_up"
    wide = TileConfig(128, 128, 128, num_warps=8, num_stages=3 if gate_up else 4, group_m=4 if gate_up else 8)
    outs = {name: ExpertForwardQuantized(torch.empty_like(q.fwd.h), torch.empty_like(q.fwd.act_q),
                                         torch.empty_like(q.fwd.act_scale), torch.empty_like(q.fwd.y))
            for name in ("triton", "library", "ws-128")}
    if gate_up:
        a_q, w_q, n, k, fields = q.x_q, q.wgu_q, 2 * i, d, ("h", "act_q", "act_scale")
        run = lambda out, **kw: gate_up_fp8(q.x_q, q.x_s, counts, offsets, q.wgu_q, q.wgu_s, out, **kw)  # noqa: E731
    else:
        a_q, w_q, n, k, fields = q.fwd.act_q, q.wd_q, d, i, ("y",)
        run = lambda out, **kw: down_fp8(q.fwd.act_q, q.fwd.act_scale, counts, offsets, q.wd_q, q.wd_s,  # noqa: E731
                                         out.y, **kw)
    calls = {"triton": lambda: run(outs["triton"], warp_specialized=False),
             "library": lambda: run(outs["library"]),
             "ws-128": lambda: run(outs["ws-128"], tiles=wide)}
    status = {"triton": f"planner's tile {plan_tiles_fp8(a.kind, dev, rows / a.experts)}", "library": "",
              "ws-128": f"{wide}"}
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    for name in calls:
        for f in fields:
            t = getattr(outs[name], f)
            t.view(torch.uint8).fill_(0x7F) if f == "act_q" else t.fill_(float("nan"))
        calls[name]()
    torch.cuda.synchronize()
    for name in ("library", "ws-128"):
        same = all(torch.equal(bits(getattr(outs[name], f)), bits(getattr(outs["triton"], f))) for f in fields)
        status[name] = ("same bits" if same else "DIFFERENT bits") + (f"; {status[name]}" if status[name] else "")
    b = w_q[0].T  # [K, N] column-major, as cuBLAS takes B
    r, c = torch.rand(rows, 1, device=dev) + 0.5, torch.rand(1, n, device=dev) + 0.5
    calls["dense"] = lambda: torch._scaled_mm(a_q, b, r, c, out_dtype=torch.bfloat16)
    status["dense"] = "torch._scaled_mm, row / column scales"
    times = interleaved_rounds(calls, a.rounds, a.seconds)
    flops = 2 * rows * n * k
    dense_ms = statistics.median(times["dense"])
    records, lines = [], []
    for name, st in status.items():
        ms = statistics.median(times[name])
        records.append({"experts": a.experts, "rows": rows, "kind": a.kind, "variant": name, "ms": ms,
                        "ms_rounds": times[name], "status": st})
        lines.append(f"| {a.experts} x {rows // a.experts} | {name} | {ms:.3f} | {flops / ms / 1e9:.0f} | "
                     f"{100 * dense_ms / ms:.0f} % | {st} |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fp8_forward_ab.json"), "w") as f:
        json.dump({"args": vars(a), "records": records}, f, indent=1)
    print(f"{a.preset} fp8-block {a.kind}, {a.rounds} interleaved rounds of {a.seconds} s")
    print("| load | variant | ms | TFLOP/s | % of dense | result |")
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
