"""Tile shapes and ring depths of the expert GEMMs: :class:`TileConfig` and every format's tile planner.

One rule per function, each with the measurement that settled it (benchmarks/results/<date>-<name>):

* :func:`plan_tiles`: BF16, forward and backward, by the load's mean rows per expert and the device;
* :func:`plan_tiles_fp8` / :func:`plan_tiles_fp8_bwd` / :func:`plan_tiles_mxfp8`: the FP8 formats, whose K step is
  fixed by the scale block;
* :func:`ping_pong_tile`: down's and dx's tiles where their K is short enough for the Gluon ping-pong;
* :func:`carry_tile`: the Triton wgrad's block when it carries across backward windows;
* :func:`tile_stages`: the megakernel's ring depth for a layer shape;
* :func:`wgrad_ws_stages`, :data:`WGRAD_MMA_IN_FLIGHT_STAGES`, :data:`WGRAD_FP8_WS_STAGES`: the Gluon wgrads' rings.

The ops ask for their tiles through :class:`megamoe.planner.tuning.Tuning`, which pins any of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megamoe import runtime
from megamoe.kernels.wgrad_blocks import HALF_M, SPLIT_N
from megamoe.precision import FP8_BLOCK


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


def plan_tiles(kind: str, device: torch.device, rows_per_expert: float | None = None, *,
               compiled: bool = False) -> TileConfig:
    """The tile shape for ``kind`` (one of :data:`GEMM_KINDS`) on ``device`` (``compiled``: the GPU's on any
    device, for the sm_90 build check and the plan's tests).

    GPU (H200, benchmarks/results/2026-11-29-expert-gemm-forward): 128-row
    tiles with 8 warps; gate/up computes a 128x128 gate and a 128x128 up tile
    (a 128x256 tile of h) so SwiGLU fits in the epilogue, 3 stages, groups of
    4 row tiles; down 128x256, 3 stages, groups of 8, and the flattened task
    loop (+2-5 %; it costs gate/up 15-20 %). 64-row tiles lost 25-35 % there
    (341- and 4096-row experts); the forward and the backward's dx take them when
    ``rows_per_expert`` (the load's mean) is at most :data:`FEW_ROWS_PER_EXPERT`, and the wgrad takes
    BK 64 there. The
    interpreter gets 32-row tiles 64 wide and deep: it runs one program at a time and each op of it in numpy, so
    wider tiles cost fewer ops (32x32x32 took the CPU suite 947 s on 2 cores, 32x64x64 762-884 s); 32 rows keep several
    row tiles an expert in the tests' small layers.
    """
    if kind not in GEMM_KINDS:
        raise ValueError(f"kind must be one of {GEMM_KINDS}, got {kind!r}")
    if not compiled and not runtime.compiled_gpu(device):
        return TileConfig(32, 64, 64, num_warps=4, num_stages=1)
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


#: K up to which Hopper runs down (K = I) and dx (K = 2I) in the Gluon ping-pong (each warpgroup whole 128 x 128
#: tiles in turn, one's stores under the other's wgmmas). One H100, the BF16 expert forward (gate/up + down) in
#: interleaved rounds (benchmarks/results/2026-12-07-ping-pong-down, tiles_ab.py): sonic-7b (I 256) 1.066 ->
#: 1.024-1.037 ms, qwen3-30b-a3b (I 768) 1.244 -> 1.191-1.210 against the Triton down; at I 2048 a tie at 256-row
#: experts (deepseek-v3 10.64 -> 10.50) and a loss at 2048-row ones (sonic-120b 10.20 -> 10.29-11.13), as on
#: kimi-k2's (2026-12-04-forward-ping-pong). dx: its K is 2I, the same products as down's at twice the steps.
PING_PONG_MAX_K = {"down": 1024, "dx": 2048}


def ping_pong_tile(kind: str, tile: TileConfig, k: int) -> TileConfig | None:
    """The ping-pong tile of ``kind`` ("down" or "dx") in place of its planned 128-row ``tile`` when its K = ``k`` is
    at most :data:`PING_PONG_MAX_K`, else None: 128 columns (a warpgroup holds two 64 x 128 accumulators) and 6 ring
    slots (a hand-over needs the next tile's first steps loaded: 4 slots ran 1-2 % slower than 5-6 at I 256-768)."""
    if kind not in PING_PONG_MAX_K:
        raise ValueError(f"ping-pong tiles are for {tuple(PING_PONG_MAX_K)}, got {kind!r}")
    if tile.block_m != 128 or k > PING_PONG_MAX_K[kind]:
        return None
    return dataclasses.replace(tile, block_n=128, num_stages=6)


def plan_tiles_fp8(kind: str, device: torch.device, rows_per_expert: float | None = None, *,
                   compiled: bool = False) -> TileConfig:
    """Tile shape of the FP8 ``kind`` ("gate_up" or "down"); BLOCK_K is always 128 (one scale per K step).

    GPU (``compiled``: on any device): 128-row tiles, 8 warps (two warpgroups of 64 rows); gate/up BLOCK_N = 128
    act columns (a gate and an up tile, one 1x128 act block per row); down 128x128 (a fresh 128x256 fp32 product
    per K step next to the accumulator would not fit the registers). Where ``rows_per_expert`` (the load's mean)
    is at most :data:`FEW_ROWS_PER_EXPERT`, gate/up takes 64-row tiles (one warpgroup): 10.6 %
    off the forward on ~170-row experts, while 64-row down tiles gained nothing there and both lost 11-21 %
    on 256- and 341-row experts (benchmarks/results/2026-12-03-fp8-few-rows). Interpreter: small row tiles.
    """
    if kind not in ("gate_up", "down"):
        raise ValueError(f"kind must be 'gate_up' or 'down', got {kind!r}")
    if not compiled and not runtime.compiled_gpu(device):
        return TileConfig(32, 128, 128, num_warps=4, num_stages=1)
    if kind == "gate_up" and rows_per_expert is not None and rows_per_expert <= FEW_ROWS_PER_EXPERT:
        return TileConfig(64, 128, 128, num_warps=4, num_stages=4, group_m=8)
    if kind == "gate_up":
        return TileConfig(128, 128, 128, num_warps=8, num_stages=3, group_m=4)
    return TileConfig(128, 128, 128, num_warps=8, num_stages=4, group_m=8)


def plan_tiles_mxfp8(kind: str, device: torch.device, *, compiled: bool = False) -> TileConfig:
    """Tile shape of the MXFP8 forward's ``kind`` ("gate_up" or "down"), dequantised on load.

    GPU (``compiled`` forces these, for the sm_90 build check on a CPU machine), picked from a CPU sweep of
    sm_90 builds (registers and ptxas spills, cuobjdump) for tiles that do not spill: gate/up 128 rows x 64
    act columns x BLOCK_K 64, 8 warps (233 registers; 128 columns spill 72 B: the dequantised gate and up
    tiles sit next to two 128x128 accumulators); down 128x128x64 (255 registers, no spill; 128x256
    spills). Interpreter: small row tiles.
    """
    if kind not in ("gate_up", "down"):
        raise ValueError(f"kind must be 'gate_up' or 'down', got {kind!r}")
    if not compiled and not runtime.compiled_gpu(device):
        return TileConfig(32, 64, 64, num_warps=4, num_stages=1)
    if kind == "gate_up":
        return TileConfig(128, 64, 64, num_warps=8, num_stages=3, group_m=4)
    return TileConfig(128, 128, 64, num_warps=8, num_stages=3, group_m=8)


def plan_tiles_fp8_bwd(kind: str, device: torch.device, fmt: str = "fp8-block", *,
                       compiled: bool = False) -> TileConfig:
    """Tiles of the FP8 backward's ``kind`` ("dact" or "wgrad") in ``fmt``. fp8-block: BLOCK_K 128 (one scale
    per K step), the forward FP8 down tile's shape; mxfp8: BLOCK_K 64 dequantised on load, 64-column dact
    tiles (the dequantised tiles beside the epilogue's). fp8-block's measured on an H200, mxfp8's not tuned
    yet. ``compiled`` gives the GPU's tiles on any device (the sm_90 build check)."""
    if kind not in ("dact", "wgrad"):
        raise ValueError(f"kind must be 'dact' or 'wgrad', got {kind!r}")
    if fmt not in ("fp8-block", "mxfp8"):
        raise ValueError(f"fmt must be 'fp8-block' or 'mxfp8', got {fmt!r}")
    bk = FP8_BLOCK if fmt == "fp8-block" else 64
    if not compiled and not runtime.compiled_gpu(device):
        return TileConfig(32, 64, bk, num_warps=4, num_stages=1)
    if fmt == "mxfp8":
        return TileConfig(128, 64 if kind == "dact" else 128, bk, num_warps=8, num_stages=3, group_m=8)
    if kind == "wgrad":
        # the flattened loop overlaps a block's store with the next block's loads: 24.8 against 27.3 ms for the
        # 341-row backward; 128x256 blocks, 4 stages and 64-row blocks were slower (2026-12-02-fp8-backward-tiles)
        return TileConfig(128, 128, bk, num_warps=8, num_stages=3, group_m=8, flatten=True)
    return TileConfig(128, 128, bk, num_warps=8, num_stages=4, group_m=8)


#: The Triton wgrad's widest block with a carry: the carry enters the MMA accumulator through a layout
#: conversion in shared memory beside the K ring (a 128 x 256 fp32 block is 128 KB: 294,944 B in all, over
#: Hopper's 232,448); 128 wide fits (163,872 B, no spills) and gives the same bits (an element's K sum does not
#: depend on the block's width; checked on an H200).
CARRY_BLOCK_N = 128


def carry_tile(tile: TileConfig) -> TileConfig:
    """The Triton wgrad's tile when it carries across windows (:data:`CARRY_BLOCK_N`)."""
    return dataclasses.replace(tile, block_n=min(tile.block_n, CARRY_BLOCK_N))


#: The most shared memory a Hopper block can have.
HOPPER_SHARED_BYTES = 227 * 1024


def wgrad_ws_stages(block_n: int, block_k: int, split_store: bool = False) -> int:
    """The BF16 Gluon wgrad's ring depth: the deepest ring of K steps (a 128 x ``block_k`` slot of a, a ``block_k`` x
    ``block_n`` one of b, two 8-byte mbarriers) that fits beside its two 64 x ``block_n`` bf16 output buffers: 6 at
    BK 32, 3 at BK 64 for 256-wide blocks; with ``split_store`` (four 64 x 64 buffers) 8 and 4. As deep as it fits
    because deeper ran faster: at BK 32 6 stages took 10.0 / 10.2 % off gate/up / down against 4 at ~341 rows per
    expert, equal to BK 64 x 3 at ~170 (benchmarks/results/2026-12-03-wgrad-ring-depth), and 4 took 21 % more than 6
    at deepseek-v3's 256 (benchmarks/results/2026-12-07-wgrad-phases)."""
    step = (2 * HALF_M.value * block_k + block_k * block_n) * 2 + 16
    out_cols = 2 * SPLIT_N.value if split_store else block_n  # split: two 64 x 64 buffers a consumer
    return (HOPPER_SHARED_BYTES - 2 * HALF_M.value * out_cols * 2) // step


#: The BF16 Gluon wgrad leaves one wgmma in flight (holding its slot a step longer) from this ring depth on: it
#: pays from 4 stages on (-1.2 to -1.4 % at 4), not at 3 (+2.6 to +4.2 %; 2026-12-03-wgrad-warp-specialized).
WGRAD_MMA_IN_FLIGHT_STAGES = 4
#: The Gluon FP8 wgrad's ring: the deepest that fits beside the two output buffers, 5 slots of 33 KB (an expert's
#: K loop is short: the producer runs ahead into the next blocks; 4 measured as fast,
#: 2026-12-04-fp8-dact-warp-specialized).
WGRAD_FP8_WS_STAGES = 5


#: The deepest ring of the megakernel's compute workers' tiles (4 x 48 KB of shared memory for every format's tiles).
MAX_TILE_STAGES = 4


def tile_stages(shape) -> int:
    """Ring depth of the megakernel's routed and shared tiles for a layer shape
    (:class:`~megamoe.planner.kernel_config.LayerShape`). Inside the megakernel the tiles
    wait longer for their TMA loads than the standalone kernels (ncu: +35 % of stall samples at gate/up's data
    wait). A fourth stage where experts hold more rows than :data:`FEW_ROWS_PER_EXPERT` on average: on kimi-k2's
    EP 2 load (192 experts x 341 rows) the BF16 compute workers ended 5-7 % sooner in two runs (FP8-block: a
    tie); at 170 rows they ended 6-7 % later (2026-12-04-megakernel-stages)."""
    return MAX_TILE_STAGES if shape.rows_per_expert > FEW_ROWS_PER_EXPERT else MAX_TILE_STAGES - 1
