"""Where the last points of NVLink copy rate go: tile order, cache hints and row order, pull and push.

    PYTHONPATH=src python3 benchmarks/comm_order_ab.py --out OUT [--sms 16,20,24]

On 2 GPUs (kimi-k2 rows, 8192 tokens per rank, uniform routing: comm_bench's problem), each variant
times one copy kernel between CUDA events (comm_bench's timing: sleep, device barrier, kernel; median
of the slowest rank) and reports cross GB/s. The variant kernels are experiments kept here, beside the
library's `_pull_kernel` / `_push_kernel` (timed first, as the reference):

- order: ``static`` (program p takes tiles p, p + P, ...: the library's) or ``dynamic`` (each program
  takes the next tile from a counter, so a program held up by slower rows takes fewer; the last
  program to finish zeroes the counter for the next launch);
- load / store cache hints (``.cg``: L2 only; ``evict_first``; ``.cs`` streaming stores);
- ``remote-only``: local rows skipped (a diagnostic: what the local rows cost the link);
- row order: the schedule's (by expert: peer rows at random), by source (a token's ~4 reads of the
  same peer row back to back), or sequential (distinct peer rows in address order).

Bytes are the same in every variant (a permutation of the same rows); only the order differs. Not a
correctness test (comm_bench and the tests check the library's kernels); the variants' pulls are
compared with the library's on the first launch nonetheless.
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
from megamoe.world import launch

import comm_bench  # benchmarks/, beside this script


@triton.jit
def _next_tile(tile, tickets_ptr, DYNAMIC: tl.constexpr):
    if DYNAMIC:
        return tl.atomic_add(tickets_ptr, 1, sem="relaxed", scope="gpu")
    return tile + tl.num_programs(0)


@triton.jit
def _first_tile(tickets_ptr, DYNAMIC: tl.constexpr):
    if DYNAMIC:
        return tl.atomic_add(tickets_ptr, 1, sem="relaxed", scope="gpu")
    return tl.program_id(0)


@triton.jit
def _release_tickets(tickets_ptr, DYNAMIC: tl.constexpr):
    if DYNAMIC:  # the last program out zeroes the counters: every program took its last ticket before
        done = tl.atomic_add(tickets_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:
            tl.atomic_xchg(tickets_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(tickets_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _pull_ab(num_rows_ptr, src_peer_ptrs, src_anchor_ptr, stride_src, src_rank_ptr, src_index_ptr, dst_ptr,
             stride_dst, tickets_ptr, my_rank, TOP_K: tl.constexpr, CHUNKS: tl.constexpr, CP: tl.constexpr,
             W: tl.constexpr, ROWS: tl.constexpr, ALIGN: tl.constexpr, DYNAMIC: tl.constexpr, LOAD_CM: tl.constexpr,
             EVICT: tl.constexpr, STORE_CM: tl.constexpr, REMOTE_ONLY: tl.constexpr):
    n = tl.load(num_rows_ptr)
    tile = _first_tile(tickets_ptr, DYNAMIC)
    while tile * ROWS < n:
        t, cols, rank, index, valid, mask = tile_entries(tile * ROWS, n, src_rank_ptr, src_index_ptr, ROWS, CHUNKS,
                                                         CP, W)
        if REMOTE_ONLY:
            valid = valid & (rank != my_rank)
            mask = mask & valid[:, None, None]
        src_off = peer_offset(rank, index // TOP_K, valid, src_peer_ptrs, src_anchor_ptr, stride_src)
        x = tl.load(src_anchor_ptr + vector_offsets(src_off, cols, ALIGN, W), mask=mask, cache_modifier=LOAD_CM,
                    eviction_policy=EVICT)
        tile = _next_tile(tile, tickets_ptr, DYNAMIC)  # taken while the loads are in flight
        tl.store(dst_ptr + vector_offsets(t.to(tl.int64) * stride_dst, cols, ALIGN, W), x, mask=mask,
                 cache_modifier=STORE_CM)
    _release_tickets(tickets_ptr, DYNAMIC)


@triton.jit
def _push_ab(num_rows_ptr, src_ptr, stride_src, dst_rank_ptr, dst_row_ptr, dst_peer_ptrs, dst_anchor_ptr, stride_dst,
             tickets_ptr, CHUNKS: tl.constexpr, CP: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr,
             ALIGN: tl.constexpr, DYNAMIC: tl.constexpr, STORE_CM: tl.constexpr):
    n = tl.load(num_rows_ptr)
    tile = _first_tile(tickets_ptr, DYNAMIC)
    while tile * ROWS < n:
        t, cols, rank, row, valid, mask = tile_entries(tile * ROWS, n, dst_rank_ptr, dst_row_ptr, ROWS, CHUNKS, CP, W)
        x = tl.load(src_ptr + vector_offsets(t.to(tl.int64) * stride_src, cols, ALIGN, W), mask=mask)
        tile = _next_tile(tile, tickets_ptr, DYNAMIC)
        dst_off = peer_offset(rank, row, valid, dst_peer_ptrs, dst_anchor_ptr, stride_dst)
        tl.store(dst_anchor_ptr + vector_offsets(dst_off, cols, ALIGN, W), x, mask=mask, cache_modifier=STORE_CM)
    _release_tickets(tickets_ptr, DYNAMIC)


PULLS = {  # name: (DYNAMIC, LOAD_CM, EVICT, STORE_CM, REMOTE_ONLY)
    "static": (False, "", "", "", False),
    "dynamic": (True, "", "", "", False),
    "static .cg": (False, ".cg", "", "", False),
    "static evict_first": (False, "", "evict_first", "", False),
    "static .cs stores": (False, "", "", ".cs", False),
    "dynamic .cg": (True, ".cg", "", "", False),
    "static remote-only": (False, "", "", "", True),
}
PUSHES = {"static": (False, ""), "dynamic": (True, ""), "static .cs": (False, ".cs"), "static .cg": (False, ".cg"),
          "dynamic .cs": (True, ".cs")}


def orders(rank: torch.Tensor, index: torch.Tensor, n_tokens: int, k: int) -> dict:
    """The schedule's (rank, index) arrays in three row orders (same rows, permuted)."""
    valid = rank >= 0
    key = torch.where(valid, rank.long() * (1 << 40) + index.long(), torch.full_like(rank, 1 << 62, dtype=torch.long))
    perm = torch.argsort(key, stable=True)
    by_src = (rank[perm].contiguous(), index[perm].contiguous())
    # sequential: distinct rows of each peer in address order (token i mod N), same rows per rank
    r_sorted = by_src[0]
    pos = torch.arange(r_sorted.numel(), device=rank.device)
    first = torch.zeros_like(pos)
    starts = torch.ones_like(r_sorted, dtype=torch.bool)
    starts[1:] = r_sorted[1:] != r_sorted[:-1]
    first = torch.cummax(torch.where(starts, pos, torch.zeros_like(pos)), 0).values
    seq_index = torch.where(r_sorted >= 0, ((pos - first) % n_tokens) * k, by_src[1].long()).to(index.dtype)
    return {"schedule": (rank, index), "by source": by_src, "sequential": (r_sorted, seq_index.contiguous())}


def run(world, opts: dict):
    b = comm_bench.Bench(world, opts)
    p = b.setup("uniform")
    ws, sched, me = b.ws, p["sched"], world.rank
    D, k = b.D, b.k
    dev = b.dev
    tickets = torch.zeros(2, dtype=torch.int32, device=dev)
    out = torch.empty(sched.capacity, D, dtype=torch.bfloat16, device=dev)
    y = comm_bench.rows_for(me, sched.capacity, D, 2, dev)
    src = ws.local("x")
    results = []
    tuning = CommTuning(opts["tile_rows"], opts["num_warps"])
    chunks, cp, w, rows, align = _tile(D, 2, tuning)
    consts = dict(CHUNKS=chunks, CP=cp, W=w, ROWS=rows, ALIGN=align, num_warps=tuning.num_warps)
    ref = comm.dispatch_reference(p["xs"], sched)
    valid = p["valid"]
    exact = True
    for order, (rank, index) in orders(sched.src_rank, sched.src_index, b.N, k).items():
        for sms in opts["sms"]:
            variants = {"library": lambda: comm.dispatch_pull(ws, sched, num_sms=sms, out=out, sync=False,
                                                               tuning=tuning)} if order == "schedule" else {}
            for name, (dyn, lcm, ev, scm, remote) in PULLS.items():
                variants[name] = (lambda dyn=dyn, lcm=lcm, ev=ev, scm=scm, remote=remote: _pull_ab[(sms,)](
                    sched.num_rows, ws.peer_ptrs("x"), src, src.stride(0), rank, index, out, out.stride(0), tickets,
                    me, TOP_K=k, DYNAMIC=dyn, LOAD_CM=lcm, EVICT=ev, STORE_CM=scm, REMOTE_ONLY=remote, **consts))
            for name, fn in variants.items():
                if order == "schedule" and sms == opts["sms"][0] and "remote" not in name:
                    out.fill_(float("nan"))
                    comm.device_barrier(ws)
                    fn()
                    if b.cuda:
                        torch.cuda.synchronize()
                    exact &= comm_bench.same(out[valid], ref[valid])
                stats = b.timeit(fn)
                results.append(dict(kind="pull", order=order, num_sms=sms, variant=name,
                                    **b.rates(p["cross"], p["total"], stats)))
        for sms in opts["sms"]:
            variants = {"library": lambda: comm.combine_push(ws, sched, y, num_sms=sms, sync=False, tuning=tuning)} \
                if order == "schedule" else {}
            for name, (dyn, scm) in PUSHES.items():
                variants[name] = (lambda dyn=dyn, scm=scm: _push_ab[(sms,)](
                    sched.num_rows, y, y.stride(0), rank, index, ws.peer_ptrs("combine"), ws.local("combine"),
                    ws.local("combine").stride(0), tickets, DYNAMIC=dyn, STORE_CM=scm, **consts))
            for name, fn in variants.items():
                stats = b.timeit(fn)
                results.append(dict(kind="push", order=order, num_sms=sms, variant=name,
                                    **b.rates(p["cross"], p["total"], stats)))
    # the ceilings of comm_bench, in the same run
    other = (me + 1) % b.R
    local = torch.empty_like(ws.local("combine"))
    nbytes = local.numel() * 2
    for name, fn in (("peer copy_ pull", lambda: local.copy_(ws.peer("combine", other))),
                     ("peer copy_ push", lambda: ws.peer("d_x", other).copy_(local))):
        stats = b.timeit(fn, iters=max(5, b.iters // 2))
        results.append(dict(kind="ceiling", variant=name, **b.rates([nbytes] * b.R, [nbytes] * b.R, stats)))
    exact = b.agree(exact)
    ws.free()
    return dict(meta=b.meta, exact=exact, results=results) if me == 0 else None


def table(res: dict) -> str:
    meta, rows = res["meta"], res["results"]
    ceil = {r["variant"]: r["cross_GBps"] for r in rows if r["kind"] == "ceiling"}
    sms = sorted({r["num_sms"] for r in rows if "num_sms" in r})
    lines = [f"# comm_order_ab: {meta['machine']} x{meta['ranks']}, {meta['preset']}, {meta['tokens']} tokens/rank, "
             f"commit {meta['commit']}, {meta['date']}", f"command: `{meta['command']}`", "",
             "ceilings: " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in ceil.items()),
             f"variant pulls bit-equal to the library's (schedule order): {res['exact']}", ""]
    for kind, c in (("pull", ceil.get("peer copy_ pull")), ("push", ceil.get("peer copy_ push"))):
        lines += [f"{kind}: cross GB/s (% of the {kind} copy_ ceiling)", "",
                  "| order | variant | " + " | ".join(f"{s} SMs" for s in sms) + " |", "|---|---|" + "---|" * len(sms)]
        seen = []
        for r in rows:
            if r["kind"] == kind and (r["order"], r["variant"]) not in seen:
                seen.append((r["order"], r["variant"]))
        for order, variant in seen:
            cells = []
            for s in sms:
                g = [r["cross_GBps"] for r in rows if r["kind"] == kind and r["order"] == order
                     and r["variant"] == variant and r["num_sms"] == s]
                cells.append(f"{g[0]:.0f} ({100 * g[0] / c:.0f}%)" if g and c else "-")
            lines.append(f"| {order} | {variant} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", ""))
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sms", type=lambda v: tuple(int(s) for s in v.split(",")), default=(16, 20, 24))
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
