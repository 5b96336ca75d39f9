"""Check and time the Triton quantisers of megamoe.ops.quant (kernels in megamoe.kernels.quant) on one GPU.

    PYTHONPATH=src python3 benchmarks/quant_bench.py --out OUT/quant.json [--no-sweep] [--budget-s 90]

For every case (activations [16384, 7168] bf16 rowwise / columnwise in
mxfp8 and fp8-block; quantize_weights on a [32, 4096, 7168] bf16 stack in
both formats) and every tile config of its sweep, the script

1. checks the kernel bit for bit against the pure-torch function of
   megamoe.reference.formats on an input holding random values of many magnitudes,
   zero blocks, NaN, +-inf, subnormals and values near the bf16 maximum, with
   outputs allocated over freed poisoned memory (every byte must be written);
2. times it with triton.testing.do_bench (warm-up, L2 flushed before every
   repetition, median / p10 / p90), each repetition quantising every one of
   several rotating inputs (>= 900 MB in all) so that L2 cannot flatter;
3. reports GB/s = (bytes read + bytes written) / time and the fraction of the
   4252 GB/s copy ceiling (BENCHMARKS.md), next to a torch copy_ measured in
   the same run.

JSON records go to --out; a short table is printed last. Exit status 1 when
any kernel is not bit-exact. The whole run fits in about two minutes: sweeps
stop early when --budget-s is spent (defaults and the checks still run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch
import triton
from triton.testing import do_bench

from megamoe.reference.formats import fp8_block_quantize, mxfp8_quantize
from megamoe.ops.quant import QuantConfig, default_config, quantize_activations, quantize_weights

DEVICE = "cuda"
COPY_CEILING_GBPS = 4252.0  # HBM copy, read + write, BENCHMARKS.md
ACT_SHAPE = (16384, 7168)
W_SHAPE = (32, 4096, 7168)
ACT_ROTATE = 4  # 4 x 235 MB bf16
W_ROTATE = 2  # 2 x 1.88 GB bf16


@dataclass
class Case:
    name: str
    kind: str  # "act" or "weights"
    fmt: str
    axis: int
    transpose: bool = False
    sweep: list[tuple[int, int, int]] = field(default_factory=list)  # (block_m, block_k, num_warps)
    soft: bool = False  # also time the software E4M3 rounding with the default tile

    @property
    def block(self) -> tuple[int, int]:
        if self.fmt == "mxfp8":
            return (32, 1) if self.axis in (0, -2) else (1, 32)
        if self.kind == "weights":
            return (128, 128)
        return (128, 1) if self.axis == 0 else (1, 128)


# Columnwise tiles whose warps split a block reduce through shared memory (cross-warp tl.max,
# 4-6 CTA barriers); one-warp tiles keep every block max in-thread plus shuffles, no barrier.
_COL32 = [(32, 64, 1), (32, 128, 1), (64, 64, 1), (128, 32, 1), (32, 256, 4), (64, 128, 2), (64, 32, 1)]
_COL128 = [(128, 16, 1), (128, 32, 1), (128, 32, 2), (128, 64, 2), (128, 128, 8)]
CASES = [
    Case("act mxfp8 rowwise", "act", "mxfp8", 1, sweep=[(32, 512, 8), (32, 256, 4), (16, 256, 2), (8, 512, 2)],
         soft=True),
    Case("act mxfp8 colwise", "act", "mxfp8", 0, sweep=_COL32),
    Case("act mxfp8 colwise ->T", "act", "mxfp8", 0, transpose=True, sweep=_COL32 + [(128, 16, 1)], soft=True),
    Case("act fp8-block rowwise", "act", "fp8-block", 1, sweep=[(32, 128, 4), (16, 256, 2), (8, 512, 2)]),
    Case("act fp8-block colwise", "act", "fp8-block", 0, sweep=_COL128),
    Case("act fp8-block colwise ->T", "act", "fp8-block", 0, transpose=True, sweep=_COL128[:4]),
    Case("w mxfp8 cols", "weights", "mxfp8", -1, sweep=[(32, 512, 8), (8, 512, 2)]),
    Case("w mxfp8 rows", "weights", "mxfp8", -2, sweep=_COL32[:5]),
    Case("w fp8-block 128x128", "weights", "fp8-block", -1, sweep=[(128, 128, 4), (128, 256, 8)], soft=True),
]


def special_activations(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bf16 rows of magnitudes 2**-60..2**60 plus every special case the formats define."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(shape, device=DEVICE, generator=g)
    rows = x.shape[-2]
    mag = torch.exp2(torch.randint(-60, 61, (rows, 1), device=DEVICE, generator=g).float())
    x = (x * mag).bfloat16()
    flat = x.view(-1, x.shape[-1])
    flat[0:256] = 0  # whole zero blocks in every layout (rows 0..255: 128x128 and 32/128-row blocks)
    flat[1, 5] = -0.0
    flat[256:384] = (torch.randn(128, flat.shape[1], device=DEVICE, generator=g) * 2.0**-130).bfloat16()  # subnormal
    flat[384:512] = (torch.rand(128, flat.shape[1], device=DEVICE, generator=g) * 6 - 3).bfloat16() * 1e38
    n = flat.numel()
    for value in (float("nan"), float("inf"), float("-inf")):
        idx = torch.randint(0, n, (64,), device=DEVICE, generator=g)
        flat.view(-1)[idx] = value
    return x


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def reference(case: Case, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if case.fmt == "mxfp8":
        d, s = mxfp8_quantize(x, dim=case.axis)
    else:
        d, s = fp8_block_quantize(x, case.block)
    if case.transpose:
        d, s = d.T.contiguous(), s.T.contiguous()
    return d, s


def run(case: Case, x: torch.Tensor, config: QuantConfig):
    if case.kind == "act":
        return quantize_activations(x, case.fmt, case.axis, transpose=case.transpose, config=config)
    return quantize_weights(x, case.fmt, axis=case.axis, config=config)


def check(case: Case, x: torch.Tensor, want, config: QuantConfig) -> dict:
    """Bit-exact check with outputs allocated over freed, poisoned memory."""
    poison = [torch.full((w.numel() * w.element_size(),), 0xA5, dtype=torch.uint8, device=DEVICE) for w in want]
    ptrs = [p.data_ptr() for p in poison]
    del poison
    got = run(case, x, config)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    ok = all(g.shape == w.shape and torch.equal(bits(g), bits(w)) for g, w in zip(got, want))
    bad = 0 if ok else int(sum((bits(g) != bits(w)).sum().item() for g, w in zip(got, want) if g.shape == w.shape))
    return {"exact": ok, "mismatches": bad, "poisoned": [g.data_ptr() for g in got] == ptrs}


def moved_bytes(case: Case, x: torch.Tensor) -> int:
    n = x.numel()
    br, bc = case.block
    scale_bytes = (n // (br * bc)) * (1 if case.fmt == "mxfp8" else 4)
    return n * x.element_size() + n + scale_bytes


def timed(fn, inputs, nbytes: int) -> dict:
    def all_inputs():
        for t in inputs:
            fn(t)

    med, p10, p90 = do_bench(all_inputs, warmup=30, rep=150, quantiles=[0.5, 0.1, 0.9])
    k = len(inputs)
    ms = med / k
    return {
        "ms": ms,
        "ms_p10": p10 / k,
        "ms_p90": p90 / k,
        "bytes": nbytes,
        "gbps": nbytes / ms / 1e6,
        "frac_copy_ceiling": nbytes / ms / 1e6 / COPY_CEILING_GBPS,
    }


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--no-sweep", action="store_true", help="time default tiles only")
    ap.add_argument("--budget-s", type=float, default=90.0, help="stop sweeping after this many seconds")
    args = ap.parse_args()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    records: list[dict] = []

    acts = [special_activations(ACT_SHAPE, seed) for seed in range(ACT_ROTATE)]
    weights = [special_activations(W_SHAPE, 100 + seed) for seed in range(W_ROTATE)]

    # Copy ceiling measured here, same rotation as the quantisers.
    outs = [torch.empty_like(a) for a in acts]
    copy_rec = timed(lambda a: outs[0].copy_(a), acts, 2 * acts[0].numel() * acts[0].element_size())
    del outs
    records.append({"case": "torch copy_ bf16 [16384, 7168]", "impl": "torch", **copy_rec})

    failures = 0
    for case in CASES:
        inputs = acts if case.kind == "act" else weights
        want = reference(case, inputs[0])
        nbytes = moved_bytes(case, inputs[0])
        default = default_config(case.block)
        tiles = [(default.block_m, default.block_k, default.num_warps)]
        if not args.no_sweep:
            tiles += [t for t in case.sweep if t != tiles[0]]
        variants = [(t, False) for t in tiles] + ([(tiles[0], True)] if case.soft else [])
        for i, ((bm, bk, nw), soft) in enumerate(variants):
            if i > 0 and time.time() - t0 > args.budget_s:
                records.append({"case": case.name, "tile": [bm, bk, nw], "soft_e4m3": soft, "skipped": "budget"})
                continue
            cfg = QuantConfig(bm, bk, nw, soft_e4m3=True if soft else None)
            rec = {
                "case": case.name,
                "impl": "triton",
                "fmt": case.fmt,
                "kind": case.kind,
                "axis": case.axis,
                "transpose": case.transpose,
                "shape": list(inputs[0].shape),
                "dtype": "bf16",
                "tile": [bm, bk, nw],
                "soft_e4m3": soft,
                "default": i == 0,
            }
            try:
                rec.update(check(case, inputs[0], want, cfg))
                rec.update(timed(lambda t: run(case, t, cfg), inputs, nbytes))
            except Exception as exc:  # a tile that does not compile or fit is a result, not a crash
                rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
            failures += int(rec.get("exact") is False)
            records.append(rec)
            print(
                f"{case.name:24s} tile {bm:3d}x{bk:3d} w{nw:<2d}{' soft' if soft else '     '} "
                + (
                    f"{rec['ms'] * 1e3:8.1f} us {rec['gbps']:7.0f} GB/s {100 * rec['frac_copy_ceiling']:5.1f}% "
                    f"exact={rec['exact']} poisoned={rec['poisoned']}"
                    if "ms" in rec
                    else rec.get("error", "")
                ),
                flush=True,
            )
        del want
        torch.cuda.empty_cache()

    # The torch twins, for scale (they make several fp32 passes).
    for name, fn in (
        ("torch mxfp8_quantize rowwise", lambda a: mxfp8_quantize(a)),
        ("torch fp8_block_quantize rowwise", lambda a: fp8_block_quantize(a)),
    ):
        rec = timed(fn, acts, moved_bytes(CASES[0] if "mxfp8" in name else CASES[3], acts[0]))
        records.append({"case": name, "impl": "torch", **rec})

    out = {
        "bench": "quant",
        "machine": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_ceiling_gbps": COPY_CEILING_GBPS,
        "elapsed_s": round(time.time() - t0, 1),
        "records": records,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)

    print(f"\nquantisers on {out['machine']} ({out['elapsed_s']} s); GB/s = (read + written) / median time")
    print(f"{'case':32s} {'best tile':>13s} {'us':>8s} {'GB/s':>6s} {'ceil%':>6s}  "
          "default-tile GB/s  exact  all-written")
    print(f"{'torch copy_ (measured ceiling)':32s} {'':>13s} {copy_rec['ms'] * 1e3:8.1f} {copy_rec['gbps']:6.0f} "
          f"{100 * copy_rec['frac_copy_ceiling']:5.1f}%")
    for case in CASES:
        rs = [r for r in records if r.get("case") == case.name and "ms" in r]
        if not rs:
            print(f"{case.name:32s} (no result)")
            continue
        best = max((r for r in rs if not r["soft_e4m3"]), key=lambda r: r["gbps"], default=rs[0])
        dflt = next((r for r in rs if r["default"]), None)
        soft = next((r for r in rs if r["soft_e4m3"]), None)
        tile = "x".join(map(str, best["tile"][:2])) + f" w{best['tile'][2]}"
        exact = all(r["exact"] for r in rs)
        written = "yes" if all(r["poisoned"] for r in rs) else "unproven"  # outputs over poisoned memory
        extra = f"  (soft e4m3 {soft['gbps']:.0f})" if soft else ""
        print(f"{case.name:32s} {tile:>13s} {best['ms'] * 1e3:8.1f} {best['gbps']:6.0f} "
              f"{100 * best['frac_copy_ceiling']:5.1f}%  {dflt['gbps'] if dflt else float('nan'):17.0f}  "
              f"{exact!s:5s}  {written}{extra}")
    for r in records:
        if r.get("impl") == "torch" and r["case"].startswith("torch ") and "copy" not in r["case"]:
            print(f"{r['case']:32s} {'':>13s} {r['ms'] * 1e3:8.1f} {r['gbps']:6.0f} "
                  f"{100 * r['frac_copy_ceiling']:5.1f}%")
    if failures:
        print(f"{failures} configuration(s) NOT bit-exact", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
