"""The Gluon wgrad's deals on a cost model (CPU only; `PYTHONPATH=src python3 deal_model.py` -> `deal_model.txt`;
2026-12-07-wgrad-split-store's deal_model.txt came from its first three columns, `first_plan` then `planned`):
the busiest of 132 programs over the mean, each block costing max(its expert's rows x 9.3 ns, 2.6 us) + 0.3 us
(a 128 x 256 block's MMA at ~990 TFLOP/s over 132 SMs; its SM's share of the write bandwidth; a fixed cost).
static: each expert's blocks round robin (wgrad_warp_specialized); counter: the deal's alternating heavy / light
order taken by whichever program comes free first (wgrad_dynamic, as list scheduling); first_plan: heavy and light
blocks in turn a program, the heavy half in a snake, the light half mirrored (f1716b2's wgrad_planned); plan: a
round's blocks side by side in the order, a snake over the programs (wgrad_planned.planned_block now, as
tests/test_experts.py's planned_blocks); one_end_counter: the counter's order taken from one end (list scheduling,
b317689)."""
import heapq
import math

import torch

from megamoe.bench.problem import _route
from megamoe.config import preset

P = 132
US_A_ROW = 2 * 128 * 256 / (990e12 / P) * 1e6


def cost(rows):
    return max(rows * US_A_ROW, 2.6) + 0.3


def static(counts, per):
    load = [0.0] * P
    for e, r in enumerate(counts):
        for b in range(per):
            load[(e * per + b) % P] += cost(r)
    return load


def counter(counts, per):
    heavy_first = [r for r in sorted(counts, reverse=True) for _ in range(per)]
    n, load, free = len(heavy_first), [0.0] * P, [(0.0, p) for p in range(P)]
    for t in range(n):
        half = t // 2
        r = heavy_first[half + (t % 2) * (n - 1 - 2 * half)]
        at, p = heapq.heappop(free)
        load[p] = at + cost(r)
        heapq.heappush(free, (load[p], p))
    return load


def first_plan(counts, per):
    heavy_first = [r for r in sorted(counts, reverse=True) for _ in range(per)]
    total, load = len(heavy_first), [0.0] * P
    heavy_blocks = (total + 1) // 2
    for p in range(P):
        for k in range(2 * -(-heavy_blocks // P)):
            t, heavy = k // 2, k % 2 == 0
            j = p + (t % 2) * (P - 1 - 2 * p)
            h, light = t * P + j, t * P + (P - 1 - j)
            if (h < heavy_blocks) if heavy else (light < total - heavy_blocks):
                load[p] += cost(heavy_first[h if heavy else total - 1 - light])
    return load


def plan(counts, per):
    heavy_first = [r for r in sorted(counts, reverse=True) for _ in range(per)]
    load = [0.0] * P
    for s, r in enumerate(heavy_first):
        t, j = divmod(s, P)
        load[j if t % 2 == 0 else P - 1 - j] += cost(r)
    return load


def one_end_counter(counts, per):
    heavy_first = [r for r in sorted(counts, reverse=True) for _ in range(per)]
    load, free = [0.0] * P, [(0.0, p) for p in range(P)]
    for r in heavy_first:
        at, p = heapq.heappop(free)
        load[p] = at + cost(r)
        heapq.heappush(free, (load[p], p))
    return load


for name, tokens in (("qwen3-30b-a3b", 16384), ("deepseek-v3", 8192), ("kimi-k2", 8192), ("sonic-7b", 24576)):
    cfg = preset(name)
    for routing in ("uniform", "zipf"):
        g = torch.Generator()
        g.manual_seed(0)
        counts = torch.bincount(_route(cfg, tokens, 0, 1, routing, 0.0, g, "cpu").flatten().long(),
                                minlength=cfg.num_experts).tolist()
        cells = []
        for wgrad, per in (("down", math.ceil(cfg.hidden / 128) * math.ceil(cfg.intermediate / 256)),
                           ("gate/up", math.ceil(2 * cfg.intermediate / 128) * math.ceil(cfg.hidden / 256))):
            mean = sum(static(counts, per)) / P
            cells.append(f"{wgrad}: " + ", ".join(f"{deal.__name__} {max(deal(counts, per)) / mean:.3f}"
                                                   for deal in (static, first_plan, plan, counter, one_end_counter)))
        print(f"{name} {tokens} {routing}: " + "; ".join(cells), flush=True)
