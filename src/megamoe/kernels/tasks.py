"""How persistent programs deal their tasks: the one copy of each task map, inlined by the Triton and Gluon
expert kernels and both megakernels.

    first_task      the first task of a list that worker c of ``workers`` takes, round robin, when ``dealt`` tasks
                    were dealt before it (a megakernel's lists one after another; a wgrad's expert-major blocks)
    grouped_task    task -> (row tile, n-tile) over one run of tiles: groups of GROUP_M row tiles, n-tile outer
    row_tile_task   the same over the device-built row tiles (``megamoe.routing.row_tiles``), run by run
    tile_task       row_tile_task's tile read back as (expert, row0, row_end, n-tile)

The loops around them stay in each kernel: each interleaves its own waits, counters and tile call with the task
(a shell taking the tile function as a constexpr would need each tile's arguments packed into tuples around the
task's, hiding which tile runs with what).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def first_task(c, workers, dealt):
    """The first task of a list that worker c takes when ``dealt`` tasks were dealt before it (round robin)."""
    return (c + workers - dealt % workers) % workers


@triton.jit
def grouped_task(task, num_n, num_tiles, GROUP_M: tl.constexpr):
    """Task -> (row tile, n-tile) over one run of num_tiles tiles: groups of GROUP_M consecutive row tiles,
    n-tile outer inside a group."""
    group_size = GROUP_M * num_n
    group = task // group_size
    first = group * GROUP_M
    rows_in_group = tl.minimum(num_tiles - first, GROUP_M)
    within = task - group * group_size
    return first + within % rows_in_group, within // rows_in_group


@triton.jit
def row_tile_task(task, num_n, t0, tile_run_ptr, GROUP_M: tl.constexpr):
    """Task -> (row tile, n-tile) over the tiles from t0 on, run by run (``grouped_task`` inside each).

    Run [first, end) owns tasks [(first - t0) * num_n, (end - t0) * num_n), so t0 + task // num_n is one
    of its tiles. Groups never straddle experts: straddling ones re-read a third of the weights from HBM
    (benchmarks/results/2026-12-03-task-order)."""
    t = t0 + task // num_n
    first = tl.load(tile_run_ptr + 2 * t)
    end = tl.load(tile_run_ptr + 2 * t + 1)
    tile, n = grouped_task(task - (first - t0) * num_n, num_n, end - first, GROUP_M)
    return first + tile, n


@triton.jit
def tile_task(task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, GROUP_M: tl.constexpr):
    """Task -> (expert, row0, row_end, n-tile) in ``row_tile_task`` order."""
    tile, n = row_tile_task(task, num_n, 0, tile_run_ptr, GROUP_M)
    expert = tl.load(tile_expert_ptr + tile)
    row0 = tl.load(tile_row0_ptr + tile)
    row_end = tl.load(tile_row_end_ptr + tile)
    return expert, row0, row_end, n
