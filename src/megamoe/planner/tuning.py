"""The one override of the planner's tuning rules: :class:`Tuning`, and the communication kernels' copy tile.

Every op that plans tiles takes ``tuning=`` (None: the planner's rules, :mod:`megamoe.planner.tiles`); tests and
benchmarks pin a path by passing one (``Tuning(gate_up=TileConfig(...))``, ``Tuning(compiled=True)``) instead of
patching module constants.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe.checks import is_int
from megamoe.planner.tiles import (TileConfig, plan_tiles, plan_tiles_fp8, plan_tiles_fp8_bwd, plan_tiles_mxfp8)


@dataclass(frozen=True)
class CommTuning:
    """Tile shape of the communication kernels (see ``megamoe.kernels.comm``).

    Attributes:
        tile_rows: rows moved per tile (a 14 KB kimi-k2 row per warp at the
            default: 112 KB of loads in flight per program).
        num_warps: warps per program (ignored by the interpreter).

    With ``tile_rows == num_warps`` each warp holds one row, so a thread
    works out the row's source and destination once for all of its 16-byte
    vectors (fewer rows: warps share a row's chunks; more: each thread holds
    several rows, in more registers). The chunked tiles before (64 x 1024
    elements, 16 warps) redid that arithmetic for every vector: 2-3.6x
    slower per program (benchmarks/results/2026-11-30-row-tiles).
    """

    tile_rows: int = 8
    num_warps: int = 8

    def __post_init__(self) -> None:
        for name, lo, hi in (("tile_rows", 1, 64), ("num_warps", 1, 32)):
            value = getattr(self, name)
            if not is_int(value) or not lo <= value <= hi or value & (value - 1):
                raise ValueError(f"CommTuning.{name} must be a power of two in [{lo}, {hi}], got {value!r}")

    def label(self) -> str:
        """A short name: ``8r 8w``."""
        return f"{self.tile_rows}r {self.num_warps}w"


#: The megakernel's communication workers' copy tile: one row per warp of the kernel's 8 warps (E4M3 rows and the
#: scales get the same rows per tile; narrower rows give more of them).
COMM_TUNING = CommTuning(tile_rows=8)

#: The formats whose tiles :meth:`Tuning.tile` plans.
TILE_FORMATS = ("bf16", "fp8-block", "mxfp8")


@dataclass(frozen=True)
class Tuning:
    """Overrides of the planner's choices; a field left None (every field, by default) leaves its rule in charge.

    Attributes:
        gate_up, down, dact, dx, wgrad: the tiles of that GEMM kind, in the format the op runs (its checks
            apply: FP8-block needs BLOCK_K 128, ...). In the megakernel, gate_up and down pin the routed experts'
            tiles (the shared expert's stay planned).
        compiled: plan the GPU's tiles on any device (``compiled=`` of the planners: the sm_90 build check and
            the plan's tests run on a CPU).
        megakernel_stages: the megakernel's tile ring depth (default ``tiles.tile_stages`` of the layer shape).
        comm: the megakernel's communication copy tile (default :data:`COMM_TUNING`).
    """

    gate_up: TileConfig | None = None
    down: TileConfig | None = None
    dact: TileConfig | None = None
    dx: TileConfig | None = None
    wgrad: TileConfig | None = None
    compiled: bool = False
    megakernel_stages: int | None = None
    comm: CommTuning | None = None

    def __post_init__(self) -> None:
        for kind in ("gate_up", "down", "dact", "dx", "wgrad"):
            value = getattr(self, kind)
            if value is not None and not isinstance(value, TileConfig):
                raise ValueError(f"Tuning.{kind} must be a TileConfig or None, got {value!r}")
        if self.megakernel_stages is not None and (not is_int(self.megakernel_stages) or self.megakernel_stages < 1):
            raise ValueError(f"Tuning.megakernel_stages must be a positive int or None, got {self.megakernel_stages!r}")
        if self.comm is not None and not isinstance(self.comm, CommTuning):
            raise ValueError(f"Tuning.comm must be a CommTuning or None, got {self.comm!r}")

    def tile(self, kind: str, device: torch.device, rows_per_expert: float | None = None, *,
             fmt: str = "bf16") -> TileConfig:
        """The tiles of ``kind`` in ``fmt`` (one of :data:`TILE_FORMATS`): this object's when pinned, else the
        planner's for ``rows_per_expert`` (the load's mean; BF16 and FP8-block forward tiles depend on it) on
        ``device``. FP8 formats: "gate_up" and "down" are the forward's, "dact" and "wgrad" the backward's (its dx
        runs the forward's down)."""
        pinned = getattr(self, kind, None) if kind in ("gate_up", "down", "dact", "dx", "wgrad") else None
        if pinned is not None:
            return pinned
        if fmt == "bf16":
            return plan_tiles(kind, device, rows_per_expert, compiled=self.compiled)
        if fmt not in TILE_FORMATS:
            raise ValueError(f"fmt must be one of {TILE_FORMATS}, got {fmt!r}")
        if kind in ("dact", "wgrad"):
            return plan_tiles_fp8_bwd(kind, device, fmt, compiled=self.compiled)
        if fmt == "fp8-block":
            return plan_tiles_fp8(kind, device, rows_per_expert, compiled=self.compiled)
        return plan_tiles_mxfp8(kind, device, compiled=self.compiled)


#: The planner's rules, nothing pinned.
DEFAULT_TUNING = Tuning()
