"""The copy tile of the communication kernels: how many rows, how many 16-byte vectors per warp (its tuning,
:class:`~megamoe.planner.tuning.CommTuning`, lives in the planner)."""

from __future__ import annotations

import math

from megamoe.planner.tuning import CommTuning


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
