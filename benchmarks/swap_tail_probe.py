"""Swap-AB tiles for each expert's partial last row tile: do they win back the padding? (issue 28; one GPU)

    PYTHONPATH=src python3 benchmarks/swap_tail_probe.py [--rows 341] [--rounds 4] [--seconds 0.4] [--out DIR]
    PYTHONPATH=src python3 benchmarks/swap_tail_probe.py --check      # the CPU interpreter: outputs only

kimi-k2's 341-row experts are 2 x 128 + 85 rows: our 128-row tiles compute 384 rows, and run at 77-80 % of
dense where cuBLAS, which sizes a token tile to the group (2 x 176), holds 91-92 %
(benchmarks/results/2026-12-03-padding-probe). Triton's block shapes are powers of two, but a tile may hold
several products that share one weight tile: with the tokens on the MMA's N (swap-AB) a wgmma's N can be 32
or 64, so the last 85 rows can be a 64- and a 32-token product of one 128- or 256-row weight tile (96 rows
computed, not 128). This times, in interleaved rounds at the power cap:

- ``plan``: today's kernels (128-row tiles over all rows),
- ``split``: today's kernels over each expert's full 128-row tiles, then a swap-AB tail kernel over the
  rest (tails of up to 64 rows one 64-token product, up to 96 a 64 and a 32, longer ones stay 128-row tiles),
- its two launches alone (``full only``, ``tail only``), and the tail as one 128-token swap product,
- the dense GEMM of all rows (the yardstick).

Outputs are checked against ``plan``'s (bits and the largest difference). Writes DIR/swap_tail_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton
import triton.language as tl

from megamoe.config import preset
from megamoe.kernels.convert import to_bf16
from megamoe.kernels.expert_gemm import _tile_task, down_tile, gate_up_swiglu_tile, swiglu_tile, tile_dot
from megamoe.ops.experts import down, gate_up
from megamoe.ops.launch import descriptor
from megamoe.ops.tiles import TileConfig, plan_tiles
from megamoe.routing.row_tiles import build_row_tiles
from megamoe.runtime import interpreting


@triton.jit
def _tail_task(task, num_n, expert_ptr, row0_ptr, row_end_ptr):
    t = task // num_n
    return tl.load(expert_ptr + t), tl.load(row0_ptr + t), tl.load(row_end_ptr + t), task - t * num_n


@triton.jit
def _store_t(acc, out_ptr, stride, row0, row_end, c0, C, DOT_FP32: tl.constexpr):
    """Store a [columns, tokens] product as out[row0 + token, c0 + column] (rows < row_end, columns < C)."""
    tile = tl.trans(to_bf16(acc, DOT_FP32))
    rows = row0 + tl.arange(0, tile.shape[0])
    cols = c0 + tl.arange(0, tile.shape[1])
    mask = (rows < row_end)[:, None] & (cols < C)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :], tile, mask=mask)


@triton.jit
def down_swap_tile(a0_desc, a1_desc, w_desc, y_ptr, stride_y, row0, row_end, expert, n0, D, K,
                   DOT_FP32: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, T0: tl.constexpr,
                   T1: tl.constexpr):
    """yᵀ[n0.., rows row0..] = w_down[expert][n0..] · actᵀ: a T0- and a T1-token product (T1 0: none)."""
    acc0 = tl.zeros((BLOCK_W, T0), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_W, T1 if T1 > 0 else 16), dtype=tl.float32)
    w_row = expert * D + n0
    for k in range(0, K, BLOCK_K):
        w = w_desc.load([w_row, k])
        acc0 = tile_dot(w, a0_desc.load([row0, k]).T, acc0, DOT_FP32)
        if T1 > 0:
            acc1 = tile_dot(w, a1_desc.load([row0 + T0, k]).T, acc1, DOT_FP32)
    _store_t(acc0, y_ptr, stride_y, row0, row_end, n0, D, DOT_FP32)
    if T1 > 0:
        _store_t(acc1, y_ptr, stride_y, row0 + T0, row_end, n0, D, DOT_FP32)


@triton.jit
def down_tail_kernel(
    a0_desc, a1_desc, w_desc, y_ptr, stride_y, expert_ptr, row0_ptr, row_end_ptr, num_tails,
    D, K, DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr,
):
    """The swap tiles of the listed tails (a launch of their own)."""
    num_n = tl.cdiv(D, BLOCK_W)
    for task in tl.range(tl.program_id(0), num_tails * num_n, NUM_PROGRAMS):
        expert, row0, row_end, n = _tail_task(task, num_n, expert_ptr, row0_ptr, row_end_ptr)
        down_swap_tile(a0_desc, a1_desc, w_desc, y_ptr, stride_y, row0, row_end, expert, n * BLOCK_W, D, K,
                       DOT_FP32, BLOCK_W, BLOCK_K, T0, T1)


@triton.jit
def down_mixed_kernel(
    a_desc, a0_desc, a1_desc, w_desc, y_ptr, stride_y,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, num_tiles_ptr, D, K,
    DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr,
):
    """Today's down kernel, with each tile of at most T0 + T1 rows a swap tile in the same task order (its
    weight tile is read while the expert's other row tiles' are in L2)."""
    num_n = tl.cdiv(D, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr)
    for task in tl.range(tl.program_id(0), num_tiles * num_n, NUM_PROGRAMS, flatten=FLATTEN):
        expert, row0, row_end, n = _tile_task(
            task, num_n, num_tiles, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, GROUP_M)
        if row_end - row0 > T0 + T1:
            down_tile(a_desc, w_desc, y_ptr, stride_y, row0, row_end, expert, n * BLOCK_N, D, K,
                      DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            down_swap_tile(a0_desc, a1_desc, w_desc, y_ptr, stride_y, row0, row_end, expert, n * BLOCK_N, D, K,
                           DOT_FP32, BLOCK_N, BLOCK_K, T0, T1)


@triton.jit
def _swiglu_store_t(g, u, h_ptr, act_ptr, stride_h, stride_act, row0, row_end, c0, I, limit,
                    HAS_LIMIT: tl.constexpr, DOT_FP32: tl.constexpr):
    _store_t(g, h_ptr, stride_h, row0, row_end, c0, I, DOT_FP32)
    _store_t(u, h_ptr + I, stride_h, row0, row_end, c0, I, DOT_FP32)
    _store_t(swiglu_tile(g, u, limit, HAS_LIMIT), act_ptr, stride_act, row0, row_end, c0, I, DOT_FP32)


@triton.jit
def gate_up_swap_tile(a0_desc, a1_desc, w_desc, h_ptr, act_ptr, stride_h, stride_act, row0, row_end, expert, n0,
                      I, K, limit, HAS_LIMIT: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_W: tl.constexpr,
                      BLOCK_K: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr):
    """hᵀ (gate and up) and actᵀ of BLOCK_W act columns x (T0 + T1) tokens, weights on the MMA's M."""
    T1_: tl.constexpr = T1 if T1 > 0 else 16
    g0 = tl.zeros((BLOCK_W, T0), dtype=tl.float32)
    u0 = tl.zeros((BLOCK_W, T0), dtype=tl.float32)
    g1 = tl.zeros((BLOCK_W, T1_), dtype=tl.float32)
    u1 = tl.zeros((BLOCK_W, T1_), dtype=tl.float32)
    w_gate_row = expert * 2 * I + n0
    for k in range(0, K, BLOCK_K):
        wg = w_desc.load([w_gate_row, k])
        wu = w_desc.load([w_gate_row + I, k])
        a0 = a0_desc.load([row0, k]).T
        g0 = tile_dot(wg, a0, g0, DOT_FP32)
        u0 = tile_dot(wu, a0, u0, DOT_FP32)
        if T1 > 0:
            a1 = a1_desc.load([row0 + T0, k]).T
            g1 = tile_dot(wg, a1, g1, DOT_FP32)
            u1 = tile_dot(wu, a1, u1, DOT_FP32)
    _swiglu_store_t(g0, u0, h_ptr, act_ptr, stride_h, stride_act, row0, row_end, n0, I, limit, HAS_LIMIT, DOT_FP32)
    if T1 > 0:
        _swiglu_store_t(g1, u1, h_ptr, act_ptr, stride_h, stride_act, row0 + T0, row_end, n0, I, limit,
                        HAS_LIMIT, DOT_FP32)


@triton.jit
def gate_up_tail_kernel(
    a0_desc, a1_desc, w_desc, h_ptr, act_ptr, stride_h, stride_act, expert_ptr, row0_ptr, row_end_ptr,
    num_tails, I, K, limit, HAS_LIMIT: tl.constexpr, DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr,
):
    """The swap tiles of the listed tails (a launch of their own)."""
    num_n = tl.cdiv(I, BLOCK_W)
    for task in tl.range(tl.program_id(0), num_tails * num_n, NUM_PROGRAMS):
        expert, row0, row_end, n = _tail_task(task, num_n, expert_ptr, row0_ptr, row_end_ptr)
        gate_up_swap_tile(a0_desc, a1_desc, w_desc, h_ptr, act_ptr, stride_h, stride_act, row0, row_end, expert,
                          n * BLOCK_W, I, K, limit, HAS_LIMIT, DOT_FP32, BLOCK_W, BLOCK_K, T0, T1)


@triton.jit
def gate_up_mixed_kernel(
    x_desc, a0_desc, a1_desc, w_desc, h_ptr, act_ptr, stride_h, stride_act,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, num_tiles_ptr, I, K, limit,
    HAS_LIMIT: tl.constexpr, DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
    T0: tl.constexpr, T1: tl.constexpr,
):
    """Today's gate/up kernel, with each tile of at most T0 + T1 rows a swap tile in the same task order."""
    num_n = tl.cdiv(I, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr)
    for task in tl.range(tl.program_id(0), num_tiles * num_n, NUM_PROGRAMS, flatten=FLATTEN):
        expert, row0, row_end, n = _tile_task(
            task, num_n, num_tiles, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, GROUP_M)
        if row_end - row0 > T0 + T1:
            gate_up_swiglu_tile(x_desc, w_desc, h_ptr, act_ptr, stride_h, stride_act, row0, row_end, expert,
                                n * BLOCK_N, I, K, limit, HAS_LIMIT, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            gate_up_swap_tile(a0_desc, a1_desc, w_desc, h_ptr, act_ptr, stride_h, stride_act, row0, row_end,
                              expert, n * BLOCK_N, I, K, limit, HAS_LIMIT, DOT_FP32, BLOCK_N, BLOCK_K, T0, T1)


def mixed_calls(x, act, counts, offsets, wgu, wd, h, act_out, y, tiles: dict, programs: int, t0: int, t1: int):
    """{"gate_up": fn, "down": fn}: the mixed kernels (today's tiles and task order, swap tiles for short ones)."""
    experts, two_i, d = wgu.shape
    i = two_i // 2
    rows = x.shape[0]
    counts, offsets = counts.to(torch.int32), offsets.to(torch.int32)
    t1d = max(t1, 16)

    def one(kernel, cfg, a, w2d, head, tail, **extra):
        def run():
            rt = build_row_tiles(counts, offsets, rows, cfg.block_m)
            kernel[(programs,)](
                descriptor(a, [cfg.block_m, cfg.block_k]), descriptor(a, [t0, cfg.block_k]),
                descriptor(a, [t1d, cfg.block_k]), descriptor(w2d, [cfg.block_n, cfg.block_k]), *head,
                rt.tile_expert, rt.tile_row0, rt.tile_row_end, rt.num_tiles, *tail,
                DOT_FP32=interpreting(), NUM_PROGRAMS=programs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, FLATTEN=cfg.flatten, T0=t0, T1=t1,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra)
        return run

    return {"gate_up": one(gate_up_mixed_kernel, tiles["gate_up"], x, wgu.view(experts * two_i, d),
                           (h, act_out, h.stride(0), act_out.stride(0)), (i, d, 0.0), HAS_LIMIT=False),
            "down": one(down_mixed_kernel, tiles["down"], act, wd.view(experts * d, i), (y, y.stride(0)), (d, i))}


def split_counts(counts: torch.Tensor, offsets: torch.Tensor, block_m: int, swap_max: int):
    """(counts of the full-tile part, [(T0, T1, expert, row0, row_end)] tail classes): a tail of at most
    ``swap_max`` rows goes to the swap kernel, a longer one stays with the full tiles."""
    tail = counts % block_m
    swapped = (tail > 0) & (tail <= swap_max)
    full = torch.where(swapped, counts - tail, counts)
    classes = []
    for lo, hi, t0, t1 in ((0, 32, 32, 0), (32, 64, 64, 0), (64, 96, 64, 32), (96, 128, 128, 0)):
        pick = swapped & (tail > lo) & (tail <= hi)
        if bool(pick.any()):
            e = pick.nonzero().flatten().to(torch.int32)
            row0 = (offsets[e] + full[e]).to(torch.int32)
            classes.append((t0, t1, e, row0, (offsets[e] + counts[e]).to(torch.int32)))
    return full.to(torch.int32), classes


def tail_calls(x, act, wgu, wd, h, act_out, y, classes, block_w: dict, block_k: int, programs: int, warps: int,
               stages: int):
    """{"gate_up": fn, "down": fn}: the swap kernels over every tail class (one launch per class)."""
    experts, two_i, d = wgu.shape
    i = two_i // 2
    fp32 = interpreting()
    launches_gu, launches_dn = [], []
    for t0, t1, e, row0, row_end in classes:
        t1d = max(t1, 16)
        args_gu = (descriptor(x, [t0, block_k]), descriptor(x, [t1d, block_k]),
                   descriptor(wgu.view(experts * two_i, d), [block_w["gate_up"], block_k]),
                   h, act_out, h.stride(0), act_out.stride(0), e, row0, row_end, e.numel(), i, d, 0.0)
        args_dn = (descriptor(act, [t0, block_k]), descriptor(act, [t1d, block_k]),
                   descriptor(wd.view(experts * d, i), [block_w["down"], block_k]), y, y.stride(0),
                   e, row0, row_end, e.numel(), d, i)
        meta = dict(DOT_FP32=fp32, NUM_PROGRAMS=programs, BLOCK_K=block_k, T0=t0, T1=t1, num_warps=warps,
                    num_stages=stages)
        launches_gu.append((args_gu, dict(meta, BLOCK_W=block_w["gate_up"], HAS_LIMIT=False)))
        launches_dn.append((args_dn, dict(meta, BLOCK_W=block_w["down"])))

    def run_gu():
        for args, meta in launches_gu:
            gate_up_tail_kernel[(programs,)](*args, **meta)

    def run_dn():
        for args, meta in launches_dn:
            down_tail_kernel[(programs,)](*args, **meta)

    return {"gate_up": run_gu, "down": run_dn}


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


def variants(load, programs: int, tiles: dict, swap: dict[str, tuple[int, int]], split: bool):
    """{name: (fn, outputs)}: today's kernels (plan), the mixed kernels for each swap shape (name: (T0, T1)),
    and with ``split`` the swap tiles as a launch of their own after today's kernels over the full tiles; each
    variant writes its own NaN-poisoned outputs."""
    counts, offsets, x, act, wgu, wd = load
    rows, d = x.shape
    i = act.shape[1]
    dev = x.device
    block_m = tiles["gate_up"].block_m

    def outs():
        return (torch.full((rows, 2 * i), float("nan"), dtype=torch.bfloat16, device=dev),
                torch.full((rows, i), float("nan"), dtype=torch.bfloat16, device=dev),
                torch.full((rows, d), float("nan"), dtype=torch.bfloat16, device=dev))

    found = {}
    h, a_out, y = outs()
    found["gate_up plan"] = (lambda h=h, a_out=a_out: gate_up(x, counts, offsets, wgu, h, a_out,
                                                              tiles=tiles["gate_up"]), (h, a_out))
    found["down plan"] = (lambda y=y: down(act, counts, offsets, wd, y, tiles=tiles["down"]), (y,))
    for name, (t0, t1) in swap.items():
        h, a_out, y = outs()
        calls = mixed_calls(x, act, counts, offsets, wgu, wd, h, a_out, y, tiles, programs, t0, t1)
        found[f"gate_up {name}"] = (calls["gate_up"], (h, a_out))
        found[f"down {name}"] = (calls["down"], (y,))
    if split:
        full, classes = split_counts(counts, offsets, block_m, 96)
        h, a_out, y = outs()
        block_w = {kind: tiles[kind].block_n for kind in ("gate_up", "down")}
        cfg = tiles["gate_up"]
        tails = tail_calls(x, act, wgu, wd, h, a_out, y, classes, block_w, cfg.block_k, programs, cfg.num_warps,
                           cfg.num_stages)

        def fgu():
            gate_up(x, full, offsets, wgu, h, a_out, tiles=tiles["gate_up"])
            tails["gate_up"]()

        def fdn():
            down(act, full, offsets, wd, y, tiles=tiles["down"])
            tails["down"]()

        found["gate_up split"] = (fgu, (h, a_out))
        found["down split"] = (fdn, (y,))
    if not interpreting():
        w_gu, w_dn = wgu[0].T.contiguous(), wd[0].T.contiguous()
        found["gate_up dense"] = (lambda: torch.mm(x, w_gu), ())
        found["down dense"] = (lambda: torch.mm(act, w_dn), ())
    return found


def compare(found: dict) -> dict:
    """Bits equal, the largest difference and NaN left (unwritten) of every variant against plan, after one
    call of each."""
    for fn, _ in found.values():
        fn()
    result = {}
    for name, (_, got) in found.items():
        kind = name.split()[0]
        ref = found[f"{kind} plan"][1]
        if got and not name.endswith("plan"):
            result[name] = {
                "bits_equal": all(bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
                                  for a, b in zip(got, ref)),
                "max_abs_diff": max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref)),
                "nan": any(bool(a.isnan().any()) for a in got),
            }
    return result


SWAP = {"mixed 64+32": (64, 32), "mixed 64": (64, 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--rows", type=int, default=341)
    parser.add_argument("--experts", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=0.4)
    parser.add_argument("--split", action="store_true", help="also the swap tiles as a launch of their own")
    parser.add_argument("--check", action="store_true", help="small shapes, outputs only (CPU interpreter)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    if a.check:
        dev = torch.device("cpu")
        tiles = {kind: TileConfig(128, 32, 32, num_warps=4, num_stages=1) for kind in ("gate_up", "down")}
        records = []
        for m, random_rows in ((210, False), (170, True), (40, True)):
            load = make_load(m, 4, 64, 64, dev, random_rows, seed=m)
            found = variants(load, 4, tiles, SWAP, split=True)
            records.append({"random_rows": random_rows, "counts": load[0].tolist(), **compare(found)})
        print(json.dumps(records, indent=1))
        return
    from sustained import interleaved_rounds  # benchmarks/, beside this script

    cfg = preset(a.preset)
    dev = torch.device("cuda")
    tiles = {kind: plan_tiles(kind, dev) for kind in ("gate_up", "down")}
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    out = {"args": vars(a), "tiles": {k: repr(v) for k, v in tiles.items()}, "loads": []}
    names = ["plan", *SWAP, *(["split"] if a.split else [])]
    lines = []
    for random_rows in (False, True):
        load = make_load(a.rows, a.experts, cfg.hidden, cfg.intermediate, dev, random_rows)
        rows = int(load[0].sum())
        found = variants(load, programs, tiles, SWAP, a.split)
        checks = compare(found)
        times = interleaved_rounds({n: fn for n, (fn, _) in found.items()}, a.rounds, a.seconds)
        fwd = 2 * rows * cfg.hidden * cfg.intermediate
        rec = {"random_rows": random_rows, "rows": rows, "counts": load[0].tolist(), "checks": checks, "calls": {}}
        for name, ts in times.items():
            ms = statistics.median(ts)
            flops = 2 * fwd if name.startswith("gate_up") else fwd
            rec["calls"][name] = {"ms": ms, "ms_rounds": ts, "tflops_real_rows": flops / ms / 1e9}
        out["loads"].append(rec)
        label = "random" if random_rows else f"{a.rows} each"
        for kind in ("gate_up", "down"):
            c = rec["calls"]
            dense = c[f"{kind} dense"]["tflops_real_rows"]
            cells = [f"{c[f'{kind} {n}']['ms']:.3f} ({100 * c[f'{kind} {n}']['tflops_real_rows'] / dense:.0f} %)"
                     for n in names]
            ok = all(checks[f"{kind} {n}"]["bits_equal"] for n in names[1:])
            lines.append(f"| {label} | {kind} | " + " | ".join(cells) + f" | {ok} |")
        del load, found
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "swap_tail_probe.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"{a.preset}, {a.experts} experts; {a.rounds} interleaved rounds of {a.seconds} s; ms per call "
          "(% of the dense GEMM's rate, real rows)")
    print("| load | kernel | " + " | ".join(names) + " | bits equal plan |")
    print("|---|---|" + "---|" * len(names) + "---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
