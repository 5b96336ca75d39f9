"""The copy tile of the communication kernels: how many rows, how many 16-byte vectors per warp."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megamoe.checks import is_int


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


def copy_tile(width: int, esize: int, tuning: CommTuning, *, min_block: int = 1) -> tuple[int, int, int, int, int]:
    """(CHUNKS, CP, W, ROWS, ALIGN) of the row tiles of rows of ``width`` elements of ``esize`` bytes.

    W: a warp's 16-byte vectors (512 bytes) or, for narrower rows, the largest
    power of two dividing the width; a row is CHUNKS = width / W pieces of W,
    CP the next power of two. ROWS grows as W shrinks below 512 bytes, so a
    tile of narrow rows (fp8 scales) keeps about as many vectors in flight.
    ALIGN: the element alignment every row start shares (16 bytes when the row allows).
    """
    wide = 512 // esize
    w = min(width & -width, wide)
    if w < min_block:
        raise ValueError(f"rows of {width} elements cannot be split into blocks of {min_block}")
    chunks = width // w
    rows = min(256, tuning.tile_rows * (wide // w))
    align = math.gcd(width, w, max(1, 16 // esize))
    return chunks, 1 << (chunks - 1).bit_length(), w, rows, align
