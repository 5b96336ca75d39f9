"""Token tiles sized to the expert: swap-AB products with the weights in registers (issue 28's padding lever).

    PYTHONPATH=src python3 benchmarks/token_tile_probe.py [--kind gate_up|down] [--experts 192] [--rounds 5]
        [--variants plan,t176,...] [--out DIR]

cuBLAS computes a 341-row expert as two 176-token tiles (352 rows); our 128-row tiles compute 384
(benchmarks/results/2026-12-03-padding-probe), and neither ``tl.dot`` nor Gluon holds a 176-wide operand
(2026-12-04-forward-ping-pong). Here a tile is 128 weight rows x T tokens, T = T0 + T1 + T2 made of power-of-two
wgmma products (176 = 128 + 32 + 16) that share one weight fragment: each consumer warpgroup loads its 64 x BK
weight slice from shared memory into registers once per K step (wgmma's register A operand) and multiplies it
with each token slice in shared memory. A TMA producer warp fills a ring of STAGES slots; tasks are
(T-row tile, 128-weight-row slab) in the library's row-task order over a T-row tile map.

Outputs: gate/up's h (x · w_gate_upᵀ, without the SwiGLU and act) or down's y, stored through a transpose with
masked stores, compared bit for bit with the library's (``experts.gate_up`` / ``experts.down``, "plan"). Timed in
interleaved rounds at the power cap with cuBLAS's dense GEMM of all rows (same N and K) and
``torch._grouped_mm``. GPU only (Hopper). Writes DIR/token_tile_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from megamoe.bench.experts import make_load
from megamoe.config import preset
from megamoe.kernels.expert_gemm import row_tile_task
from megamoe.ops.experts import down, gate_up
from megamoe.ops.launch import scratch_allocator
from megamoe.routing.row_tiles import build_row_tiles
from megamoe.runtime import num_programs

from sustained import interleaved_rounds  # benchmarks/, beside this script

SLAB = gl.constexpr(128)  # weight rows per tile: 64 per consumer warpgroup
HALF = gl.constexpr(64)


@gluon.jit
def _task(task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, GROUP_M: gl.constexpr):
    tile, n = row_tile_task(task, num_n, 0, tile_run_ptr, GROUP_M)
    return gl.load(tile_expert_ptr + tile), gl.load(tile_row0_ptr + tile), gl.load(tile_row_end_ptr + tile), n


@gluon.jit
def _load_tokens(desc, row, k, bar, dest, T: gl.constexpr):
    if T > 0:
        tma.async_copy_global_to_shared(desc, [row, k], bar, dest)


@gluon.jit
def _producer(a_ptr, w_ptr, rows, w_rows, stride_a, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr,
              num_tiles_ptr, N, K, w_smem, x0, x1, x2, full, empty, NUM_PROGRAMS: gl.constexpr,
              T0: gl.constexpr, T1: gl.constexpr, T2: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr):
    w_desc = tma.make_tensor_descriptor(w_ptr, [w_rows, K], [K, 1], [HALF, BLOCK_K],
                                        gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_K], gl.bfloat16))
    d0 = tma.make_tensor_descriptor(a_ptr, [rows, K], [stride_a, 1], [T0, BLOCK_K],
                                    gl.NVMMASharedLayout.get_default_for([T0, BLOCK_K], gl.bfloat16))
    d1 = d0
    d2 = d0
    if T1 > 0:
        d1 = tma.make_tensor_descriptor(a_ptr, [rows, K], [stride_a, 1], [T1, BLOCK_K],
                                        gl.NVMMASharedLayout.get_default_for([T1, BLOCK_K], gl.bfloat16))
    if T2 > 0:
        d2 = tma.make_tensor_descriptor(a_ptr, [rows, K], [stride_a, 1], [T2, BLOCK_K],
                                        gl.NVMMASharedLayout.get_default_for([T2, BLOCK_K], gl.bfloat16))
    step_bytes: gl.constexpr = (SLAB + T0 + T1 + T2) * BLOCK_K * 2
    num_n = gl.cdiv(N, SLAB)
    num_tasks = gl.load(num_tiles_ptr) * num_n
    g = 0
    for task in range(gl.program_id(0), num_tasks, NUM_PROGRAMS):
        expert, row0, row_end, n = _task(task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr,
                                         GROUP_M)
        w_row = expert * N + n * SLAB
        for k in range(0, K, BLOCK_K):
            s = g % STAGES
            mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
            mbarrier.expect(full.index(s), step_bytes)
            w = w_smem.index(s)
            tma.async_copy_global_to_shared(w_desc, [w_row, k], full.index(s), w.slice(0, HALF))
            tma.async_copy_global_to_shared(w_desc, [w_row + HALF, k], full.index(s), w.slice(HALF, HALF))
            tma.async_copy_global_to_shared(d0, [row0, k], full.index(s), x0.index(s))
            _load_tokens(d1, row0 + T0, k, full.index(s), x1.index(s), T1)
            _load_tokens(d2, row0 + T0 + T1, k, full.index(s), x2.index(s), T2)
            g += 1


@gluon.jit
def _product(a, x, acc, T: gl.constexpr, layout: gl.constexpr):
    if T > 0:
        acc = warpgroup_mma(gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=layout, k_width=2)),
                            x.permute((1, 0)), acc, is_async=True)
    return acc


@gluon.jit
def _store_t(out_ptr, stride_out, acc, row0, rows_ok, col0, cols_ok, T: gl.constexpr):
    """out[row0 + j, col0 + i] = acc[i, j] (acc [64 weight rows, T tokens]) for j < rows_ok, i < cols_ok."""
    if T > 0:
        runs: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])  # 8 weight rows (16 B) per thread
        tile = gl.convert_layout(acc.to(gl.bfloat16), runs)
        i = gl.arange(0, HALF, layout=gl.SliceLayout(1, runs))
        j = gl.arange(0, T, layout=gl.SliceLayout(0, runs))
        ptrs = out_ptr + row0.to(gl.int64) * stride_out + col0 + (j[None, :] * stride_out + i[:, None])
        gl.store(ptrs, tile, mask=(i < cols_ok)[:, None] & (j < rows_ok)[None, :])


@gluon.jit
def _consumer(out_ptr, stride_out, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr,
              N, K, w_smem, x0, x1, x2, full, empty, WARPGROUP: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
              T0: gl.constexpr, T1: gl.constexpr, T2: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, IN_FLIGHT: gl.constexpr):
    m0: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, T0, 16])
    m1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, T1 if T1 > 0 else 16, 16])
    m2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, T2 if T2 > 0 else 16, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=m0, k_width=2)
    PRODUCTS: gl.constexpr = 1 + (T1 > 0) + (T2 > 0)  # wgmma groups per K step
    num_n = gl.cdiv(N, SLAB)
    num_tasks = gl.load(num_tiles_ptr) * num_n
    g = 0
    for task in range(gl.program_id(0), num_tasks, NUM_PROGRAMS):
        expert, row0, row_end, n = _task(task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr,
                                         GROUP_M)
        acc0 = gl.zeros((HALF, T0), gl.float32, m0)
        acc1 = gl.zeros((HALF, T1 if T1 > 0 else 16), gl.float32, m1)
        acc2 = gl.zeros((HALF, T2 if T2 > 0 else 16), gl.float32, m2)
        for k in range(0, K, BLOCK_K):
            s = g % STAGES
            mbarrier.wait(full.index(s), (g // STAGES) & 1)
            a = w_smem.index(s).slice(WARPGROUP * HALF, HALF).load(a_layout)
            acc0 = warpgroup_mma(a, x0.index(s).permute((1, 0)), acc0, is_async=True)
            acc1 = _product(a, x1.index(s), acc1, T1, m1)
            acc2 = _product(a, x2.index(s), acc2, T2, m2)
            if IN_FLIGHT:  # this step's products left running; the previous step's slot freed
                acc0, acc1, acc2 = warpgroup_mma_wait(num_outstanding=PRODUCTS, deps=(acc0, acc1, acc2))
                if k > 0:
                    mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), count=1)
            else:
                acc0, acc1, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2))
                mbarrier.arrive(empty.index(s), count=1)
            g += 1
        if IN_FLIGHT:
            acc0, acc1, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2))
            if K > 0:
                mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), count=1)
        col0 = n * SLAB + WARPGROUP * HALF
        rows_ok = row_end - row0
        _store_t(out_ptr, stride_out, acc0, row0, rows_ok, col0, N - col0, T0)
        _store_t(out_ptr, stride_out, acc1, row0 + T0, rows_ok - T0, col0, N - col0, T1)
        _store_t(out_ptr, stride_out, acc2, row0 + T0 + T1, rows_ok - T0 - T1, col0, N - col0, T2)


@gluon.jit
def token_tile_kernel(a_ptr, w_ptr, out_ptr, stride_a, stride_out,
                      tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr,
                      rows, w_rows, N, K, NUM_PROGRAMS: gl.constexpr, T0: gl.constexpr, T1: gl.constexpr,
                      T2: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                      IN_FLIGHT: gl.constexpr):
    """out[r, c] = sum_k a[r, k] w[expert(r) * N + c, k] over (T-row tile, 128-column slab) tasks."""
    w_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, SLAB, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_K], gl.bfloat16))
    x0 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, T0, BLOCK_K],
                                   gl.NVMMASharedLayout.get_default_for([T0, BLOCK_K], gl.bfloat16))
    X1: gl.constexpr = T1 if T1 > 0 else 8
    X2: gl.constexpr = T2 if T2 > 0 else 8
    x1 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, X1, BLOCK_K],
                                   gl.NVMMASharedLayout.get_default_for([X1, BLOCK_K], gl.bfloat16))
    x2 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, X2, BLOCK_K],
                                   gl.NVMMASharedLayout.get_default_for([X2, BLOCK_K], gl.bfloat16))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    gl.warp_specialize(
        [(_consumer, (out_ptr, stride_out, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr,
                      num_tiles_ptr, N, K, w_smem, x0, x1, x2, full, empty, gl.constexpr(0),
                      gl.constexpr(NUM_PROGRAMS), gl.constexpr(T0), gl.constexpr(T1), gl.constexpr(T2),
                      gl.constexpr(BLOCK_K), gl.constexpr(GROUP_M), gl.constexpr(STAGES), gl.constexpr(IN_FLIGHT))),
         (_consumer, (out_ptr, stride_out, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr,
                      num_tiles_ptr, N, K, w_smem, x0, x1, x2, full, empty, gl.constexpr(1),
                      gl.constexpr(NUM_PROGRAMS), gl.constexpr(T0), gl.constexpr(T1), gl.constexpr(T2),
                      gl.constexpr(BLOCK_K), gl.constexpr(GROUP_M), gl.constexpr(STAGES), gl.constexpr(IN_FLIGHT))),
         (_producer, (a_ptr, w_ptr, rows, w_rows, stride_a, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                      tile_run_ptr, num_tiles_ptr, N, K, w_smem, x0, x1, x2, full, empty,
                      gl.constexpr(NUM_PROGRAMS), gl.constexpr(T0), gl.constexpr(T1), gl.constexpr(T2),
                      gl.constexpr(BLOCK_K), gl.constexpr(GROUP_M), gl.constexpr(STAGES)))],
        [4, 1], [232, 80])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(full.index(s))
        mbarrier.invalidate(empty.index(s))


#: name -> (T0, T1, T2, stages, one K step's products left in flight)
VARIANTS = {
    "t176": (128, 32, 16, 4, False),
    "t176-s5": (128, 32, 16, 5, False),
    "t192": (128, 64, 0, 4, False),
    "t128": (128, 0, 0, 4, False),
    "t160": (128, 32, 0, 4, False),
    "t176-inflight": (128, 32, 16, 4, True),
    "t192-inflight": (128, 64, 0, 4, True),
    "t128-inflight": (128, 0, 0, 4, True),
}


def constexprs(programs: int, t0: int, t1: int, t2: int, stages: int, in_flight: bool, group_m: int = 8,
               block_k: int = 64) -> dict:
    return dict(NUM_PROGRAMS=programs, T0=t0, T1=t1, T2=t2, BLOCK_K=block_k, GROUP_M=group_m, STAGES=stages,
                IN_FLIGHT=in_flight)


def launch(a, w, out, counts, offsets, programs, t0, t1, t2, stages, in_flight):
    experts, n, k = w.shape
    tiles = build_row_tiles(counts, offsets, a.shape[0], t0 + t1 + t2)
    with scratch_allocator():
        token_tile_kernel[(programs,)](
            a, w, out, a.stride(0), out.stride(0), tiles.tile_expert, tiles.tile_row0, tiles.tile_row_end,
            tiles.tile_run, tiles.num_tiles, a.shape[0], experts * n, n, k, num_warps=4,
            **constexprs(programs, t0, t1, t2, stages, in_flight))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=192)
    parser.add_argument("--kind", choices=("gate_up", "down"), default="gate_up")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--variants", default="plan," + ",".join(VARIANTS))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    cfg, dev = preset(a.preset), torch.device("cuda")
    d, i = cfg.hidden, cfg.intermediate
    x, counts, offsets, wgu, wd = make_load(a.experts, a.tokens * cfg.top_k, d, i, dev)
    rows = x.shape[0]
    programs = num_programs(dev)
    if a.kind == "gate_up":
        a_in, w, n, k = x, wgu, 2 * i, d
        act = torch.empty(rows, i, dtype=torch.bfloat16, device=dev)
        plan_out = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)
        plan = lambda: gate_up(x, counts, offsets, wgu, plan_out, act)  # noqa: E731
    else:
        a_in = torch.randn(rows, i, generator=torch.Generator(device=dev).manual_seed(5), device=dev).bfloat16()
        w, n, k = wd, d, i
        plan_out = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)
        plan = lambda: down(a_in, counts, offsets, wd, plan_out)  # noqa: E731
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)
    calls, status = {}, {}
    for name in a.variants.split(","):
        if name == "plan":
            calls[name], status[name] = plan, "the library's kernel"
            plan()
            torch.cuda.synchronize()
            continue
        call = lambda v=VARIANTS[name]: launch(a_in, w, out, counts, offsets, programs, *v)  # noqa: E731
        out.fill_(float("nan"))
        try:
            call()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 -- a compile error or shared memory: reported, not timed
            status[name] = f"failed: {type(e).__name__}: {str(e)[:300]}"
            continue
        same = torch.equal(out, plan_out)
        diff = float((out.float() - plan_out.float()).abs().nan_to_num(1e9).max())
        status[name] = "same bits" if same else f"DIFFERENT bits: max |diff| {diff:.3g}"
        calls[name] = call
    w_dense = w[0].T.contiguous()
    dense_out = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)
    calls["dense"] = lambda: torch.mm(a_in, w_dense, out=dense_out)
    ends = counts.cumsum(0).to(torch.int32)
    w_t = w.transpose(1, 2)
    calls["torch._grouped_mm"] = lambda: torch._grouped_mm(a_in, w_t, offs=ends)
    status["dense"] = status["torch._grouped_mm"] = ""
    times = interleaved_rounds(calls, a.rounds, a.seconds)
    flops = 2 * rows * n * k
    dense_ms = statistics.median(times["dense"])
    records, lines = [], []
    for name, st in status.items():
        ts = times.get(name)
        ms = statistics.median(ts) if ts else None
        records.append({"experts": a.experts, "rows": rows, "kind": a.kind, "variant": name, "ms": ms,
                        "ms_rounds": ts, "status": st, "variant_args": VARIANTS.get(name)})
        lines.append(f"| {a.experts} x {rows // a.experts} | {name} | " + (
            f"{ms:.3f} | {flops / ms / 1e9:.0f} | {100 * dense_ms / ms:.0f} % |" if ms else "— | | |") + f" {st} |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "token_tile_probe.json"), "w") as f:
        json.dump({"args": vars(a), "records": records}, f, indent=1)
    print(f"{a.preset} {a.kind} (gate/up: h only), {a.rounds} interleaved rounds of {a.seconds} s")
    print("| load | variant | ms | TFLOP/s | % of dense | result |")
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
