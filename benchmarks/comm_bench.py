"""NVLink communication measurements of megamoe.ops.comm on 2 GPUs (the issue's three measurements).

Run on nvidia-h200-x2 (repo root; the script starts its own 2 ranks):

    PYTHONPATH=src python3 benchmarks/comm_bench.py --out OUT

What it does, in one launch, all on the same inputs (kimi-k2 rows: D 7168 bf16,
k 8, E 384, 8192 tokens per rank, seeded routing):

0. Checks: dispatch_pull, combine_push, reverse_combine_pull,
   reverse_dispatch_push, on-the-fly MXFP8 dispatch and push_dispatch (with
   flags) are bitwise equal to the torch references; peer ``copy_`` ceilings.
1. Bandwidth against num_sms (--sms, default 8 .. 32) for dispatch (pull) and combine (push)
   with three copy tiles; NCCL all_to_all_single moving the same cross-rank
   rows (contiguous, no gather) in the same run. (Pipelined tiles and
   programs reserved for the local rows lost in 2026-11-29-round2 and were
   removed from the kernels.)
2. Signalling: time from kernel start until the first M rows (M = 256 ..
   8192) of every rank's routed buffer are usable: pull (the receiver loads
   them) against push (senders store, raise a flag per peer; the receiver
   waits for every flag), plus push without flags (the stores alone).
3. Pull against push dispatch under expert imbalance: uniform, Zipf 1.2
   (a popularity shared by all ranks), every token to the next rank.
4. The timeout check: rank 1 never enters a device barrier; rank 0 must
   raise RuntimeError naming the flag.

Timing: per iteration a ~100 µs GPU sleep (so the host has queued what
follows), a device barrier (both GPUs start together), then the kernel between
CUDA events; median (p10, p90) of the slowest rank over the iterations, after
warm-up. cross GB/s = bytes whose source and destination ranks differ / time
(mean over ranks; ``busiest`` = the rank with most cross bytes); total GB/s
counts every row moved (local rows too).

Writes OUT/comm.json (one record per measurement) and OUT/comm.md, rewritten
after each section so that a failure keeps what was measured; prints a short
table last. ``--device cpu --preset tiny`` runs the same logic on CPU ranks
under the Triton interpreter (a smoke test; times mean nothing there).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist

from megamoe.ops import comm
from megamoe.reference import formats
from megamoe.ops.comm import CommShape, CommTuning
from megamoe.config import preset
from megamoe.routing.schedule import build_pull_schedule
from megamoe.parallel.world import launch

SMS = (8, 16, 24, 32)
#: Section 1's copy tiles (the last is the default).
BASE = (CommTuning(4, 4), CommTuning(16, 16), CommTuning(8, 8))
MINIBATCHES = (256, 1024, 4096, 8192)
SIGNAL_SMS = (24,)
IMBALANCE_SMS = (16, 24)
ROUTINGS = ("uniform", "zipf", "one-rank")
SLEEP_CYCLES = 200_000  # ~100 µs at 1.98 GHz
DEADLINE_S = 140.0  # sections start only before this (the whole run stays < 3 min)


# --------------------------------------------------------------------------- inputs


def route(kind: str, n: int, rank: int, R: int, E: int, k: int, seed: int, device) -> torch.Tensor:
    """int32 [n, k] distinct experts per token; the same on every process for (kind, rank, seed)."""
    g = torch.Generator(device=device).manual_seed(seed * 7919 + rank)
    if kind == "uniform":
        scores = torch.rand(n, E, generator=g, device=device)
    elif kind == "zipf":  # popularity 1/rank^1.2 over a permutation shared by every rank; Gumbel-top-k
        gp = torch.Generator(device=device).manual_seed(seed)
        popularity = torch.arange(1, E + 1, device=device, dtype=torch.float32).pow(-1.2)
        popularity = popularity[torch.randperm(E, generator=gp, device=device)]
        scores = torch.rand(n, E, generator=g, device=device).log() / popularity
    elif kind == "one-rank":  # every token to the experts of the next rank
        L = E // R
        scores = torch.rand(n, E, generator=g, device=device)
        target = (rank + 1) % R
        mask = torch.zeros(E, dtype=torch.bool, device=device)
        mask[target * L : (target + 1) * L] = True
        scores = torch.where(mask, scores, -1.0)
    else:
        raise ValueError(kind)
    return scores.topk(k, dim=1).indices.to(torch.int32)


def rows_for(rank: int, n: int, d: int, salt: int, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(1000 * salt + rank)
    return torch.randn(n, d, generator=g, device=device).to(torch.bfloat16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


# --------------------------------------------------------------------------- the run


class Bench:
    def __init__(self, world, opts: dict):
        self.world, self.opts = world, opts
        self.me, self.R, self.dev = world.rank, world.size, world.device
        self.cuda = world.is_cuda
        self.cfg = preset(opts["preset"])
        self.N, self.D, self.k, self.E = opts["tokens"], self.cfg.hidden, self.cfg.top_k, self.cfg.num_experts
        self.L = self.E // self.R
        self.iters, self.warmup = opts["iters"], opts["warmup"]
        self.records: list[dict] = []
        self.notes: list[str] = []
        self.t0 = time.time()
        self.meta = dict(
            machine=torch.cuda.get_device_name(self.dev) if self.cuda else "cpu (interpreter)",
            ranks=self.R, preset=opts["preset"], tokens=self.N, hidden=self.D, top_k=self.k, experts=self.E,
            commit=opts["commit"], date=opts["date"], command=opts["command"],
            torch=torch.__version__,
        )
        self.shape = CommShape(self.R, self.N, self.D, self.k, self.L, push_dispatch=True)
        self.ws = comm.comm_workspace(world, self.shape)

    # ---- helpers

    def agree(self, flag: bool) -> bool:
        """True on every rank iff true on every rank."""
        t = torch.tensor([0 if flag else 1], device=self.dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.world.group)
        return int(t.item()) == 0

    def time_left(self) -> bool:
        return self.agree(time.time() - self.t0 < DEADLINE_S)

    def timeit(self, fn, iters: int | None = None) -> dict:
        """Median / p10 / p90 ms of the slowest rank; every rank calls it in step."""
        iters = iters or self.iters
        times = []
        if self.cuda:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
            for i in range(self.warmup + iters):
                torch.cuda._sleep(SLEEP_CYCLES)
                comm.device_barrier(self.ws, check=False)
                if i >= self.warmup:
                    events[i - self.warmup][0].record()
                fn()
                if i >= self.warmup:
                    events[i - self.warmup][1].record()
            torch.cuda.synchronize()
            times = [a.elapsed_time(b) for a, b in events]
        else:
            for i in range(self.warmup + iters):
                comm.device_barrier(self.ws, check=False)
                start = time.perf_counter()
                fn()
                if i >= self.warmup:
                    times.append((time.perf_counter() - start) * 1e3)
        self.ws.check_errors()
        t = torch.tensor(times, dtype=torch.float64, device=self.dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.world.group)
        slowest = sorted(t.tolist())
        q = lambda p: slowest[min(len(slowest) - 1, int(p * len(slowest)))]
        return dict(ms=statistics.median(slowest), p10_ms=q(0.1), p90_ms=q(0.9))

    def gather_int(self, value: int) -> list[int]:
        t = torch.tensor([value], dtype=torch.int64, device=self.dev)
        out = [torch.zeros_like(t) for _ in range(self.R)]
        dist.all_gather(out, t, group=self.world.group)
        return [int(o.item()) for o in out]

    def record(self, **kw) -> None:
        rec = dict(self.meta)
        rec.update(kw)
        self.records.append(rec)

    def rates(self, cross_per_rank: list[int], total_per_rank: list[int], stats: dict) -> dict:
        s = stats["ms"] / 1e3
        return dict(
            cross_bytes_per_rank=cross_per_rank, total_bytes_per_rank=total_per_rank,
            cross_GBps=sum(cross_per_rank) / self.R / s / 1e9 if s else 0.0,
            busiest_GBps=max(cross_per_rank) / s / 1e9 if s else 0.0,
            total_GBps=sum(total_per_rank) / self.R / s / 1e9 if s else 0.0,
            **stats,
        )

    def flush(self) -> None:
        if self.me != 0 or not self.opts["out"]:
            return
        os.makedirs(self.opts["out"], exist_ok=True)
        with open(os.path.join(self.opts["out"], "comm.json"), "w") as f:
            json.dump(dict(meta=self.meta, notes=self.notes, records=self.records), f, indent=1)
        with open(os.path.join(self.opts["out"], "comm.md"), "w") as f:
            f.write(summary(self.meta, self.records, self.notes) + "\n")

    def section(self, name: str, fn) -> None:
        if not self.time_left():
            self.notes.append(f"{name}: skipped, past the {DEADLINE_S:.0f} s deadline")
            return
        start = time.time()
        ok = True
        try:
            fn()
        except Exception:  # keep the other sections; the failure is recorded
            ok = False
            self.notes.append(f"{name}: FAILED on rank {self.me}: {traceback.format_exc(limit=4)}")
            if self.me == 0:
                print(self.notes[-1], flush=True)
        if not self.agree(ok):  # later sections still run (a broken workspace makes them fail fast, bounded)
            self.notes.append(f"{name}: failed on some rank")
        if self.me == 0:
            print(f"[{time.time() - self.t0:6.1f} s] {name} done in {time.time() - start:.1f} s", flush=True)
        self.flush()

    # ---- problem setup per routing

    def setup(self, kind: str, seed: int = 1) -> dict:
        dev, N, D, k, E, R = self.dev, self.N, self.D, self.k, self.E, self.R
        xs = [rows_for(r, N, D, 1, dev) for r in range(R)]
        tops = [route(kind, N, r, R, E, k, seed, dev) for r in range(R)]
        self.ws.stage(x=xs[self.me])
        sched = self.ws.pull_schedule(tops[self.me])
        push = comm.build_push_schedule(self.ws, sched)
        valid = sched.src_rank >= 0
        cross = int(((sched.src_rank != self.me) & valid).sum())
        rows = int(valid.sum())
        return dict(kind=kind, xs=xs, tops=tops, sched=sched, push=push, valid=valid,
                    cross=self.gather_int(cross * D * 2), total=self.gather_int(rows * D * 2),
                    rows=self.gather_int(rows))

    # ---- sections

    def checks(self) -> None:
        p = self.setup("uniform")
        self.problem = p
        ws, sched, dev, D, k, R = self.ws, p["sched"], self.dev, self.D, self.k, self.R
        results = {}
        ref = comm.dispatch_reference(p["xs"], sched)
        results["dispatch_pull"] = same(comm.dispatch_pull(ws, sched, num_sms=24), ref)
        q = comm.dispatch_pull(ws, sched, num_sms=24, quantize="mxfp8")
        data, scale = formats.mxfp8_quantize(ref, dim=-1)
        v = p["valid"]
        results["dispatch_pull mxfp8"] = same(q.data[v], data[v]) and same(q.scale[v], scale[v])
        del q, data, scale
        ws.local("routed").fill_(float("nan"))
        comm.device_barrier(ws)
        routed = comm.push_dispatch(ws, p["push"], num_sms=24, signal=True, sync=False)
        comm.device_barrier(ws)
        results["push_dispatch (flags)"] = same(routed[v], ref[v])
        del ref
        # every rank's schedule, for the push references
        top_all = torch.full((R, self.N, k), -1, dtype=torch.int32, device=dev)
        for r, t in enumerate(p["tops"]):
            top_all[r] = t
        scheds = [build_pull_schedule(top_all, r, self.L) for r in range(R)]
        for name, fn, buf in (("combine_push", comm.combine_push, "combine"),
                              ("reverse_dispatch_push", comm.reverse_dispatch_push, "combine")):
            ys = [rows_for(r, s.capacity, D, 2 if name == "combine_push" else 3, dev) for r, s in enumerate(scheds)]
            ws.local(buf).fill_(float("nan"))
            got = fn(ws, sched, ys[self.me], num_sms=24)
            init = torch.full_like(got, float("nan"))
            results[name] = same(got, comm.combine_reference(ys, scheds, self.me, init))
            del ys, init
        d_outs = [rows_for(r, self.N, D, 4, dev) for r in range(R)]
        ws.stage(d_out=d_outs[self.me])
        got = comm.reverse_combine_pull(ws, sched, num_sms=24)  # each route's d_out row, unscaled
        results["reverse_combine_pull"] = same(got, comm.dispatch_reference(d_outs, sched))
        del got, d_outs
        out = torch.empty(sched.capacity, D, dtype=torch.bfloat16, device=dev)
        ys = [rows_for(r, s.capacity, D, 2, dev) for r, s in enumerate(scheds)]
        want = comm.combine_reference(ys, scheds, self.me, torch.full_like(ws.local("combine"), float("nan")))
        dref = comm.dispatch_reference(p["xs"], sched)
        for tuning in BASE:
            out.fill_(float("nan"))
            comm.dispatch_pull(ws, sched, num_sms=24, out=out, tuning=tuning)
            results[f"dispatch_pull {tuning.label()}"] = same(out[v], dref[v])
            ws.local("combine").fill_(float("nan"))
            got = comm.combine_push(ws, sched, ys[self.me], num_sms=24, tuning=tuning)
            results[f"combine_push {tuning.label()}"] = same(got, want)
        del out, ys, want, dref
        ok = {name: self.agree(flag) for name, flag in results.items()}
        self.record(measurement="checks", exact=ok, rows_per_rank=p["rows"])
        self.exact = all(ok.values())
        # peer copy_ ceilings (both ranks at once), the reference for the GB/s goal
        other = (self.me + 1) % R
        nbytes = ws.local("combine").numel() * 2
        local = torch.empty_like(ws.local("combine"))
        for name, fn in (("peer copy_ pull", lambda: local.copy_(ws.peer("combine", other))),
                         ("peer copy_ push", lambda: ws.peer("combine", other).copy_(local))):
            stats = self.timeit(fn, iters=max(5, self.iters // 2))
            self.record(measurement="ceiling", impl=name, **self.rates([nbytes] * R, [nbytes] * R, stats))
        del local

    def bandwidth(self) -> None:
        p, ws = self.problem, self.ws
        sched = p["sched"]
        out = torch.empty(sched.capacity, self.D, dtype=torch.bfloat16, device=self.dev)
        y = rows_for(self.me, sched.capacity, self.D, 2, self.dev)
        for num_sms in self.opts["sms"]:
            if not self.time_left():
                self.notes.append(f"1 bandwidth: stopped before num_sms={num_sms}, past the deadline")
                break
            for tuning in BASE:
                for impl, fn in (
                    ("dispatch_pull", lambda: comm.dispatch_pull(ws, sched, num_sms=num_sms, out=out, sync=False,
                                                                 tuning=tuning)),
                    ("combine_push", lambda: comm.combine_push(ws, sched, y, num_sms=num_sms, sync=False,
                                                               tuning=tuning)),
                ):
                    stats = self.timeit(fn)
                    self.record(measurement="bandwidth", impl=impl, routing="uniform", num_sms=num_sms,
                                tuning=dict(tuning.__dict__), variant=tuning.label(),
                                **self.rates(p["cross"], p["total"], stats))
        del out, y
        if self.cuda:  # NCCL all_to_all_single of exactly the cross rows (self split 0)
            counts = torch.zeros(self.R, dtype=torch.int64, device=self.dev)
            src = sched.src_rank[sched.src_rank >= 0].long()
            counts.index_add_(0, src, torch.ones_like(src))
            counts[self.me] = 0
            everyone = [torch.zeros_like(counts) for _ in range(self.R)]
            dist.all_gather(everyone, counts, group=self.world.group)
            recv = counts.tolist()
            send = [int(everyone[q][self.me]) for q in range(self.R)]
            inp = torch.randn(sum(send), self.D, device=self.dev).to(torch.bfloat16)
            outp = torch.empty(sum(recv), self.D, dtype=torch.bfloat16, device=self.dev)
            fn = lambda: dist.all_to_all_single(outp, inp, recv, send, group=self.world.group)
            stats = self.timeit(fn)
            self.record(measurement="bandwidth", impl="nccl all_to_all_single", routing="uniform",
                        **self.rates(p["cross"], p["cross"], stats))
            del inp, outp

    def best_tuning(self, impl: str, num_sms: int) -> CommTuning:
        recs = [r for r in self.records if r.get("measurement") == "bandwidth" and r.get("impl") == impl
                and r.get("num_sms") == num_sms]
        if not recs:
            return CommTuning()
        return CommTuning(**min(recs, key=lambda r: r["ms"])["tuning"])

    def signalling(self) -> None:
        p, ws = self.problem, self.ws
        sched, push = p["sched"], p["push"]
        out = torch.empty(sched.capacity, self.D, dtype=torch.bfloat16, device=self.dev)
        for num_sms in SIGNAL_SMS:
            t_pull, t_push = self.best_tuning("dispatch_pull", num_sms), self.best_tuning("combine_push", num_sms)
            for m in MINIBATCHES:
                first = push.below(m)
                rows_m = self.gather_int(int((p["valid"][:m]).sum()))
                cross_m = self.gather_int(int(((sched.src_rank[:m] != self.me) & p["valid"][:m]).sum()) * self.D * 2)
                for impl, fn in (
                    ("pull", lambda: comm.dispatch_pull(ws, sched, num_sms=num_sms, out=out, rows=m, sync=False,
                                                        tuning=t_pull)),
                    ("push + flags", lambda: comm.push_dispatch(ws, first, num_sms=num_sms, signal=True, sync=False,
                                                                check=False, tuning=t_push)),
                    ("push, stores only", lambda: comm.push_dispatch(ws, first, num_sms=num_sms, signal=False,
                                                                     sync=False, tuning=t_push)),
                ):
                    stats = self.timeit(fn)
                    self.record(measurement="signalling", impl=impl, minibatch=m, num_sms=num_sms,
                                rows_per_rank=rows_m, us=stats["ms"] * 1e3,
                                **self.rates(cross_m, [r * self.D * 2 for r in rows_m], stats))
        del out

    def imbalance(self) -> None:
        ws = self.ws
        for kind in ROUTINGS:
            p = self.problem if kind == "uniform" else self.setup(kind)
            sched, push, v = p["sched"], p["push"], p["valid"]
            ref = comm.dispatch_reference(p["xs"], sched)
            got = comm.dispatch_pull(ws, sched, num_sms=24)
            ok_pull = same(got, ref)
            del got
            ws.local("routed").fill_(float("nan"))
            comm.device_barrier(ws)
            routed = comm.push_dispatch(ws, push, num_sms=24, signal=True, sync=False)
            comm.device_barrier(ws)
            ok_push = same(routed[v], ref[v])
            del ref
            exact = self.agree(ok_pull and ok_push)
            self.exact = self.exact and exact
            out = torch.empty(sched.capacity, self.D, dtype=torch.bfloat16, device=self.dev)
            for num_sms in IMBALANCE_SMS:
                t_pull, t_push = self.best_tuning("dispatch_pull", num_sms), self.best_tuning("combine_push", num_sms)
                for impl, fn in (
                    ("pull", lambda: comm.dispatch_pull(ws, sched, num_sms=num_sms, out=out, sync=False, tuning=t_pull)),
                    ("push + flags", lambda: comm.push_dispatch(ws, push, num_sms=num_sms, signal=True, sync=False,
                                                                check=False, tuning=t_push)),
                    ("push, stores only", lambda: comm.push_dispatch(ws, push, num_sms=num_sms, signal=False,
                                                                     sync=False, tuning=t_push)),
                ):
                    stats = self.timeit(fn)
                    self.record(measurement="imbalance", impl=impl, routing=kind, num_sms=num_sms, exact=exact,
                                rows_per_rank=p["rows"], **self.rates(p["cross"], p["total"], stats))
            del out

    def timeout(self) -> None:
        small = comm.comm_workspace(self.world, CommShape(self.R, 4, 128, 2, 1))
        message = ""
        if self.me == 0:
            try:
                comm.device_barrier(small, wait_budget=(1 << 16) if self.cuda else 200)
            except RuntimeError as exc:
                message = str(exc)
        self.world.barrier()
        small.free()
        passed = self.agree(self.me != 0 or "flag 'barrier' of rank 1" in message)
        self.record(measurement="timeout", passed=passed, message=message if self.me == 0 else "")


def run(world, opts: dict):
    bench = Bench(world, opts)
    bench.exact = False
    bench.section("checks", bench.checks)
    bench.section("1 bandwidth vs num_sms", bench.bandwidth)
    bench.section("2 signalling", bench.signalling)
    bench.section("3 imbalance", bench.imbalance)
    bench.section("timeout check", bench.timeout)
    bench.ws.free()
    bench.flush()
    return dict(meta=bench.meta, records=bench.records, notes=bench.notes) if world.rank == 0 else None


# --------------------------------------------------------------------------- report


def summary(meta: dict, records: list[dict], notes: list[str]) -> str:
    lines = [f"# comm_bench: {meta['machine']} x{meta['ranks']}, {meta['preset']} D={meta['hidden']} k={meta['top_k']} "
             f"E={meta['experts']}, {meta['tokens']} tokens/rank, commit {meta['commit']}, {meta['date']}",
             f"command: `{meta['command']}`", ""]
    for r in records:
        if r["measurement"] == "checks":
            bad = [k for k, v in r["exact"].items() if not v]
            lines.append(f"exact vs torch reference: {'ALL PASS' if not bad else 'FAIL: ' + ', '.join(bad)}; "
                         f"rows per rank {r['rows_per_rank']}")
        if r["measurement"] == "timeout":
            lines.append(f"timeout check (rank 1 never signals): {'PASS' if r['passed'] else 'FAIL'}")
    ceil = {r["impl"]: r["cross_GBps"] for r in records if r["measurement"] == "ceiling"}
    if ceil:
        lines.append("peer copy_ ceiling: " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in ceil.items()))
    nccl = [r for r in records if r.get("impl") == "nccl all_to_all_single"]
    if nccl:
        lines.append(f"NCCL all_to_all_single, same cross rows: {nccl[0]['cross_GBps']:.0f} GB/s "
                     f"({nccl[0]['ms']:.3f} ms)")
    bw = [r for r in records if r["measurement"] == "bandwidth" and "num_sms" in r]
    if bw:
        # each impl against the copy_ of its own direction (reads for pull, stores for push), and the faster
        own = {"dispatch_pull": ceil.get("peer copy_ pull"), "combine_push": ceil.get("peer copy_ push")}
        ref = max(ceil.values()) if ceil else None
        lines += ["", "1. cross GB/s against num_sms, uniform routing (time = whole kernel; % of the peer copy_ of "
                  "the same direction / of the faster one)",
                  "", "| num_sms | impl | best tile | GB/s | % of ceiling |",
                  "|---|---|---|---|---|"]
        pct = lambda g, impl: (f"{100 * g / own[impl]:.1f}% / {100 * g / ref:.0f}%" if own.get(impl) and ref
                               else "-")
        best_at = {}
        for s in sorted({r["num_sms"] for r in bw}):
            for impl in ("dispatch_pull", "combine_push"):
                rs = [r for r in bw if r["num_sms"] == s and r["impl"] == impl]
                if not rs:
                    continue
                b = max(rs, key=lambda r: r["cross_GBps"])
                best_at[(s, impl)] = b
                lines.append(f"| {s} | {impl} | {b.get('variant', '?')} | {b['cross_GBps']:.0f} | "
                             f"{pct(b['cross_GBps'], impl)} |")
        lines += ["", "per variant (cross GB/s at each num_sms):", ""]
        sms = sorted({r["num_sms"] for r in bw})
        for impl in ("dispatch_pull", "combine_push"):
            lines += [f"| {impl} | " + " | ".join(str(s) for s in sms) + " |", "|---|" + "---|" * len(sms)]
            seen = set()
            for r in bw:
                if r["impl"] != impl or r.get("variant") in seen:
                    continue
                v = r.get("variant")
                seen.add(v)
                cells = []
                for s in sms:
                    rs = [x for x in bw if x["impl"] == impl and x["num_sms"] == s and x.get("variant") == v]
                    cells.append(f"{max(x['cross_GBps'] for x in rs):.0f}" if rs else "-")
                lines.append(f"| {v} | " + " | ".join(cells) + " |")
            lines.append("")
        for impl in ("dispatch_pull", "combine_push"):
            few = [b for (s, i), b in best_at.items() if i == impl and s <= 24]
            if few and own.get(impl):
                b = max(few, key=lambda r: r["cross_GBps"])
                lines.append(f"goal >= 90 % of peer copy_ with <= 24 SMs: {impl} {pct(b['cross_GBps'], impl)} "
                             f"({b['cross_GBps']:.0f} GB/s, {b['num_sms']} SMs, {b['variant']}): "
                             f"{'MET' if b['cross_GBps'] >= 0.9 * own[impl] else 'not met'} against its own "
                             f"direction, {'MET' if b['cross_GBps'] >= 0.9 * ref else 'not met'} against the faster")
    sig = [r for r in records if r["measurement"] == "signalling"]
    if sig:
        lines += ["", "2. µs from kernel start until the first M rows are usable (median, slowest rank)", "",
                  "| M | num_sms | pull | push + flags | push, stores only |", "|---|---|---|---|---|"]
        for s in sorted({r["num_sms"] for r in sig}):
            for m in sorted({r["minibatch"] for r in sig}):
                c = {r["impl"]: r["us"] for r in sig if r["num_sms"] == s and r["minibatch"] == m}
                lines.append(f"| {m} | {s} | {c.get('pull', 0):.1f} | {c.get('push + flags', 0):.1f} | "
                             f"{c.get('push, stores only', 0):.1f} |")
    imb = [r for r in records if r["measurement"] == "imbalance"]
    if imb:
        lines += ["", "3. dispatch cross GB/s under imbalance: mean over ranks (busiest rank)", "",
                  "| routing | rows/rank | num_sms | pull | push + flags | push, stores only |",
                  "|---|---|---|---|---|---|"]
        for kind in ROUTINGS:
            for s in sorted({r["num_sms"] for r in imb}):
                c = {r["impl"]: r for r in imb if r["routing"] == kind and r["num_sms"] == s}
                if not c:
                    continue
                rows = next(iter(c.values()))["rows_per_rank"]
                cell = lambda i: f"{c[i]['cross_GBps']:.0f} ({c[i]['busiest_GBps']:.0f})" if i in c else "-"
                lines.append(f"| {kind} | {rows} | {s} | {cell('pull')} | {cell('push + flags')} | "
                             f"{cell('push, stores only')} |")
        bad = sorted({r["routing"] for r in imb if not r.get("exact", True)})
        lines.append(f"exact (pull and push vs reference) under every routing: {'PASS' if not bad else 'FAIL ' + str(bad)}")
    if notes:
        lines += ["", "notes:"] + [f"- {n.splitlines()[0]}" for n in notes]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for comm.json / comm.md")
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--sms", type=lambda v: tuple(int(s) for s in v.split(",")), default=SMS,
                        help="section 1's num_sms, comma-separated (default 8,16,24,32)")
    args = parser.parse_args()
    os.environ.setdefault("MEGAMOE_DIST_TIMEOUT_S", "180")  # a rank out of step fails instead of waiting 10 min
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        commit = os.environ.get("MEGAMOE_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        commit = "unknown"
    opts = dict(vars(args), commit=commit, date=datetime.date.today().isoformat(),
                command="PYTHONPATH=src python3 " + " ".join(sys.argv))
    started = time.time()
    result = launch(run, args.ranks, opts, device=args.device)[0]
    print(f"\ncomm_bench finished in {time.time() - started:.0f} s; records in {args.out or '(no --out)'}/comm.json\n")
    print(summary(result["meta"], result["records"], result["notes"]))


if __name__ == "__main__":
    main()
