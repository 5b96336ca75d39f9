"""How `megamoe bench` and the tests judge a result against the oracle: the tolerances per precision, the error
statistics of a tensor, and :func:`compare` over named tensors (the output, or every gradient)."""

from __future__ import annotations

import torch

#: (relative L1, worst row's relative L2 error, max-abs of the layer output). The first and
#: last are the project's BF16 bounds (docs/performance.md); see :func:`compare` for the row check.
TOLERANCES = {"bf16": (1e-2, 1e-1, 0.5), "fp32": (1e-4, 1e-3, 1e-3),
              # FP8 routed experts (megamoe with experts="fp8-block" / "mxfp8") against the BF16-input oracle:
              # the recipe itself (x, both weights and act on the E4M3 grid, FP32 sums, on the CPU) is 6.0e-2
              # (fp8-block) and 7.5e-2 (mxfp8) off on qwen3-30b-a3b's and kimi-k2's routed experts alone; a
              # BF16 shared expert dilutes it (kimi-k2's layer: 2.8e-2 / 3.4e-2, max-abs 0.28 / 0.48,
              # benchmarks/results/2026-11-29-precisions; qwen3-30b-a3b on an H200: mxfp8 7.7e-2,
              # 2026-12-06-mxfp8-as-bf16). A missing or wrong row still gives a row error near 1.
              "fp8": (1e-1, 3e-1, 2.0),
              # gradients of fp8-block training (E4M3 dgrads and wgrads after the FP8 forward) against the same
              # oracle: measured 4-8 % L1; the worst weight-gradient row 0.22 with ~15 rows per expert
              # (tests/test_training_fp8.py), 0.39 with 2 (tiny, 8 tokens): an expert's few rows average nothing
              # (its kernels equal the recipe's twin there, tests/test_experts_fp8_bwd.py)
              "fp8-grads": (1e-1, 5e-1, 2.0)}
#: FP8 routed experts' weight gradients are judged by groups of rows, not row by row. Each row of an expert's
#: d w_gate_up / d w_down sums that expert's tokens, and a token whose activation is an outlier carries its own
#: quantisation error into the row amplified (tiny on CPU: d w_gate_up's worst row 0.29, 0.03 without the one
#: token whose silu(gate) is 10x the feature's next largest; glm-5 on an H200: 0.55, MXFP8 1.9, against a median
#: of 0.06-0.08: benchmarks/results/2026-12-02-fp8-layer-ep1). A missing or wrong block moves a wgrad tile's
#: rows together, so each group of ``ROW_GROUP`` consecutive rows must have its median row error within this
#: bound (the per-token gradients keep the row bound).
FP8_WEIGHT_GRAD_GROUP_TOL = 0.25
ROW_GROUP = 64
ROUTED_WEIGHTS = ("w_gate_up", "w_down")


def parked_on_host(want: dict[str, torch.Tensor], min_bytes: int = 1 << 30) -> dict[str, torch.Tensor]:
    """``want`` with its GPU tensors of at least ``min_bytes`` moved to host memory: the oracle's expert-weight
    gradients are weights-sized and the bench holds them for its checks beside the weights and each run's own
    gradients (deepseek-v3 at EP 1: 22.5 GB each, which ran an H100 out of memory); :func:`error_stats` brings
    them back a chunk at a time."""
    return {name: t.cpu() if t.is_cuda and t.numel() * t.element_size() >= min_bytes else t
            for name, t in want.items()}


def _flatten(grads: dict) -> dict[str, torch.Tensor]:
    flat = {k: v for k, v in grads.items() if k != "shared"}
    for s, (a, b) in enumerate(grads["shared"]):
        flat[f"shared{s}.w_gate_up"], flat[f"shared{s}.w_down"] = a, b
    return flat


#: The FP32 bytes of one operand's chunk in :func:`error_stats` (its temporaries take a few of these): 16,384 rows
#: of deepseek-v3's D = 7168 were 448 MB each, and the check ran a bench on one H100 out of memory
#: (benchmarks/results/2026-12-06-h100-fp8-bf16-wgrads, call 1).
CHUNK_BYTES = 64 << 20


def error_stats(out: torch.Tensor, ref: torch.Tensor, chunk_rows: int | None = None) -> dict:
    """Errors of ``out`` against ``ref`` in float32 chunks of rows (the last dim is a row; ``chunk_rows`` rows, by
    default :data:`CHUNK_BYTES` of them), on ``out``'s device (``ref`` may be held on the host: each chunk is brought
    over).

    max_abs = max|out-ref|; rel = sum|out-ref| / sum|ref|; row = the largest
    ||out_row - ref_row|| / max(||ref_row||, typical row norm), the typical
    norm being the RMS of ||ref_row||; row_group = the largest median of those
    row errors over groups of :data:`ROW_GROUP` consecutive rows; finite = out
    has no NaN or inf.
    """
    a, b = out.reshape(-1, out.shape[-1]), ref.reshape(-1, ref.shape[-1])
    if chunk_rows is None:
        chunk_rows = CHUNK_BYTES // (4 * max(a.shape[-1], 1))
    chunk_rows = max(-(-chunk_rows // ROW_GROUP), 1) * ROW_GROUP  # groups never straddle chunks
    chunks = range(0, a.shape[0], chunk_rows)
    ref_sq = sum(float(b[i : i + chunk_rows].to(a.device).float().pow(2).sum(dtype=torch.float64)) for i in chunks)
    typical_row = max((ref_sq / max(a.shape[0], 1)) ** 0.5, torch.finfo(torch.float32).tiny)
    max_abs, abs_sum, ref_sum, row, row_group, finite = 0.0, 0.0, 0.0, 0.0, 0.0, True
    for start in chunks:
        x, y = a[start : start + chunk_rows].float(), b[start : start + chunk_rows].to(a.device).float()
        diff = x - y
        max_abs = max(max_abs, float(diff.abs().max()))
        abs_sum += float(diff.abs().sum(dtype=torch.float64))
        ref_sum += float(y.abs().sum(dtype=torch.float64))
        rows = diff.norm(dim=1) / y.norm(dim=1).clamp_min(typical_row)
        row = max(row, float(rows.max()))
        row_group = max(row_group, max(float(g.median()) for g in rows.split(ROW_GROUP)))
        finite = finite and bool(torch.isfinite(x).all())
    return {"max_abs": max_abs, "rel": abs_sum / max(ref_sum, 1e-30), "row": row, "row_group": row_group,
            "finite": finite}


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], precision: str) -> dict:
    """Worst errors over named tensors and whether every tensor is in tolerance.

    Every tensor: relative L1 error (catches widespread error) and the worst
    row's L2 error over its norm, or a typical row's norm if larger (catches
    a few wrong rows: a missing route or a race gives ~1; BF16 rounding
    stays near 1e-2). The layer output ``out`` also meets the max-abs bound;
    gradients do not, as their magnitudes grow with the rows summed and a
    BF16 result carries half an ULP of its magnitude (measured on kimi-k2:
    weight gradients up to ~120, router-weight gradients up to ~500). FP8 routed
    experts' weight gradients meet :data:`FP8_WEIGHT_GRAD_GROUP_TOL` on groups
    of rows in place of the row bound.
    """
    rel_tol, row_tol, abs_tol = TOLERANCES[precision]
    worst = {"max_abs_err": 0.0, "rel_err": 0.0, "row_err": 0.0, "row_group_err": 0.0, "correct": True,
             "worst_tensor": None, "failed": None}
    for name, ref in want.items():
        out = got.get(name)
        if out is None or out.shape != ref.shape:
            return {**worst, "max_abs_err": float("inf"), "rel_err": float("inf"), "correct": False,
                    "worst_tensor": name,
                    "failed": f"{name}: {'missing' if out is None else f'shape {tuple(out.shape)}'}, want shape "
                              f"{tuple(ref.shape)}"}
        if ref.numel() == 0:
            continue
        st = error_stats(out, ref)
        grouped = precision == "fp8-grads" and name in ROUTED_WEIGHTS
        # (error, bound, what) of every check of this tensor; the first one out of bounds is the reason reported
        checks = [(st["rel"], rel_tol, "rel err"),
                  (st["row_group"], FP8_WEIGHT_GRAD_GROUP_TOL, f"median row err of {ROW_GROUP} rows") if grouped
                  else (st["row"], row_tol, "worst row err")]
        if name == "out":
            checks.append((st["max_abs"], abs_tol, "max abs"))
        ok = all(err <= bound for err, bound, _ in checks) and st["finite"]
        if not ok and worst["failed"] is None:
            worst["failed"] = f"{name}: " + ("not finite" if not st["finite"] else next(
                f"{what} {err:.2e} > {bound:g}" for err, bound, what in checks if not err <= bound))
        if worst["worst_tensor"] is None or (not ok and worst["correct"]) or (
                ok == worst["correct"] and st["rel"] > worst["rel_err"]):
            worst["worst_tensor"] = name
        worst["max_abs_err"] = max(worst["max_abs_err"], st["max_abs"])
        worst["rel_err"] = max(worst["rel_err"], st["rel"])
        worst["row_err"] = max(worst["row_err"], st["row"])
        worst["row_group_err"] = max(worst["row_group_err"], st["row_group"])
        worst["correct"] = worst["correct"] and ok
    return worst


def bounds(tolerance: str, name: str) -> dict:
    """A record's tolerance fields: the TOLERANCES key its check used and its bounds (see :func:`compare`)."""
    rel_tol, row_tol, abs_tol = TOLERANCES[tolerance]
    return {"tolerance": tolerance, "rel_tol": rel_tol, "row_tol": row_tol,
            "row_group_tol": FP8_WEIGHT_GRAD_GROUP_TOL if tolerance == "fp8-grads" else None,
            "max_abs_tol": abs_tol if name == "fwd" else None}
