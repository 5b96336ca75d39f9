"""Row tiles the expert kernels run for the bench's routings (CPU only; `PYTHONPATH=src python3 row_tiles.py`):
128-row tiles against the rows, and what 64-row tiles or a 64-row last tile would make of them."""
import torch

from megamoe.bench.problem import _route
from megamoe.config import preset

for name, tokens in (("deepseek-v3", 8192), ("qwen3-30b-a3b", 16384), ("kimi-k2", 8192)):
    cfg = preset(name)
    for routing in ("uniform", "zipf"):
        g = torch.Generator()
        g.manual_seed(0)
        counts = torch.bincount(_route(cfg, tokens, 0, 1, routing, 0.0, g, "cpu").flatten().long(),
                                minlength=cfg.num_experts)
        rows = int(counts.sum())
        t128 = int(((counts + 127) // 128).sum())
        t64 = int(((counts + 63) // 64).sum())
        tail = counts % 128
        last64 = int((counts // 128).sum() + (tail > 64).sum()) + 0.5 * int(((tail > 0) & (tail <= 64)).sum())
        print(f"{name} {tokens} {routing}: {rows} rows; 128-row tiles {t128} ({t128 * 128 / rows:.3f}x the rows), "
              f"64-row tiles {t64} ({t64 * 64 / rows:.3f}x), a 64-row last tile {last64:g} ({last64 * 128 / rows:.3f}x); "
              f"rows an expert: median {int(counts.median())}, max {int(counts.max())}")
