"""Row tiles: the expert GEMMs' work list over schedule-grouped rows, built on the device.

Every expert region ``[offsets[l], offsets[l] + counts[l])`` is cut into tiles
of at most ``block_m`` rows (and, with a minibatch that cuts, at minibatch
boundaries). Sizes are static (no host sync); the megakernel and the
standalone expert kernels walk the same tiles, which is why their results
have the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from megamoe.kernels import schedule as schedule_kernels


@dataclass(frozen=True)
class RowTiles:
    """Row tiles of every expert region, built on the device (no host sync: sizes are static).

    A tile is at most ``block_m`` consecutive rows of one expert region and, with a minibatch
    that cuts, of one minibatch ``[j * minibatch, (j + 1) * minibatch)`` of the routed rows.
    Tiles are ordered by minibatch, then expert, then row. Uncut, tiles are the regions' alone
    and minibatch j's tiles are those whose first row lies in it (a tile may reach into j + 1).

    Attributes:
        tile_expert: int32 `[max_tiles]` local expert of tile t (valid for t < num_tiles).
        tile_row0: int32 `[max_tiles]` first row of tile t.
        tile_row_end: int32 `[max_tiles]` one past its last row (region end, row0 + block_m or, cut, minibatch end).
        tile_run: int32 `[max_tiles, 2]` the first tile and one past the last of tile t's run: its expert's
            tiles in its minibatch (consecutive). The kernels group tasks inside runs.
        num_tiles: int32 `[1]` tiles in use.
        minibatch_tiles: int32 `[num_minibatches + 1]` tiles of minibatch j are
            ``[minibatch_tiles[j], minibatch_tiles[j + 1])``.
        block_m: rows per tile.
    """

    tile_expert: torch.Tensor
    tile_row0: torch.Tensor
    tile_row_end: torch.Tensor
    tile_run: torch.Tensor
    num_tiles: torch.Tensor
    minibatch_tiles: torch.Tensor
    block_m: int


def build_row_tiles(
    counts: torch.Tensor, offsets: torch.Tensor, capacity: int, block_m: int, *, minibatch: int | None = None,
    cut: bool | torch.Tensor = True, backend: str | None = None,
) -> RowTiles:
    """Tiles of ``block_m`` rows per expert region (and per minibatch of rows, when given and ``cut``).

    ``cut=False``: the regions' tiles alone, minibatch j holding those that start in it; ``cut`` may be a
    one-element device tensor (nonzero: cut), read on the device (the megakernel cuts only when its ring
    wraps). ``backend``: ``"triton"`` (one launch, `megamoe.kernels.schedule.row_tiles_kernel`) or
    ``"torch"`` (~15 torch ops); None picks triton on a GPU and torch on the CPU. Both give the same tiles;
    entries past ``num_tiles`` are unspecified.
    """
    if backend is None:
        backend = "triton" if counts.is_cuda else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")
    minibatch = minibatch or max(capacity, 1)
    batches = max(1, -(-capacity // minibatch))
    if backend == "triton":
        return _row_tiles_by_kernel(counts, offsets, capacity, block_m, minibatch, batches, cut)
    if not isinstance(cut, torch.Tensor):
        return _row_tiles_by_torch(counts, offsets, capacity, block_m, minibatch, batches, cut)
    a, b = (_row_tiles_by_torch(counts, offsets, capacity, block_m, minibatch, batches, c) for c in (True, False))
    flag = cut.reshape(1) != 0
    return RowTiles(*(torch.where(flag, x, y) for x, y in zip(
        (a.tile_expert, a.tile_row0, a.tile_row_end, a.tile_run, a.num_tiles, a.minibatch_tiles),
        (b.tile_expert, b.tile_row0, b.tile_row_end, b.tile_run, b.num_tiles, b.minibatch_tiles))), block_m)


def _row_tiles_by_torch(counts, offsets, capacity: int, block_m: int, minibatch: int, batches: int,
                        cut: bool) -> RowTiles:
    device = counts.device
    experts = counts.numel()
    # segment (j, l) = region l ∩ minibatch j, in minibatch-major order (uncut: one span of every row)
    span = minibatch if cut else max(capacity, 1)
    spans = batches if cut else 1
    start = offsets.long()
    end = start + counts.long()
    batch_start = torch.arange(spans, device=device)[:, None] * span
    seg_start = torch.maximum(start[None, :], batch_start)
    seg_end = torch.minimum(end[None, :], batch_start + span)
    seg_tiles = ((seg_end - seg_start).clamp_min(0) + block_m - 1) // block_m  # [spans, L]
    ends = seg_tiles.reshape(-1).cumsum(0)
    max_tiles = -(-capacity // block_m) + experts + batches
    tile = torch.arange(max_tiles, device=device)
    segment = torch.searchsorted(ends, tile, right=True).clamp_max(max(spans * experts - 1, 0))
    first = ends - seg_tiles.reshape(-1)
    row0 = seg_start.reshape(-1)[segment] + (tile - first[segment]) * block_m if experts else tile * 0
    row_end = torch.minimum(row0 + block_m, seg_end.reshape(-1)[segment]) if experts else tile * 0
    if cut:
        zero = torch.zeros(1, dtype=torch.long, device=device)
        minibatch_tiles = torch.cat([zero, seg_tiles.sum(1).cumsum(0)]).to(torch.int32)
    else:  # tiles before minibatch j: those of each region starting before j * minibatch
        lo = torch.arange(batches + 1, device=device)[:, None] * minibatch
        before = ((torch.minimum(end[None, :], lo) - start[None, :]).clamp_min(0) + block_m - 1) // block_m
        minibatch_tiles = before.sum(1).to(torch.int32)
    num_tiles = minibatch_tiles[-1:].clone()
    # a run is a segment's tiles inside one minibatch's (uncut, a region's tiles may start in several)
    batch = (torch.searchsorted(minibatch_tiles, tile.to(torch.int32), right=True) - 1).clamp(0, batches - 1)
    run_first = torch.maximum(first[segment], minibatch_tiles[batch].long()) if experts else tile * 0
    run_end = torch.minimum(ends[segment], minibatch_tiles[batch + 1].long()) if experts else tile * 0
    return RowTiles((segment % max(experts, 1)).to(torch.int32), row0.to(torch.int32), row_end.to(torch.int32),
                    torch.stack([run_first, run_end], 1).to(torch.int32), num_tiles, minibatch_tiles, block_m)


def _row_tiles_by_kernel(counts, offsets, capacity: int, block_m: int, minibatch: int, batches: int,
                         cut: bool | torch.Tensor) -> RowTiles:
    experts, device = counts.numel(), counts.device
    max_tiles = -(-capacity // block_m) + experts + batches
    tile_expert, tile_row0, tile_row_end = (torch.empty(max_tiles, dtype=torch.int32, device=device)
                                            for _ in range(3))
    tile_run = torch.empty(max_tiles, 2, dtype=torch.int32, device=device)
    new = torch.empty if experts else torch.zeros  # the kernel writes every entry of these two
    num_tiles = new(1, dtype=torch.int32, device=device)
    minibatch_tiles = new(batches + 1, dtype=torch.int32, device=device)
    if experts:
        flag = cut if isinstance(cut, torch.Tensor) else counts  # never read with a constant CUT
        schedule_kernels.row_tiles_kernel[(batches,)](
            counts, offsets, flag, tile_expert, tile_row0, tile_row_end, tile_run, num_tiles, minibatch_tiles, experts,
            batches, minibatch, block_m, EXPERTS=triton.next_power_of_2(experts),
            CUT=-1 if isinstance(cut, torch.Tensor) else int(cut))
    return RowTiles(tile_expert, tile_row0, tile_row_end, tile_run, num_tiles, minibatch_tiles, block_m)
