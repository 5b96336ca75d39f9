"""The Gluon wgrad's deal in one launch: the dynamic and the planned deals' int32 `[2 + 4 L]` table
(``megamoe.ops.expert_wgrad.wgrad_deal`` documents it): the block counter (0), the blocks to deal (none where the
rows are too even for the plan to pay: the heaviest computed expert's under ``skew`` times their mean; the static
deal's launch beside the plan's then deals them), then the experts by their rows, heaviest first, ties in expert
order, the ones a window skips last, each as ``(expert, row0, row_end, 0)``.

Built from torch ops (an argsort, gathers, a stack, a sum and a concatenation) it took ~19 small launches a wgrad
launch: the planned deal's backward ran 60 launches against the static deal's 22 at qwen3-30b-a3b
(benchmarks/results/2026-12-07-wgrad-planned, call 20). Here one program ranks the experts itself: an expert's place
is the number of experts that come before it (heavier, or as heavy and numbered lower), counted CHUNK experts at a
time. Integer arithmetic but the skew test's two fp32 products (IEEE, so it runs the same under the interpreter).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _keys(counts_ptr, modes_ptr, e, experts, HAS_MODES: tl.constexpr):
    """The experts' sort keys: their rows where the launch computes them, -1 where a window skips them or past the
    last expert (never dealt)."""
    valid = e < experts
    rows = tl.load(counts_ptr + e, mask=valid, other=0)
    active = valid
    if HAS_MODES:
        active = valid & (tl.load(modes_ptr + e, mask=valid, other=0) != 0)
    return tl.where(active, rows, -1), rows, active


@triton.jit(do_not_specialize=["experts", "per_expert", "skew"])
def wgrad_deal_kernel(counts_ptr, offsets_ptr, modes_ptr, deal_ptr, experts, per_expert, skew,
                      HAS_MODES: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr):
    e = tl.arange(0, EXPERTS)
    key, rows, active = _keys(counts_ptr, modes_ptr, e, experts, HAS_MODES)
    place = tl.zeros([EXPERTS], dtype=tl.int32)
    for j0 in range(0, experts, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        key_j, _, _ = _keys(counts_ptr, modes_ptr, j, experts, HAS_MODES)
        before = (key_j[None, :] > key[:, None]) | ((key_j[None, :] == key[:, None]) & (j[None, :] < e[:, None]))
        place += tl.sum((before & (j < experts)[None, :]).to(tl.int32), axis=1)
    valid = e < experts
    row0 = tl.load(offsets_ptr + e, mask=valid, other=0)
    at = deal_ptr + 2 + 4 * place
    tl.store(at, e, mask=valid)
    tl.store(at + 1, row0, mask=valid)
    tl.store(at + 2, row0 + rows, mask=valid)
    tl.store(at + 3, tl.zeros([EXPERTS], dtype=tl.int32), mask=valid)
    computed = tl.where(active, rows, 0)
    dealt = tl.sum(active.to(tl.int32), axis=0)
    skewed = tl.max(computed, axis=0).to(tl.float32) * dealt.to(tl.float32) >= skew * tl.sum(computed, axis=0).to(
        tl.float32)
    head = tl.arange(0, 2)
    tl.store(deal_ptr + head, tl.where(head == 1, tl.where(skewed, dealt * per_expert, 0), 0))
