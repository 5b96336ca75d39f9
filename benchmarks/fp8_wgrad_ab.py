"""The FP8-block wgrad: the Triton kernel against the warp-specialised Gluon one and its knobs, at the power cap.

    PYTHONPATH=src python3 benchmarks/fp8_wgrad_ab.py [--experts 192] [--rounds 5] [--variants triton,ws,...]
        [--out DIR]

kimi-k2's two weight gradients of one expert backward (dW_gate_up = d_hᵀ · x, dW_down = dyᵀ · act_w) on
``tokens x k`` rows spread evenly over --experts experts, from operands quantised along each expert's tokens
once (``quantize_tokens``, untimed). A call is both wgrads through ``experts_fp8_bwd.wgrad_fp8``: ``triton`` with
``warp_specialized=False``, ``ws`` as the backward runs it, ``ws-*`` at other ring depths
(``wgrad_fp8_ws_constexprs``' knob). ``dense``: ``torch._scaled_mm`` on the same two GEMMs
with every row in one K (row / column scales). Each variant's gradients are compared with ``triton``'s bit for
bit. Prints ms, TFLOP/s and % of dense; writes DIR/fp8_wgrad_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from megamoe.config import preset
from megamoe.ops.experts_fp8_bwd import plan_tiles_fp8_bwd, quantize_tokens, token_blocks, wgrad_fp8
from megamoe.runtime import num_programs

from sustained import interleaved_rounds  # benchmarks/, beside this script

#: name -> wgrad_fp8's keywords
VARIANTS = {
    "triton": {"warp_specialized": False},
    "ws": {},
    "ws-s4": {"stages": 4},
    "ws-s3": {"stages": 3},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    cfg, dev = preset(a.preset), torch.device("cuda")
    d, i, experts = cfg.hidden, cfg.intermediate, a.experts
    rows = a.tokens * cfg.top_k
    counts = torch.full((experts,), rows // experts, dtype=torch.int32, device=dev)
    counts[: rows % experts] += 1
    offsets = (counts.cumsum(0) - counts).to(torch.int32)
    g = torch.Generator(device=dev).manual_seed(3)
    blocks = token_blocks(counts, offsets, rows)
    # (A, B, output shape): dW_down = dyᵀ · act_w [D, I], dW_gate_up = d_hᵀ · x [2I, D]
    pairs = []
    for m, n in ((d, i), (2 * i, d)):
        a_rows = torch.randn(rows, m, generator=g, device=dev).bfloat16()
        b_rows = torch.randn(rows, n, generator=g, device=dev).bfloat16()
        pairs.append((*quantize_tokens(a_rows, blocks), *quantize_tokens(b_rows, blocks), (experts, m, n)))
        del a_rows, b_rows
    tile, programs = plan_tiles_fp8_bwd("wgrad", dev), num_programs(dev)
    outs = {name: [torch.empty(shape, dtype=torch.bfloat16, device=dev) for *_, shape in pairs]
            for name in a.variants.split(",")}

    def call(name):
        for (a_t, a_s, b_t, b_s, _), out in zip(pairs, outs[name]):
            wgrad_fp8(a_t, a_s, b_t, b_s, out, blocks, counts, tile, programs, **VARIANTS[name])

    calls, status = {}, {}
    for name in outs:
        for out in outs[name]:
            out.fill_(float("nan"))
        try:
            call(name)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 -- shared memory, a compile error: reported, not timed
            status[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            continue
        calls[name] = lambda name=name: call(name)
        status[name] = ""
    if "triton" in calls:
        for name in calls:
            if name != "triton":
                same = all(torch.equal(x, y) for x, y in zip(outs[name], outs["triton"]))
                status[name] = "same bits" if same else "DIFFERENT bits"
    dense = []
    for a_t, a_s, b_t, b_s, (_, m, n) in pairs:
        r, c = torch.rand(m, 1, device=dev) + 0.5, torch.rand(1, n, device=dev) + 0.5
        dense.append((a_t, b_t.T, r, c))
    calls["dense"] = lambda: [torch._scaled_mm(x, y, r, c, out_dtype=torch.bfloat16) for x, y, r, c in dense]
    status["dense"] = "torch._scaled_mm on both GEMMs, K = every row"
    times = interleaved_rounds(calls, a.rounds, a.seconds)
    flops = 2 * rows * (d * i + 2 * i * d)
    dense_ms = statistics.median(times["dense"])
    records, lines = [], []
    for name, st in status.items():
        ts = times.get(name)
        ms = statistics.median(ts) if ts else None
        records.append({"experts": experts, "rows": rows, "variant": name, "ms": ms, "ms_rounds": ts, "status": st,
                        "knobs": VARIANTS.get(name)})
        lines.append(f"| {experts} x {rows // experts} | {name} | " + (
            f"{ms:.3f} | {flops / ms / 1e9:.0f} | {100 * dense_ms / ms:.0f} % |" if ms else "— | | |") + f" {st} |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fp8_wgrad_ab.json"), "w") as f:
        json.dump({"args": vars(a), "records": records}, f, indent=1)
    print(f"{a.preset} fp8-block wgrads (down and gate/up), {a.rounds} interleaved rounds of {a.seconds} s")
    print("| load | variant | ms | TFLOP/s | % of dense | result |")
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
