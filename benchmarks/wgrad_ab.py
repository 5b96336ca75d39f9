"""The expert weight-gradient GEMM alone: tile variants against CUTLASS's K-grouped GEMM, at the power cap.

    PYTHONPATH=src python3 benchmarks/wgrad_ab.py [--preset kimi-k2] [--experts 384,192] [--rounds 5]
        [--variants plan,...] [--kind gate_up|down] [--out DIR]
    PYTHONPATH=src python3 benchmarks/wgrad_ab.py --check     # the CPU interpreter: the flat variant's bits

The gate/up weight gradient of ``tokens x k`` rows spread evenly over each expert count (kimi-k2 at 8192 tokens:
384 x ~171 at EP 1, 192 x ~341 at EP 2): ``dW[l] = d_h[rows of l]ᵀ · x[rows of l]`` `[2I, D]` per expert (K =
the expert's rows, a few K steps per block, so the output's store weighs as much as the MMAs). Our
``wgrad_kernel`` per variant (tile shape, stages, programs per SM) and ``torch._grouped_mm`` with offsets along
K (what torch's grouped GEMM backward runs), in interleaved rounds; each variant's result compared with the plan's
bit for bit. ``flat`` is the plan's tile in ``wgrad_flat_kernel``: one task loop over every expert's blocks (the
plan's loop is flattened only inside an expert); ``groupsG`` splits the programs into G groups that each walk a
share of the experts; ``ws`` is the plan's tile in the warp-specialised Gluon kernel that ``expert_backward`` runs on
Hopper (``megamoe.kernels.wgrad_warp_specialized``; ``plan`` is the Triton ``wgrad_kernel``, the CPU's). Each load
takes the planner's tile for its rows per expert. Prints ms, TFLOP/s, the store's share (the output's bytes at
4.8 TB/s) and % of the peer; writes DIR/wgrad_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton
import triton.language as tl

from megamoe.bench.experts import make_load
from megamoe.config import preset
from megamoe.kernels import expert_gemm_bwd, wgrad_warp_specialized
from megamoe.kernels.wgrad_carry import STORE
from megamoe.ops.launch import scratch_allocator
from megamoe.ops.tiles import TileConfig, plan_tiles
from megamoe.runtime import num_programs

from sustained import interleaved_rounds  # benchmarks/, beside this script


@triton.jit
def wgrad_flat_kernel(
    a_ptr, b_ptr, out_ptr, offsets_ptr, counts_ptr, num_experts, OUT_M, OUT_N,
    DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FLATTEN: tl.constexpr,
):
    """``wgrad_kernel``'s blocks (the same tasks, dealt the same way) in one task loop over every expert, the
    descriptors made per block: the plan's loop is flattened only inside an expert (3-7 blocks per program at
    192 experts), so its pipeline drains at every expert."""
    num_n = tl.cdiv(OUT_N, BLOCK_N)
    per_expert = tl.cdiv(OUT_M, BLOCK_M) * num_n
    for task in tl.range(tl.program_id(0), num_experts * per_expert, NUM_PROGRAMS, flatten=FLATTEN):
        expert = task // per_expert
        block = task - expert * per_expert
        row0 = tl.load(offsets_ptr + expert)
        row_end = row0 + tl.load(counts_ptr + expert)
        a_desc, b_desc, out_desc = expert_gemm_bwd.wgrad_descriptors(a_ptr, b_ptr, out_ptr, expert, row_end, OUT_M,
                                                                     OUT_N, BLOCK_M, BLOCK_N, BLOCK_K)
        expert_gemm_bwd.wgrad_block(a_desc, b_desc, out_desc, row0, row_end, block // num_n * BLOCK_M,
                                    block % num_n * BLOCK_N, row0 * 0 + STORE, out_ptr, out_ptr, OUT_M, OUT_N,
                                    DOT_FP32, False, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def wgrad_grouped_kernel(
    a_ptr, b_ptr, out_ptr, offsets_ptr, counts_ptr, num_experts, OUT_M, OUT_N,
    DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FLATTEN: tl.constexpr,
    GROUPS: tl.constexpr,
):
    """``wgrad_kernel`` with the programs split into GROUPS groups, group g taking experts g, g + GROUPS, ...
    (each dealt round-robin over the group's programs, as the plan deals an expert over all of them): a program
    switches experts num_experts / GROUPS times instead of num_experts (each switch drains its pipeline, waits
    for its last store and makes three descriptors), while GROUPS experts' operands share the L2."""
    num_n = tl.cdiv(OUT_N, BLOCK_N)
    per_expert = tl.cdiv(OUT_M, BLOCK_M) * num_n
    group_size: tl.constexpr = NUM_PROGRAMS // GROUPS
    pid = tl.program_id(0)
    group = pid // group_size
    local = pid - group * group_size
    for j in range(0, tl.cdiv(num_experts - group, GROUPS)):
        expert = group + j * GROUPS
        first = (local - (j * per_expert) % group_size + group_size) % group_size
        if first < per_expert:
            row0 = tl.load(offsets_ptr + expert)
            row_end = row0 + tl.load(counts_ptr + expert)
            a_desc, b_desc, out_desc = expert_gemm_bwd.wgrad_descriptors(a_ptr, b_ptr, out_ptr, expert, row_end,
                                                                         OUT_M, OUT_N, BLOCK_M, BLOCK_N, BLOCK_K)
            for task in tl.range(first, per_expert, group_size, flatten=FLATTEN):
                expert_gemm_bwd.wgrad_block(a_desc, b_desc, out_desc, row0, row_end, task // num_n * BLOCK_M,
                                            task % num_n * BLOCK_N, row0 * 0 + STORE, out_ptr, out_ptr, OUT_M, OUT_N,
                                            DOT_FP32, False, BLOCK_M, BLOCK_N, BLOCK_K)


#: name -> (TileConfig or None for the plan's, programs per SM)
VARIANTS = {
    "plan": (None, 1),
    "128x256x64x3": (TileConfig(128, 256, 64, num_warps=8, num_stages=3, flatten=True), 1),
    "256x128x32x4": (TileConfig(256, 128, 32, num_warps=8, num_stages=4, flatten=True), 1),
    "128x128x32x3-2cta": (TileConfig(128, 128, 32, num_warps=8, num_stages=3, flatten=True), 2),
    "128x128x32x3-2cta-w4": (TileConfig(128, 128, 32, num_warps=4, num_stages=3, flatten=True), 2),
    "128x256x32x3-unflat": (TileConfig(128, 256, 32, num_warps=8, num_stages=3, flatten=False), 1),
    "128x256x32x5": (TileConfig(128, 256, 32, num_warps=8, num_stages=5, flatten=True), 1),
    "128x256x32x6": (TileConfig(128, 256, 32, num_warps=8, num_stages=6, flatten=True), 1),
    "flat": (None, 1),  # the plan's tile, wgrad_flat_kernel
    "ws": (None, 1),  # the plan's tile in wgrad_warp_specialized's Gluon kernel
    "ws-inflight": (None, 1),  # the same, one wgmma left in flight per K step (MMA_IN_FLIGHT)
    # the Gluon kernel's ring deeper at BK 32, one wgmma in flight (184 / 208 KB of shared memory)
    "ws-32x5": (TileConfig(128, 256, 32, num_warps=4, num_stages=5, flatten=True), 1),
    "ws-32x6": (TileConfig(128, 256, 32, num_warps=4, num_stages=6, flatten=True), 1),
    "groups2": (None, 1),  # the plan's tile, wgrad_grouped_kernel with GROUPS programs groups
    "groups4": (None, 1),
    "groups6": (None, 1),
    "groups12": (None, 1),
}
#: variants that run another kernel than expert_gemm_bwd.wgrad_kernel
KERNELS = {"flat": wgrad_flat_kernel, **{f"groups{g}": wgrad_grouped_kernel for g in (2, 4, 6, 12)}}
#: extra constexprs of a variant's kernel
EXTRA = {**{f"groups{g}": {"GROUPS": g} for g in (2, 4, 6, 12)},
         **{name: {"MMA_IN_FLIGHT": True} for name in ("ws-inflight", "ws-32x5", "ws-32x6")}}


def check_flat() -> None:
    """wgrad_flat_kernel and wgrad_grouped_kernel against wgrad_kernel on small loads (an empty expert, partial K
    steps, expert counts the groups do not divide), bit for bit."""
    g = torch.Generator().manual_seed(0)
    variants = [(wgrad_flat_kernel, {}), (wgrad_grouped_kernel, {"GROUPS": 2}), (wgrad_grouped_kernel, {"GROUPS": 3})]
    for counts in ([40, 0, 17, 33, 9], [5, 70]):
        counts = torch.tensor(counts, dtype=torch.int32)
        offsets = (counts.cumsum(0) - counts).to(torch.int32)
        rows, out_m, out_n = int(counts.sum()), 64, 96
        a = torch.randn(rows, out_m, generator=g).bfloat16()
        b = torch.randn(rows, out_n, generator=g).bfloat16()
        outs = []
        for kernel, extra in [(expert_gemm_bwd.wgrad_kernel, {})] + variants:
            out = torch.full((len(counts), out_m, out_n), float("nan"), dtype=torch.bfloat16)
            with scratch_allocator():
                carry = (counts, out, out) if kernel is expert_gemm_bwd.wgrad_kernel else ()  # unread: no CARRY
                kernel[(6,)](a, b, out, offsets, counts, len(counts), out_m, out_n, *carry, DOT_FP32=True,
                             NUM_PROGRAMS=6, BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, FLATTEN=True, **extra)
            outs.append(out)
        want = torch.stack([a[o:o + c].float().T @ b[o:o + c].float()
                            for o, c in zip(offsets.tolist(), counts.tolist())])
        assert (outs[0].float() - want).abs().max() <= 0.02 * want.abs().max(), "wgrad_kernel is wrong"
        for (kernel, extra), out in zip(variants, outs[1:]):
            assert torch.equal(outs[0], out), f"{kernel.fn.__name__} {extra}: bits differ from wgrad_kernel's"
    print("wgrad_flat_kernel, wgrad_grouped_kernel: the same bits as wgrad_kernel")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", default="384,192")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--kind", choices=("gate_up", "down"), default="gate_up",
                        help="the gate/up wgrad (d_hᵀ·x, [2I, D] per expert) or the down one (dyᵀ·act_w, [D, I])")
    parser.add_argument("--check", action="store_true",
                        help="the CPU interpreter: wgrad_flat_kernel's bits against wgrad_kernel's, small shapes")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    if a.check:
        check_flat()
        return
    cfg, dev = preset(a.preset), torch.device("cuda")
    d, i = cfg.hidden, cfg.intermediate
    records, lines = [], []
    for experts in (int(e) for e in a.experts.split(",")):
        x, counts, offsets, _, _ = make_load(experts, a.tokens * cfg.top_k, d, i, dev)
        rows = x.shape[0]
        d_h = torch.randn(rows, 2 * i, generator=torch.Generator(device=dev).manual_seed(3), device=dev).bfloat16()
        if a.kind == "down":  # dy [R, D] and act_w [R, I] in the places of d_h and x
            d_h, x = x, d_h[:, :i].contiguous()
        out_m, out_n = d_h.shape[1], x.shape[1]
        ends = counts.cumsum(0).to(torch.int32)
        outs, calls, status = {}, {}, {}
        plan_out, other_out = (torch.empty(experts, out_m, out_n, dtype=torch.bfloat16, device=dev) for _ in range(2))
        for name in a.variants.split(","):
            tile, per_sm = VARIANTS[name]
            c = tile or plan_tiles("wgrad", dev, rows / experts)
            programs = per_sm * num_programs(dev)
            out = plan_out if name == "plan" else other_out  # the variants share one buffer (GBs each)

            def call(c=c, programs=programs, out=out, kernel=KERNELS.get(name, expert_gemm_bwd.wgrad_kernel),
                     extra=EXTRA.get(name, {}), ws=name.startswith("ws")):
                with scratch_allocator():
                    if ws:
                        return wgrad_warp_specialized.wgrad_ws_kernel[(programs,)](
                            d_h, x, out, offsets, counts, experts, out_m, out_n, counts, out, out,
                            NUM_PROGRAMS=programs, BLOCK_N=c.block_n, BLOCK_K=c.block_k, STAGES=c.num_stages, num_warps=4, **extra)
                    carry = (counts, out, out) if kernel is expert_gemm_bwd.wgrad_kernel else ()  # unread: no CARRY
                    kernel[(programs,)](
                        d_h, x, out, offsets, counts, experts, out_m, out_n, *carry, DOT_FP32=False,
                        NUM_PROGRAMS=programs,
                        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, FLATTEN=c.flatten,
                        num_warps=c.num_warps, num_stages=c.num_stages, **extra)
            try:
                call()
                torch.cuda.synchronize()
            except Exception as e:  # shared memory or registers: reported, not timed
                status[name] = f"failed: {type(e).__name__}: {str(e)[:100]}"
                continue
            status[name] = ("same bits" if "plan" not in outs or torch.equal(out, outs["plan"]) else "DIFFERENT bits")
            outs[name], calls[name] = out, call
        d_h_t = d_h.T  # [2I, rows]: K-grouped, as the grouped GEMM's backward calls it
        calls["torch._grouped_mm"] = lambda: torch._grouped_mm(d_h_t, x, offs=ends)
        try:
            peer = calls["torch._grouped_mm"]()
            diff = float((peer[:4].float() - outs["plan"][:4].float()).abs().max()) if "plan" in outs else None
            status["torch._grouped_mm"] = f"max |diff| vs plan (4 experts) {diff}"
            del peer
        except Exception as e:
            status["torch._grouped_mm"] = f"failed: {type(e).__name__}: {str(e)[:100]}"
            del calls["torch._grouped_mm"]
        times = interleaved_rounds(calls, a.rounds, a.seconds)
        flops = 2 * rows * out_m * out_n
        store_ms = experts * out_m * out_n * 2 / 4.8e12 * 1e3
        peer_ms = statistics.median(times["torch._grouped_mm"]) if "torch._grouped_mm" in times else None
        for name, st in status.items():
            ts = times.get(name)
            ms = statistics.median(ts) if ts else None
            records.append({"experts": experts, "rows": rows, "variant": name, "ms": ms, "ms_rounds": ts,
                            "status": st, "tile": vars(VARIANTS[name][0]) if name in VARIANTS and VARIANTS[name][0]
                            else None})
            if ms is None:
                lines.append(f"| {experts} x {rows // experts} | {name} | — | | | | {st} |")
                continue
            share = f"{100 * peer_ms / ms:.0f} %" if peer_ms else ""
            lines.append(f"| {experts} x {rows // experts} | {name} | {ms:.3f} | {flops / ms / 1e9:.0f} "
                         f"| {store_ms:.2f} | {share} | {st} |")
        del outs, calls, plan_out, other_out
        torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "wgrad_ab.json"), "w") as f:
        json.dump({"args": vars(a), "records": records}, f, indent=1)
    print(f"{a.preset} {a.kind} wgrad, {a.rounds} interleaved rounds of {a.seconds} s")
    print("| load | variant | ms | TFLOP/s | store floor ms | % of grouped_mm's rate | result |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
