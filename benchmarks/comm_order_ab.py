"""How the copy kernels hand out tiles: round-robin, by counter, or round-robin then by counter.

    PYTHONPATH=src python3 benchmarks/comm_order_ab.py --out OUT [--sms 16,20,22,24]

On 2 GPUs (kimi-k2 rows, 8192 tokens per rank, uniform routing: comm_bench's problem), each variant
times one copy kernel between CUDA events (comm_bench's timing: sleep, device barrier, kernel; median
of the slowest rank) and reports cross GB/s against the peer ``copy_`` ceilings of the same run. The
library's kernels hand tile p, p + P, ... to program p of P: a program on a slower SM (two programs
sharing a TPC, say) still gets its full share and the others wait for it. Here the first STATIC %
of the tiles go round-robin and the rest to whichever program asks next (an atomic counter; the
last program out zeroes it for the next launch): 100 is the library's order, 0 every tile by
counter. Kinds: pull dispatch, push dispatch (the sender's push schedule) and push combine.

The first study of this script (commit 32da1d822042: cache hints, row orders) is recorded in
benchmarks/results/2026-11-30-tile-order.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import torch
import triton
import triton.language as tl

from megamoe import comm
from megamoe.comm import CommTuning, _tile
from megamoe.kernels.comm import peer_offset, tile_entries, vector_offsets
from triton.language.extra.cuda import globaltimer, smid
from megamoe.world import launch

import comm_bench  # benchmarks/, beside this script


@triton.jit
def _first_tile(tickets_ptr, static_tiles, STATIC_PCT: tl.constexpr):
    if STATIC_PCT == 0:
        return tl.atomic_add(tickets_ptr, 1, sem="relaxed", scope="gpu")
    return tl.program_id(0)


@triton.jit
def _next_tile(tile, tickets_ptr, static_tiles, STATIC_PCT: tl.constexpr):
    """Tiles below ``static_tiles`` (a multiple of the grid) go round-robin; the rest from the counter."""
    if STATIC_PCT == 100:
        return tile + tl.num_programs(0)
    if STATIC_PCT == 0:
        return tl.atomic_add(tickets_ptr, 1, sem="relaxed", scope="gpu")
    nxt = tile + tl.num_programs(0)
    if nxt >= static_tiles:
        nxt = static_tiles + tl.atomic_add(tickets_ptr, 1, sem="relaxed", scope="gpu")
    return nxt


@triton.jit
def _static_tiles(n, ROWS: tl.constexpr, STATIC_PCT: tl.constexpr):
    tiles = tl.cdiv(n, ROWS)
    return tiles * STATIC_PCT // 100 // tl.num_programs(0) * tl.num_programs(0)


@triton.jit
def _release_tickets(tickets_ptr, STATIC_PCT: tl.constexpr):
    if STATIC_PCT < 100:  # the last program out zeroes the counters: every program took its last ticket before
        done = tl.atomic_add(tickets_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:
            tl.atomic_xchg(tickets_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(tickets_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _now(TRACE: tl.constexpr):
    if TRACE:
        return globaltimer()
    return tl.full((), 0, tl.int64)


@triton.jit
def _trace(trace_ptr, start, tiles, TRACE: tl.constexpr):
    if TRACE:  # per program: start, end (globaltimer ns), SM id, tiles moved
        row = trace_ptr + tl.program_id(0) * 4
        tl.store(row, start)
        tl.store(row + 1, globaltimer())
        tl.store(row + 2, smid().to(tl.int64))
        tl.store(row + 3, tiles.to(tl.int64))


@triton.jit
def _pull_ab(num_rows_ptr, src_peer_ptrs, src_anchor_ptr, stride_src, src_rank_ptr, src_index_ptr, dst_ptr,
             stride_dst, tickets_ptr, trace_ptr, TOP_K: tl.constexpr, CHUNKS: tl.constexpr, CP: tl.constexpr,
             W: tl.constexpr, ROWS: tl.constexpr, ALIGN: tl.constexpr, STATIC_PCT: tl.constexpr, TRACE: tl.constexpr):
    start = _now(TRACE)
    done = 0
    n = tl.load(num_rows_ptr)
    static_tiles = _static_tiles(n, ROWS, STATIC_PCT)
    tile = _first_tile(tickets_ptr, static_tiles, STATIC_PCT)
    while tile * ROWS < n:
        t, cols, rank, index, valid, mask = tile_entries(tile * ROWS, n, src_rank_ptr, src_index_ptr, ROWS, CHUNKS,
                                                         CP, W)
        src_off = peer_offset(rank, index // TOP_K, valid, src_peer_ptrs, src_anchor_ptr, stride_src)
        x = tl.load(src_anchor_ptr + vector_offsets(src_off, cols, ALIGN, W), mask=mask)
        tile = _next_tile(tile, tickets_ptr, static_tiles, STATIC_PCT)  # taken while the loads are in flight
        tl.store(dst_ptr + vector_offsets(t.to(tl.int64) * stride_dst, cols, ALIGN, W), x, mask=mask)
        done += 1
    _release_tickets(tickets_ptr, STATIC_PCT)
    _trace(trace_ptr, start, done, TRACE)


@triton.jit
def _push_ab(num_rows_ptr, src_ptr, stride_src, src_row_ptr, dst_rank_ptr, dst_row_ptr, dst_peer_ptrs, dst_anchor_ptr,
             stride_dst, tickets_ptr, trace_ptr, SRC_ROW_DIV: tl.constexpr, CHUNKS: tl.constexpr,
             CP: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr, ALIGN: tl.constexpr, STATIC_PCT: tl.constexpr,
             TRACE: tl.constexpr):
    """SRC_ROW_DIV 0: source row t (combine); else ``src_row[t] // SRC_ROW_DIV`` (push dispatch)."""
    start = _now(TRACE)
    done = 0
    n = tl.load(num_rows_ptr)
    static_tiles = _static_tiles(n, ROWS, STATIC_PCT)
    tile = _first_tile(tickets_ptr, static_tiles, STATIC_PCT)
    while tile * ROWS < n:
        t, cols, rank, row, valid, mask = tile_entries(tile * ROWS, n, dst_rank_ptr, dst_row_ptr, ROWS, CHUNKS, CP, W)
        if SRC_ROW_DIV == 0:
            s = t.to(tl.int64)
        else:
            s = (tl.load(src_row_ptr + t, mask=valid, other=0) // SRC_ROW_DIV).to(tl.int64)
        x = tl.load(src_ptr + vector_offsets(s * stride_src, cols, ALIGN, W), mask=mask)
        tile = _next_tile(tile, tickets_ptr, static_tiles, STATIC_PCT)
        dst_off = peer_offset(rank, row, valid, dst_peer_ptrs, dst_anchor_ptr, stride_dst)
        tl.store(dst_anchor_ptr + vector_offsets(dst_off, cols, ALIGN, W), x, mask=mask)
        done += 1
    _release_tickets(tickets_ptr, STATIC_PCT)
    _trace(trace_ptr, start, done, TRACE)


#: grids whose per-program spans ``--trace`` records
TRACE_SMS = (16, 20, 24)
#: % of the tiles handed out round-robin before the rest go by counter (100: the library's order).
STATIC_PCTS = (100, 90, 75, 50, 0)


def run(world, opts: dict):
    b = comm_bench.Bench(world, opts)
    p = b.setup("uniform")
    ws, sched, push, me = b.ws, p["sched"], p["push"], world.rank
    D, k, dev = b.D, b.k, b.dev
    tickets = torch.zeros(2, dtype=torch.int32, device=dev)
    out = torch.empty(sched.capacity, D, dtype=torch.bfloat16, device=dev)
    y = comm_bench.rows_for(me, sched.capacity, D, 2, dev)
    x, routed, combine = ws.local("x"), ws.local("routed"), ws.local("combine")
    tuning = CommTuning(opts["tile_rows"], opts["num_warps"])
    chunks, cp, w, rows, align = _tile(D, 2, tuning)
    consts = dict(CHUNKS=chunks, CP=cp, W=w, ROWS=rows, ALIGN=align, num_warps=tuning.num_warps)
    ref = comm.dispatch_reference(p["xs"], sched)
    valid = p["valid"]
    results, exact = [], True
    # push dispatch moves the same cross rows (the receivers' pull schedules, seen from the sender)
    trace = torch.zeros(max(opts["sms"] + TRACE_SMS), 4, dtype=torch.int64, device=dev)
    kinds = {
        "pull dispatch": lambda sms, pct, tr=False: _pull_ab[(sms,)](
            sched.num_rows, ws.peer_ptrs("x"), x, x.stride(0), sched.src_rank, sched.src_index, out, out.stride(0),
            tickets, trace, TOP_K=k, STATIC_PCT=pct, TRACE=tr, **consts),
        "push combine": lambda sms, pct, tr=False: _push_ab[(sms,)](
            sched.num_rows, y, y.stride(0), sched.src_index, sched.src_rank, sched.src_index, ws.peer_ptrs("combine"),
            combine, combine.stride(0), tickets, trace, SRC_ROW_DIV=0, STATIC_PCT=pct, TRACE=tr, **consts),
        "push dispatch": lambda sms, pct, tr=False: _push_ab[(sms,)](
            push.num_entries, x, x.stride(0), push.route, push.dst_rank, push.dst_row, ws.peer_ptrs("routed"),
            routed, routed.stride(0), tickets, trace, SRC_ROW_DIV=k, STATIC_PCT=pct, TRACE=tr, **consts),
    }
    traces = []
    if b.cuda and opts["trace"]:  # per-program spans of one launch (after two untraced), rank 0's view
        for kind in ("push combine", "pull dispatch"):
            for sms in TRACE_SMS:
                for pct in (100, 0):
                    for _ in range(2):
                        comm.device_barrier(ws)
                        kinds[kind](sms, pct)
                    trace.zero_()
                    comm.device_barrier(ws)
                    kinds[kind](sms, pct, True)
                    torch.cuda.synchronize()
                    t = trace[:sms].cpu()
                    t0 = int(t[:, 0].min())
                    traces.append(dict(kind=kind, num_sms=sms, static_pct=pct,
                                       start_us=[(int(v) - t0) / 1e3 for v in t[:, 0]],
                                       end_us=[(int(v) - t0) / 1e3 for v in t[:, 1]],
                                       sm=[int(v) for v in t[:, 2]], tiles=[int(v) for v in t[:, 3]]))
    for kind, launch_kind in kinds.items():
        for sms in opts["sms"]:
            for pct in STATIC_PCTS:
                fn = lambda: launch_kind(sms, pct)
                if kind == "pull dispatch" and sms == opts["sms"][0]:
                    out.fill_(float("nan"))
                    comm.device_barrier(ws)
                    fn()
                    if b.cuda:
                        torch.cuda.synchronize()
                    exact &= comm_bench.same(out[valid], ref[valid])
                stats = b.timeit(fn)
                results.append(dict(kind=kind, num_sms=sms, static_pct=pct,
                                    **b.rates(p["cross"], p["total"], stats)))
    other = (me + 1) % b.R
    local = torch.empty_like(combine)
    nbytes = local.numel() * 2
    for name, fn in (("peer copy_ pull", lambda: local.copy_(ws.peer("combine", other))),
                     ("peer copy_ push", lambda: ws.peer("d_x", other).copy_(local))):
        stats = b.timeit(fn, iters=max(5, b.iters // 2))
        results.append(dict(kind="ceiling", variant=name, **b.rates([nbytes] * b.R, [nbytes] * b.R, stats)))
    exact = b.agree(exact)
    ws.free()
    return dict(meta=b.meta, exact=exact, results=results, traces=traces) if me == 0 else None


def table(res: dict) -> str:
    meta, rows = res["meta"], res["results"]
    ceil = {r["variant"]: r["cross_GBps"] for r in rows if r["kind"] == "ceiling"}
    sms = sorted({r["num_sms"] for r in rows if "num_sms" in r})
    lines = [f"# comm_order_ab: {meta['machine']} x{meta['ranks']}, {meta['preset']}, {meta['tokens']} tokens/rank, "
             f"commit {meta['commit']}, {meta['date']}", f"command: `{meta['command']}`", "",
             "ceilings: " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in ceil.items()),
             f"every variant's pull bit-equal to the reference: {res['exact']}", "",
             "cross GB/s (% of the pull / push copy_ ceiling); static % = tiles handed out round-robin, the rest "
             "by counter", "", "| kind | static % | " + " | ".join(f"{s} SMs" for s in sms) + " |",
             "|---|---|" + "---|" * len(sms)]
    for kind in ("pull dispatch", "push dispatch", "push combine"):
        c = ceil.get("peer copy_ pull" if kind.startswith("pull") else "peer copy_ push")
        for pct in STATIC_PCTS:
            cells = []
            for s in sms:
                g = [r["cross_GBps"] for r in rows if r["kind"] == kind and r["static_pct"] == pct
                     and r["num_sms"] == s]
                cells.append(f"{g[0]:.0f} ({100 * g[0] / c:.0f}%)" if g and c else "-")
            lines.append(f"| {kind} | {pct} | " + " | ".join(cells) + " |")
    if res.get("traces"):
        lines += ["", "per-program spans of one launch (rank 0): µs from the first start; SMs of the 3 last to end",
                  "", "| kind | SMs | static % | last end | ends: min / median | tiles min-max | last 3 (SM: end) |",
                  "|---|---|---|---|---|---|---|"]
        for tr in res["traces"]:
            ends = sorted(tr["end_us"])
            last = sorted(range(len(ends)), key=lambda i: -tr["end_us"][i])[:3]
            lines.append(f"| {tr['kind']} | {tr['num_sms']} | {tr['static_pct']} | {ends[-1]:.0f} | {ends[0]:.0f} / "
                         f"{ends[len(ends) // 2]:.0f} | {min(tr['tiles'])}-{max(tr['tiles'])} | "
                         + ", ".join(f"{tr['sm'][i]}: {tr['end_us'][i]:.0f}" for i in last) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", ""))
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sms", type=lambda v: tuple(int(s) for s in v.split(",")), default=(16, 20, 22, 24))
    parser.add_argument("--tile-rows", type=int, default=8)
    parser.add_argument("--num-warps", type=int, default=8)
    parser.add_argument("--trace", action="store_true", help="also record per-program spans (start, end, SM)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run (--preset tiny)")
    args = parser.parse_args()
    os.environ.setdefault("MEGAMOE_DIST_TIMEOUT_S", "180")
    commit = os.environ.get("MEGAMOE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    opts = dict(vars(args), commit=commit, date=datetime.date.today().isoformat(),
                command="PYTHONPATH=src python3 " + " ".join(sys.argv), ranks=2)
    started = time.time()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    res = launch(run, 2, opts, device=args.device)[0]
    text = table(res)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "order-ab.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(args.out, "order-ab.md"), "w") as f:
            f.write(text + "\n")
    print(f"finished in {time.time() - started:.0f} s\n")
    print(text)


if __name__ == "__main__":
    main()
