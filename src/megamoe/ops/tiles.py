"""Tile shapes of the expert GEMMs: :class:`TileConfig` and the BF16 planner.

The FP8 formats plan their own tiles beside their launches
(:func:`megamoe.ops.experts_fp8.plan_tiles_fp8`,
:func:`megamoe.ops.experts_mxfp8.plan_tiles_mxfp8`): their K step is fixed by
the scale block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe.runtime import compiled_gpu


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch shape of one GEMM kind."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    flatten: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two >= 16, got {value}")


#: The GEMMs of the expert FFN: forward gate/up and down; backward dact, dx and wgrad.
GEMM_KINDS = ("gate_up", "down", "dact", "dx", "wgrad")


#: Forward tiles of 64 rows (one warpgroup, 4 stages) when experts hold at most this many rows on average:
#: ~170-row experts (kimi-k2 at EP 1) ran 4 % faster than with 128-row tiles, ~256-row ones 9 % slower
#: (benchmarks/results/2026-11-30-replay, tiles_ab.py; 128-row tiles compute 256 rows of a 170-row expert,
#: 64-row ones 192).
FEW_ROWS_PER_EXPERT = 192


def mean_rows(rows: int, experts: int, rows_per_expert: float | None = None) -> float:
    """The load's mean rows per expert for a tile plan: ``rows_per_expert`` when a caller knows it (its rows
    are a worst-case capacity), else ``rows`` over ``experts``."""
    return rows_per_expert if rows_per_expert is not None else rows / max(experts, 1)


def plan_tiles(kind: str, device: torch.device, rows_per_expert: float | None = None) -> TileConfig:
    """The tile shape for ``kind`` (one of :data:`GEMM_KINDS`) on ``device``.

    GPU (H200, benchmarks/results/2026-11-29-expert-gemm-forward): 128-row
    tiles with 8 warps; gate/up computes a 128x128 gate and a 128x128 up tile
    (a 128x256 tile of h) so SwiGLU fits in the epilogue, 3 stages, groups of
    4 row tiles; down 128x256, 3 stages, groups of 8, and the flattened task
    loop (+2-5 %; it costs gate/up 15-20 %). 64-row tiles lost 25-35 % there
    (341- and 4096-row experts); the forward and the backward's dx take them when
    ``rows_per_expert`` (the load's mean) is at most :data:`FEW_ROWS_PER_EXPERT`, and the wgrad takes
    BK 64 there. The
    interpreter gets small tiles: it runs one program at a time.
    """
    if kind not in GEMM_KINDS:
        raise ValueError(f"kind must be one of {GEMM_KINDS}, got {kind!r}")
    if not compiled_gpu(device):
        return TileConfig(32, 32, 32, num_warps=4, num_stages=1)
    few = rows_per_expert is not None and rows_per_expert <= FEW_ROWS_PER_EXPERT
    if kind == "gate_up" and few:
        return TileConfig(64, 128, 64, num_warps=4, num_stages=4, group_m=8)
    if kind == "down" and few:
        return TileConfig(64, 256, 64, num_warps=4, num_stages=4, group_m=8, flatten=True)
    if kind == "dx" and few:
        # the same 64-row tiles: -1.5 and -2.0 % of the expert backward on ~170-row experts, +3 % on 341-row
        # ones, the same bits (a row's K loop does not depend on the tile's height; 2026-12-02-backward-few-rows)
        return TileConfig(64, 256, 64, num_warps=4, num_stages=4, group_m=8, flatten=True)
    if kind == "gate_up":
        return TileConfig(128, 128, 64, num_warps=8, num_stages=3, group_m=4)
    if kind in ("down", "dx"):
        # dx flattened too: with 4-stage wgrads 1.6 % off the 341-row backward, 0.6 % off the 4096-row one
        # (2026-12-02-backward-tiles)
        return TileConfig(128, 256, 64, num_warps=8, num_stages=3, group_m=8, flatten=True)
    if kind == "wgrad" and few:
        # a <= 192-row expert pads to 192 rows with BK 32 or 64 alike: half the K steps (and their CTA
        # barriers), 3 stages to fit the shared memory (2026-12-03-wgrad-variants: -5.5 and -5.9 % on ~170-row experts;
        # +4 % on 341-row ones, which BK 64 pads to 384)
        return TileConfig(128, 256, 64, num_warps=8, num_stages=3, group_m=8, flatten=True)
    if kind == "wgrad":
        # K runs over an expert's rows: 128x256 blocks halve the fills and stores per FLOP of 128x128
        # (-22 %), BK 32 pads a 341-row expert to 352 rows instead of 384, and the flattened loop
        # overlaps a block's store with the next block's loads (2026-11-30-wgrad); 4 stages, not 5: an
        # 11-step K loop fills fewer (-1.1 to -1.2 % on the 341-row backward in two runs, 2026-12-02).
        return TileConfig(128, 256, 32, num_warps=8, num_stages=4, group_m=8, flatten=True)
    # dact: a heavy epilogue (loads h, writes d_h and act_w); 4 stages measured 11-18 % faster than 3.
    return TileConfig(128, 128, 64, num_warps=8, num_stages=4, group_m=8)
