"""The forward tiles' task order: groups of row tiles aligned to experts against today's groups (issue 28; one GPU).

    PYTHONPATH=src python3 benchmarks/task_order_probe.py [--rows 341,384] [--groups 2,3,4,8,16]
                                                          [--rounds 4] [--seconds 0.4] [--out DIR]
    PYTHONPATH=src python3 benchmarks/task_order_probe.py --check     # the CPU interpreter: outputs only
    ncu ... python3 benchmarks/task_order_probe.py --profile         # each call once, for Nsight Compute

Under Nsight Compute our gate/up and down move 25-32 % more DRAM bytes than cuBLAS's grouped GEMM on the same
load, the equivalent of a third of the expert weights read twice (benchmarks/results/
2026-12-03-ncu-grouped-vs-cublas). Today's task order (``megamoe.kernels.expert_gemm.grouped_task``) walks
groups of GROUP_M consecutive row tiles, n-tile outer inside a group, so the programs running at once share a
weight slice; but the groups straddle experts (a 384-row expert is 3 tiles, a group 4 or 8). Here the same
tiles run in two orders, each with several group sizes G, in interleaved rounds at the power cap:

- ``plan`` / ``group G``: today's order (the planner's GROUP_M, or G),
- ``aligned G``: groups of at most G row tiles that never leave an expert (an expert of c tiles is
  ceil(c / G) groups), n-tile outer inside a group,

against the dense GEMM of all rows. The order changes no tile's arithmetic: every output is checked bitwise
against ``plan``'s. Loads: equal groups of each ``--rows`` and the same total routed uniformly at random.
Writes DIR/task_order_probe.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics

import torch
import triton
import triton.language as tl

from megamoe.config import preset
from megamoe.kernels.expert_gemm import down_tile, gate_up_swiglu_tile
from megamoe.ops.experts import down, gate_up
from megamoe.ops.launch import descriptor
from megamoe.ops.tiles import TileConfig, plan_tiles
from megamoe.routing.row_tiles import build_row_tiles
from megamoe.runtime import interpreting


@triton.jit
def aligned_task(task, num_n, group_first_ptr, expert_tiles_ptr, GROUP: tl.constexpr):
    """Task -> (row tile, n-tile) over groups of at most GROUP row tiles inside one expert, n-tile outer.

    A group [g, g + c) owns tasks [g * num_n, (g + c) * num_n), so task // num_n is one of its tiles, and
    that tile's expert's first tile and tile count give g and c."""
    t = task // num_n
    first = tl.load(group_first_ptr + t)
    count = tl.load(expert_tiles_ptr + t)
    g = first + ((t - first) // GROUP) * GROUP
    c = tl.minimum(first + count - g, GROUP)
    within = task - g * num_n
    return g + within % c, within // c


@triton.jit
def gate_up_aligned_kernel(
    x_desc, w_desc, h_ptr, act_ptr, stride_h, stride_act,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, num_tiles_ptr, expert_first_ptr, expert_tiles_ptr,
    I, K, limit, HAS_LIMIT: tl.constexpr, DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    num_n = tl.cdiv(I, BLOCK_N)
    num_tasks = tl.load(num_tiles_ptr) * num_n
    for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS, flatten=FLATTEN):
        tile, n = aligned_task(task, num_n, expert_first_ptr, expert_tiles_ptr, GROUP_M)
        gate_up_swiglu_tile(
            x_desc, w_desc, h_ptr, act_ptr, stride_h, stride_act, tl.load(tile_row0_ptr + tile),
            tl.load(tile_row_end_ptr + tile), tl.load(tile_expert_ptr + tile), n * BLOCK_N, I, K, limit,
            HAS_LIMIT, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def down_aligned_kernel(
    act_desc, w_desc, y_ptr, stride_y,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, num_tiles_ptr, expert_first_ptr, expert_tiles_ptr,
    D, K, DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    num_n = tl.cdiv(D, BLOCK_N)
    num_tasks = tl.load(num_tiles_ptr) * num_n
    for task in tl.range(tl.program_id(0), num_tasks, NUM_PROGRAMS, flatten=FLATTEN):
        tile, n = aligned_task(task, num_n, expert_first_ptr, expert_tiles_ptr, GROUP_M)
        down_tile(act_desc, w_desc, y_ptr, stride_y, tl.load(tile_row0_ptr + tile), tl.load(tile_row_end_ptr + tile),
                  tl.load(tile_expert_ptr + tile), n * BLOCK_N, D, K, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K)


def expert_groups(tile_expert: torch.Tensor, num_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row tile: its expert's first tile and the expert's tile count (tiles are ordered by expert)."""
    te = tile_expert[:num_tiles].long()
    idx = torch.arange(num_tiles, device=te.device)
    starts = torch.ones(num_tiles, dtype=torch.bool, device=te.device)
    starts[1:] = te[1:] != te[:-1]
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), 0).values
    run = torch.bincount(first, minlength=num_tiles)
    return first.to(torch.int32), run[first].to(torch.int32)


def aligned_calls(x, act, counts, offsets, wgu, wd, h, act_out, y, tiles: dict, programs: int):
    """{"gate_up": fn, "down": fn} of the aligned kernels; the tile map is built once (a host sync) outside."""
    experts, two_i, d = wgu.shape
    i = two_i // 2
    rt = build_row_tiles(counts, offsets, x.shape[0], tiles["gate_up"].block_m)
    first, count = expert_groups(rt.tile_expert, int(rt.num_tiles))
    tile_map = (rt.tile_expert, rt.tile_row0, rt.tile_row_end, rt.num_tiles, first, count)

    def meta(cfg):
        return dict(DOT_FP32=interpreting(), NUM_PROGRAMS=programs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                    BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, FLATTEN=cfg.flatten, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages)

    gu, dn = tiles["gate_up"], tiles["down"]
    gu_args = (descriptor(x, [gu.block_m, gu.block_k]), descriptor(wgu.view(experts * two_i, d), [gu.block_n, gu.block_k]),
               h, act_out, h.stride(0), act_out.stride(0), *tile_map, i, d, 0.0)
    dn_args = (descriptor(act, [dn.block_m, dn.block_k]), descriptor(wd.view(experts * d, i), [dn.block_n, dn.block_k]),
               y, y.stride(0), *tile_map, d, i)
    return {"gate_up": lambda: gate_up_aligned_kernel[(programs,)](*gu_args, HAS_LIMIT=False, **meta(gu)),
            "down": lambda: down_aligned_kernel[(programs,)](*dn_args, **meta(dn))}


def make_load(m: int, experts: int, d: int, i: int, dev, random_rows: bool, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    if random_rows:
        counts = torch.bincount(torch.randint(0, experts, (m * experts,), generator=g), minlength=experts)
    else:
        counts = torch.full((experts,), m)
    counts = counts.to(torch.int32)
    offsets = (counts.cumsum(0) - counts).to(torch.int32)
    rows = int(counts.sum())
    x = torch.randn(rows, d, generator=g).bfloat16().to(dev)
    act = torch.randn(rows, i, generator=g).bfloat16().to(dev)
    wgu = (torch.randn(experts, 2 * i, d, generator=g) / d**0.5).bfloat16().to(dev)
    wd = (torch.randn(experts, d, i, generator=g) / i**0.5).bfloat16().to(dev)
    return counts.to(dev), offsets.to(dev), x, act, wgu, wd


def variants(load, programs: int, tiles: dict, groups: tuple[int, ...]) -> dict:
    """{name: (fn, outputs)}: plan, today's order with each group size, the aligned order with each; every
    variant writes its own NaN-poisoned outputs."""
    counts, offsets, x, act, wgu, wd = load
    rows, d = x.shape
    i = act.shape[1]

    def outs():
        return tuple(torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=x.device)
                     for n in (2 * i, i, d))

    found = {}
    for name, g_m in (("plan", None), *((f"group {g}", g) for g in groups)):
        t = tiles if g_m is None else {k: dataclasses.replace(v, group_m=g_m) for k, v in tiles.items()}
        h, a_out, y = outs()
        found[f"gate_up {name}"] = (lambda h=h, a_out=a_out, t=t: gate_up(x, counts, offsets, wgu, h, a_out,
                                                                            tiles=t["gate_up"]), (h, a_out))
        found[f"down {name}"] = (lambda y=y, t=t: down(act, counts, offsets, wd, y, tiles=t["down"]), (y,))
    for g_m in groups:
        t = {k: dataclasses.replace(v, group_m=g_m) for k, v in tiles.items()}
        h, a_out, y = outs()
        calls = aligned_calls(x, act, counts, offsets, wgu, wd, h, a_out, y, t, programs)
        found[f"gate_up aligned {g_m}"] = (calls["gate_up"], (h, a_out))
        found[f"down aligned {g_m}"] = (calls["down"], (y,))
    if not interpreting():
        w_gu, w_dn = wgu[0].T.contiguous(), wd[0].T.contiguous()
        found["gate_up dense"] = (lambda: torch.mm(x, w_gu), ())
        found["down dense"] = (lambda: torch.mm(act, w_dn), ())
    return found


def compare(found: dict) -> dict:
    """Bits equal to plan's and NaN left (unwritten) of every variant with outputs, after one call of each."""
    for fn, _ in found.values():
        fn()
    result = {}
    for name, (_, got) in found.items():
        ref = found[f"{name.split()[0]} plan"][1]
        if got and not name.endswith("plan"):
            result[name] = {"bits_equal": all(bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
                                              for a, b in zip(got, ref)),
                            "nan": any(bool(a.isnan().any()) for a in got)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--rows", default="341,384")
    parser.add_argument("--experts", type=int, default=0, help="experts (default: about 65,536 rows in all)")
    parser.add_argument("--groups", default="2,3,4,8,16")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=0.4)
    parser.add_argument("--check", action="store_true", help="small shapes, outputs only (CPU interpreter)")
    parser.add_argument("--profile", action="store_true", help="each call once between cudaProfilerStart and Stop")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    groups = tuple(int(v) for v in a.groups.split(",") if v)
    if a.check:
        tiles = {k: TileConfig(32, 32, 32, num_warps=4, num_stages=1) for k in ("gate_up", "down")}
        records = []
        for m, random_rows in ((96, False), (80, True)):
            load = make_load(m, 5, 64, 64, torch.device("cpu"), random_rows, seed=m)
            records.append({"counts": load[0].tolist(), **compare(variants(load, 3, tiles, (2, 3)))})
        print(json.dumps(records, indent=1))
        return
    from sustained import interleaved_rounds  # benchmarks/, beside this script

    cfg = preset(a.preset)
    dev = torch.device("cuda")
    tiles = {k: plan_tiles(k, dev) for k in ("gate_up", "down")}
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    out = {"args": vars(a), "tiles": {k: repr(v) for k, v in tiles.items()}, "loads": []}
    lines = []
    for m in (int(v) for v in a.rows.split(",")):
        experts = a.experts or max(1, round(65536 / m))
        for random_rows in (False, True):
            load = make_load(m, experts, cfg.hidden, cfg.intermediate, dev, random_rows)
            found = variants(load, programs, tiles, groups)
            if a.profile:
                for fn, _ in found.values():
                    fn()
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
                for fn, _ in found.values():
                    fn()
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
                continue
            checks = compare(found)
            times = interleaved_rounds({n: fn for n, (fn, _) in found.items()}, a.rounds, a.seconds)
            rows = int(load[0].sum())
            fwd = 2 * rows * cfg.hidden * cfg.intermediate
            rec = {"rows_per_expert": m, "experts": experts, "random_rows": random_rows, "checks": checks,
                   "calls": {}}
            for name, ts in times.items():
                ms = statistics.median(ts)
                rec["calls"][name] = {"ms": ms, "ms_rounds": ts,
                                      "tflops": (2 if name.startswith("gate_up") else 1) * fwd / ms / 1e9}
            out["loads"].append(rec)
            label = f"{m} x {experts}" + (" random" if random_rows else "")
            for kind in ("gate_up", "down"):
                c = rec["calls"]
                dense = c[f"{kind} dense"]["tflops"]
                names = ["plan", *(f"group {g}" for g in groups), *(f"aligned {g}" for g in groups)]
                ok = all(checks[f"{kind} {n}"]["bits_equal"] for n in names[1:])
                lines.append(f"| {label} | {kind} | " + " | ".join(
                    f"{c[f'{kind} {n}']['ms']:.3f} ({100 * c[f'{kind} {n}']['tflops'] / dense:.0f} %)"
                    for n in names) + f" | {ok} |")
            del load, found
            torch.cuda.empty_cache()
    if a.profile:
        return
    with open(os.path.join(a.out, "task_order_probe.json"), "w") as f:
        json.dump(out, f, indent=1)
    names = ["plan", *(f"group {g}" for g in groups), *(f"aligned {g}" for g in groups)]
    print(f"{a.preset}; {a.rounds} interleaved rounds of {a.seconds} s; ms per call (% of the dense GEMM's rate)")
    print("| load | kernel | " + " | ".join(names) + " | bits equal plan |")
    print("|---|---|" + "---|" * len(names) + "---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
