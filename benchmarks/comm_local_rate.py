"""How fast one SM copies rows with the pull kernel: every row local (one rank), or a real dispatch.

    PYTHONPATH=src python3 benchmarks/comm_local_rate.py [--ranks 2] [--out rate.json]

One rank on GPU 0 (or --ranks R, one per GPU: half the rows come over NVLink at R = 2), kimi-k2 rows
(8192 tokens x 8 routes of 7168 bf16, 0.94 GB read and written):
`dispatch_pull` with 1 to 132 programs and a few copy tiles, timed with CUDA events (median of 10),
against torch's gather (`index_select` of the same rows). Every pull is checked against the gather.
In the megakernel the comm workers move ~11-13 GB/s each whether the rows are local or remote
(benchmarks/results/2026-11-29-comm-tile); this isolates the copy loop from the GEMMs beside it.
"""

from __future__ import annotations

import argparse
import json

import torch

from megamoe.ops import comm
from megamoe.ops.comm import CommTuning
from megamoe.config import preset
from megamoe.parallel.world import launch

SMS = (1, 4, 8, 16, 32, 132)
#: row tiles: 4 rows on 4 warps, 16 on 16, the default 8 on 8 (the megakernel's)
TUNINGS = (CommTuning(4, 4), CommTuning(16, 16), CommTuning())


def _median_ms(fn, iters: int = 10) -> float:
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def _rank(world, tokens: int, sms_list: tuple[int, ...]) -> list[dict]:
    cfg = preset("kimi-k2")
    shape = comm.comm_shape(world, cfg, tokens, max_tokens=tokens)
    ws = comm.comm_workspace(world, shape)
    gen = torch.Generator(device=world.device).manual_seed(0)
    x = torch.randn(tokens, cfg.hidden, generator=gen, device=world.device).bfloat16()
    top = torch.randint(0, cfg.num_experts, (tokens, cfg.top_k), generator=gen, device=world.device)
    ws.stage(x=x)
    sched = ws.pull_schedule(top)
    rows = int(sched.num_rows)
    token = (sched.src_index[:rows] // cfg.top_k).long()
    want = x.index_select(0, token)
    nbytes = rows * cfg.hidden * 2
    out = torch.empty(sched.capacity, cfg.hidden, dtype=torch.bfloat16, device=world.device)
    records = [{"impl": "torch index_select (whole GPU)", "num_sms": None,
                "ms": _median_ms(lambda: torch.index_select(x, 0, token, out=out[:rows]))}]
    for tuning in TUNINGS:
        for sms in sms_list:
            out.fill_(float("nan"))
            world.barrier()  # ranks time the same launch together
            ms = _median_ms(lambda: comm.dispatch_pull(ws, sched, num_sms=sms, out=out, sync=False, tuning=tuning))
            records.append({"impl": f"dispatch_pull {tuning.label()}", "num_sms": sms, "ms": ms,
                            "exact": bool(torch.equal(out[:rows], want))})
    for r in records:
        r["gb_s"] = nbytes / r["ms"] / 1e6
        r["gb_s_per_sm"] = r["gb_s"] / r["num_sms"] if r["num_sms"] else None
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    records = launch(_rank, args.ranks, args.tokens, SMS if args.ranks == 1 else (8, 16, 24, 32), device="cuda")[0]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    print(f"rank 0 of {args.ranks}")
    print("| impl | programs | ms | GB/s (rows read) | GB/s per program | exact |")
    print("|---|---|---|---|---|---|")
    for r in records:
        per = "—" if r["gb_s_per_sm"] is None else f"{r['gb_s_per_sm']:.1f}"
        print(f"| {r['impl']} | {r['num_sms'] or 'all'} | {r['ms']:.3f} | {r['gb_s']:.0f} | {per} "
              f"| {r.get('exact', '—')} |")


if __name__ == "__main__":
    main()
