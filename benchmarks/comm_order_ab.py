"""How the copy kernels hand out tiles and where their programs run, on 2 GPUs.

    PYTHONPATH=src python3 benchmarks/comm_order_ab.py --out OUT [--sms 16,20,22,24]

kimi-k2 rows, 8192 tokens per rank, uniform routing (comm_bench's problem); each variant is timed as
comm_bench times a kernel (sleep, device barrier, kernel between CUDA events; median of the slowest
rank) and reported as cross GB/s against the peer ``copy_`` ceilings of the same run.

1. Hand-out. The library's kernels give tile p, p + P, ... to program p of P. A program on an SM
   that gets less of the NVLink bandwidth (a trace of this script at 115d15327f6e: the programs on
   SMs 124-131, where the first 8 programs of a launch land, pushed at ~60 % of the others' rate
   from 18 SMs on) still gets its full share and the others wait. ``guided``: programs claim
   ``max(1, left / 2P)`` tiles at a time from a counter, so a slower program claims fewer (about
   2P ln(tiles / 2P) + 2P claims in all; the last program out zeroes the counter for the next launch).
   Kinds: pull dispatch, push dispatch (the senders' push schedule), push combine.
2. Placement (pull dispatch, push combine): 8 or 16 round-robin workers on chosen SMs (the first
   program to start on a chosen SM takes its role, the others exit), against the first programs of a
   launch; a traced launch checks that every tile moved and records the SMs that worked.

Earlier studies with this script (commits 32da1d822042: cache hints and row orders; a15fd51650b5:
round-robin then counter; 115d15327f6e: per-program spans) are recorded in
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

from megamoe.ops import comm
from megamoe.ops.comm import CommTuning, copy_tile
from megamoe.routing.schedule import build_pull_schedule
from megamoe.kernels.comm import claim_tiles, pull_tile, push_tile
from triton.language.extra.cuda import globaltimer, smid
from megamoe.parallel.world import launch

import comm_bench  # benchmarks/, beside this script


@triton.jit
def _now(TRACE: tl.constexpr):
    if TRACE:
        return globaltimer()
    return tl.full((), 0, tl.int64)


@triton.jit
def _worker(tickets_ptr, roles_ptr, num_workers, PLACED: tl.constexpr):
    """(worker index or -1, workers). PLACED: the first program on SM s is worker ``roles[s]`` (-1: none)."""
    if PLACED:
        s = smid()
        first = tl.atomic_cas(tickets_ptr + FLAGS + s, 0, 1, sem="relaxed", scope="gpu")
        role = tl.load(roles_ptr + s)
        return tl.where(first == 0, role, -1), num_workers
    return tl.program_id(0), tl.num_programs(0)


@triton.jit
def _release(tickets_ptr, NSM: tl.constexpr, GUIDED: tl.constexpr, PLACED: tl.constexpr):
    if GUIDED or PLACED:  # the last program out zeroes the counters for the next launch
        out = tl.atomic_add(tickets_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if out == tl.num_programs(0) - 1:
            tl.store(tickets_ptr + tl.arange(0, NSM), tl.zeros([NSM], tl.int32))


@triton.jit
def _trace(trace_ptr, start, tiles, TRACE: tl.constexpr):
    if TRACE:  # per program: start, end (globaltimer ns), SM id, tiles moved
        row = trace_ptr + tl.program_id(0) * 4
        tl.store(row, start)
        tl.store(row + 1, globaltimer())
        tl.store(row + 2, smid().to(tl.int64))
        tl.store(row + 3, tiles.to(tl.int64))


@triton.jit
def _copy_ab(num_rows_ptr, src_peer_ptrs, src_ptr, stride_src, src_row_ptr, rank_ptr, index_ptr, dst_peer_ptrs,
             dst_ptr, stride_dst, tickets_ptr, roles_ptr, num_workers, trace_ptr, PULL: tl.constexpr,
             TOP_K: tl.constexpr, SRC_ROW_DIV: tl.constexpr, IDENTITY_SRC: tl.constexpr, CHUNKS: tl.constexpr,
             CP: tl.constexpr, W: tl.constexpr,
             ROWS: tl.constexpr, ALIGN: tl.constexpr, GUIDED: tl.constexpr, PLACED: tl.constexpr,
             NSM: tl.constexpr, TRACE: tl.constexpr):
    """PULL: ``dst[t] = src_{rank[t]}[index[t] // TOP_K]``; else ``dst_{rank[t]}[index[t]] = src[...]`` (push)."""
    start = _now(TRACE)
    n = tl.load(num_rows_ptr)
    tiles = tl.cdiv(n, ROWS)
    c, workers = _worker(tickets_ptr, roles_ptr, num_workers, PLACED)
    done = 0
    if c >= 0:
        lo, hi, step = c, tiles, workers
        if GUIDED:
            lo, hi = claim_tiles(tickets_ptr, tiles, workers)
            step = 1
        while lo < tiles:
            for tile in range(lo, hi, step):
                if PULL:
                    pull_tile(tile * ROWS, n, src_peer_ptrs, src_ptr, stride_src, rank_ptr, index_ptr, dst_ptr,
                              stride_dst, dst_ptr, stride_dst, TOP_K, CHUNKS, CP, W, ROWS, ALIGN, 0, False)
                else:
                    push_tile(tile * ROWS, n, src_ptr, stride_src, src_row_ptr, rank_ptr, index_ptr, dst_peer_ptrs,
                              dst_ptr, stride_dst, -1, SRC_ROW_DIV, IDENTITY_SRC, CHUNKS, CP, W, ROWS, ALIGN)
                done += 1
            if GUIDED:
                lo, hi = claim_tiles(tickets_ptr, tiles, workers)
            else:
                lo = tiles
    _release(tickets_ptr, NSM, GUIDED, PLACED)
    _trace(trace_ptr, start, done, TRACE)


#: tickets layout: [0] the guided counter, [1] programs out, [FLAGS + s] SM s taken (PLACED)
FLAGS = tl.constexpr(2)
#: (name, SMs) of the placement runs: 8 or 16 workers on chosen SMs (the first program on each)
PLACEMENTS = (("programs 0-7 (launch order)", None), ("SMs 0-7", tuple(range(8))),
              ("SMs 0-14 even", tuple(range(0, 16, 2))), ("SMs 0, 16, .., 112", tuple(range(0, 128, 16))), ("SMs 124-131", tuple(range(124, 132))),
              ("programs 0-15 (launch order)", None), ("SMs 0, 8, .., 120", tuple(range(0, 128, 8))),
              ("SMs 0-15", tuple(range(16))))


def run(world, opts: dict):
    b = comm_bench.Bench(world, opts)
    p = b.setup("uniform")
    ws, sched, push, me = b.ws, p["sched"], p["push"], world.rank
    D, k, dev = b.D, b.k, b.dev
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count if b.cuda else 4
    slots = 1 << (FLAGS.value + nsm - 1).bit_length()
    tickets = torch.zeros(slots, dtype=torch.int32, device=dev)
    grid_placed = 2 * nsm  # every SM gets a program (one fits per SM: registers); the rest exit
    trace = torch.zeros(max(grid_placed, *opts["sms"]), 4, dtype=torch.int64, device=dev)
    out = torch.empty(sched.capacity, D, dtype=torch.bfloat16, device=dev)
    y = comm_bench.rows_for(me, sched.capacity, D, 2, dev)
    x, routed, combine = ws.local("x"), ws.local("routed"), ws.local("combine")
    tuning = CommTuning(opts["tile_rows"], opts["num_warps"])
    chunks, cp, w, rows, align = copy_tile(D, 2, tuning)
    consts = dict(CHUNKS=chunks, CP=cp, W=w, ROWS=rows, ALIGN=align, NSM=slots, num_warps=tuning.num_warps)
    args = {  # (num_rows, src_peer_ptrs, src, src_row, rank, index, dst_peer_ptrs, dst, PULL, SRC_ROW_DIV)
        "pull dispatch": (sched.num_rows, ws.peer_ptrs("x"), x, sched.src_index, sched.src_rank, sched.src_index,
                          ws.peer_ptrs("x"), out, True, 0),
        "push dispatch": (push.num_entries, ws.peer_ptrs("x"), x, push.route, push.dst_rank, push.dst_row,
                          ws.peer_ptrs("routed"), routed, False, k),
        "push combine": (sched.num_rows, ws.peer_ptrs("x"), y, sched.src_index, sched.src_rank, sched.src_index,
                         ws.peer_ptrs("combine"), combine, False, 0),
    }

    def launcher(kind, grid, guided=False, roles=None, workers=0, traced=False):
        num_rows, src_peers, src, src_row, rank, index, dst_peers, dst, pull, div = args[kind]
        placed = roles is not None
        return lambda: _copy_ab[(grid,)](
            num_rows, src_peers, src, src.stride(0), src_row, rank, index, dst_peers, dst, dst.stride(0), tickets,
            roles if placed else tickets, workers, trace, PULL=pull, TOP_K=k, SRC_ROW_DIV=max(div, 1),
            IDENTITY_SRC=div == 0, GUIDED=guided,
            PLACED=placed, TRACE=traced, **consts)

    ref = comm.dispatch_reference(p["xs"], sched)
    valid = p["valid"]
    results, checks = [], {}
    tiles_total = {kind: -(-int(a[0]) // rows) for kind, a in args.items()}

    def traced_run(kind, grid, **kw):
        """One traced launch: the SMs that worked and whether every tile was moved exactly once in all."""
        trace.zero_()
        comm.device_barrier(ws)
        launcher(kind, grid, traced=True, **kw)()
        if b.cuda:
            torch.cuda.synchronize()
        t = trace[:grid].cpu()
        worked = t[:, 3] > 0
        return dict(sms=sorted(int(v) for v in t[worked, 2]), tiles=int(t[:, 3].sum()),
                    complete=int(t[:, 3].sum()) == tiles_total[kind])

    top_all = torch.full((b.R, b.N, k), -1, dtype=torch.int32, device=dev)
    for r, t in enumerate(p["tops"]):
        top_all[r] = t
    scheds = [build_pull_schedule(top_all, r, b.L) for r in range(b.R)]
    ys = [comm_bench.rows_for(r, sc.capacity, D, 2, dev) for r, sc in enumerate(scheds)]
    combined = comm.combine_reference(ys, scheds, me, torch.full_like(combine, float("nan")))
    del ys

    def check(name, kind, fn):
        """Every rank launches ``fn`` once into a NaN-filled destination; compare with the reference."""
        dst = {"pull dispatch": out, "push dispatch": routed, "push combine": combine}[kind]
        dst.fill_(float("nan"))
        comm.device_barrier(ws)
        fn()
        comm.device_barrier(ws)
        if kind == "push combine":
            checks[f"{kind} {name}"] = comm_bench.same(combine, combined)
        else:
            checks[f"{kind} {name}"] = comm_bench.same(dst[valid], ref[valid])

    # 1. hand-out: round-robin (the library's) against guided claims from a counter
    for kind in args:
        for sms in opts["sms"]:
            variants = {"round-robin": launcher(kind, sms), "guided": launcher(kind, sms, guided=True)}
            if kind == "pull dispatch":
                variants["library"] = lambda: comm.dispatch_pull(ws, sched, num_sms=sms, out=out, sync=False,
                                                                 tuning=tuning)
            if kind == "push combine":
                variants["library"] = lambda: comm.combine_push(ws, sched, y, num_sms=sms, sync=False,
                                                                tuning=tuning)
            for name, fn in variants.items():
                if sms in (opts["sms"][0], opts["sms"][-1]):
                    check(f"{name} {sms} SMs", kind, fn)
                stats = b.timeit(fn)
                results.append(dict(study="hand-out", kind=kind, num_sms=sms, variant=name,
                                    **b.rates(p["cross"], p["total"], stats)))
    # 2. placement: the same workers on chosen SMs
    if b.cuda:
        for kind in ("pull dispatch", "push combine"):
            for name, chosen in PLACEMENTS:
                if chosen is None:
                    workers = int(name.split("-")[1].split(" ")[0]) + 1
                    kw, grid = {}, workers
                else:
                    workers = len(chosen)
                    roles = torch.full((nsm,), -1, dtype=torch.int32, device=dev)
                    roles[list(chosen)] = torch.arange(workers, dtype=torch.int32, device=dev)
                    kw, grid = dict(roles=roles, workers=workers), grid_placed
                fn = launcher(kind, grid, **kw)
                check(f"placed {name}", kind, fn)
                stats = b.timeit(fn)
                results.append(dict(study="placement", kind=kind, placement=name, workers=workers,
                                    **traced_run(kind, grid, **kw), **b.rates(p["cross"], p["total"], stats)))
    other = (me + 1) % b.R
    local = torch.empty_like(combine)
    nbytes = local.numel() * 2
    for name, fn in (("peer copy_ pull", lambda: local.copy_(ws.peer("combine", other))),
                     ("peer copy_ push", lambda: ws.peer("combine", other).copy_(local))):
        stats = b.timeit(fn, iters=max(5, b.iters // 2))
        results.append(dict(study="ceiling", variant=name, **b.rates([nbytes] * b.R, [nbytes] * b.R, stats)))
    checks = {name: b.agree(ok) for name, ok in checks.items()}
    ws.free()
    return dict(meta=b.meta, checks=checks, results=results) if me == 0 else None


def table(res: dict) -> str:
    meta, rows = res["meta"], res["results"]
    ceil = {r["variant"]: r["cross_GBps"] for r in rows if r["study"] == "ceiling"}
    pct = lambda g, kind: g / ceil["peer copy_ pull" if kind.startswith("pull") else "peer copy_ push"] * 100 \
        if ceil else 0.0
    bad = [name for name, ok in res["checks"].items() if not ok]
    lines = [f"# comm_order_ab: {meta['machine']} x{meta['ranks']}, {meta['preset']}, {meta['tokens']} tokens/rank, "
             f"commit {meta['commit']}, {meta['date']}", f"command: `{meta['command']}`", "",
             "ceilings: " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in ceil.items()),
             f"bit-equal to the reference: {'all' if not bad else 'FAIL ' + ', '.join(bad)} "
             f"({len(res['checks'])} checked)", ""]
    hand = [r for r in rows if r["study"] == "hand-out"]
    sms = sorted({r["num_sms"] for r in hand})
    if hand:
        lines += ["1. tile hand-out: cross GB/s (% of the pull / push copy_ ceiling)", "",
                  "| kind | hand-out | " + " | ".join(f"{s} SMs" for s in sms) + " |", "|---|---|" + "---|" * len(sms)]
        for kind in ("pull dispatch", "push dispatch", "push combine"):
            for variant in ("library", "round-robin", "guided"):
                cells = [next((f"{r['cross_GBps']:.0f} ({pct(r['cross_GBps'], kind):.0f}%)" for r in hand
                               if r["kind"] == kind and r["variant"] == variant and r["num_sms"] == s), None)
                         for s in sms]
                if any(cells):
                    lines.append(f"| {kind} | {variant} | " + " | ".join(c or "-" for c in cells) + " |")
        lines.append("")
    placed = [r for r in rows if r["study"] == "placement"]
    if placed:
        lines += ["2. placement: the same round-robin workers on chosen SMs (cross GB/s, per worker)", "",
                  "| kind | workers on | GB/s | per worker | every tile moved | SMs that worked |", "|---|---|---|---|---|---|"]
        for r in placed:
            lines.append(f"| {r['kind']} | {r['placement']} | {r['cross_GBps']:.0f} | {r['cross_GBps'] / r['workers']:.1f} "
                         f"| {r['complete']} | {','.join(map(str, r['sms']))} |")
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
