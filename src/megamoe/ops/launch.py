"""What every standalone expert-GEMM launch shares: row-task launches, descriptors, kernel scratch.

A row-tile kernel takes the device-built tile map (:mod:`megamoe.routing.row_tiles`)
between its tensor arguments and its sizes; :func:`launch_row_tasks` builds the
map and launches the persistent grid. Kernels that make TMA descriptors in the
kernel need global scratch: :func:`scratch_allocator` gives it from torch.
"""

from __future__ import annotations

import contextlib

import torch
from triton.runtime import _allocation
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.planner.tiles import TileConfig
from megamoe.routing.row_tiles import build_row_tiles
from megamoe.runtime import interpreting


@contextlib.contextmanager
def scratch_allocator():
    """Within the block, Triton launches that need global scratch (descriptors made in the kernel) get it from torch.

    The caller's allocator (a context variable) comes back on exit.
    """
    token = _allocation._allocator.set(_torch_scratch)
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


def _torch_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # torch's caching allocator aligns to 512 bytes, beyond what TMA descriptors need (128)
    return torch.empty(size, dtype=torch.int8, device="cuda")


def flat_row_stride(t: torch.Tensor) -> int:
    """The row stride of contiguous ``t`` seen as ``[-1, t.shape[-1]]``, as the kernels read a 3-D scale tensor.

    Not ``t.stride(-2)``: a size-1 dimension's stride is arbitrary even in a tensor torch calls contiguous
    (fp8-block's ``[L, 1, I/128]`` down scales of D = 128, or a transposed view of ``[L, D/128, 1]``).
    ValueError for a tensor that is not contiguous (a hand-built pack's scales: nothing else checks them)."""
    if not t.is_contiguous():
        raise ValueError(f"a scale tensor must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")
    return t.shape[-1]


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, block)


def launch_row_tasks(kernel, cfg: TileConfig, programs: int, counts: torch.Tensor, offsets: torch.Tensor,
                     rows: int, head: tuple, tail: tuple, *, minibatch: int | None = None, **constexprs) -> None:
    """Launch a persistent row-tile kernel: ``kernel(*head, <tile map>, offsets, counts, *tail, ...)``.

    Every row-tile kernel takes the device-built tile map (see :func:`build_row_tiles`) between its
    tensor arguments (``head``) and its sizes (``tail``), and the tile constexprs it declares
    (FP8-block kernels fix BLOCK_K at 128 and do not take it).
    """
    row_tiles = build_row_tiles(counts, offsets, rows, cfg.block_m, minibatch=minibatch)
    tile = dict(DOT_FP32=interpreting(), NUM_PROGRAMS=programs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, FLATTEN=cfg.flatten)
    kernel[(programs,)](
        *head, row_tiles.tile_expert, row_tiles.tile_row0, row_tiles.tile_row_end, row_tiles.tile_run,
        row_tiles.num_tiles, *tail,
        **{name: value for name, value in tile.items() if name in kernel.arg_names},
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **constexprs,
    )
