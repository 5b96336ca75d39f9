"""``dst[q] = src[index[q]]`` for the first ``num_rows`` rows, ``num_rows`` a device count (no host sync): the launch
of ``megamoe.kernels.gather_rows`` and its torch twin."""

from __future__ import annotations

import torch

from megamoe.kernels.gather_rows import gather_rows_kernel
from megamoe.runtime import compiled_gpu

#: Rows x bytes of a program's block: 16-byte vectors across a row, a few rows in flight.
BLOCK_ROWS, BLOCK_BYTES = 16, 2048


def gather_rows(src: torch.Tensor, index: torch.Tensor, num_rows: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Rows ``q < num_rows`` of ``dst`` `[R, C]` from ``src`` `[S, C]` rows ``index[q]`` (int64 `[>= R]`, each in
    ``[0, S)``); rows at and past ``num_rows`` untouched. ``num_rows`` is a 0-d integer tensor on the device."""
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1] or src.dtype != dst.dtype:
        raise ValueError(f"src and dst must be 2-D of one width and dtype, got {tuple(src.shape)} {src.dtype} and "
                         f"{tuple(dst.shape)} {dst.dtype}")
    if src.stride(1) != 1 or dst.stride(1) != 1 or index.dtype != torch.int64 or index.numel() < dst.shape[0]:
        raise ValueError("rows must be contiguous and index int64 with a row per dst row")
    if dst.shape[0] == 0 or dst.shape[1] == 0:
        return dst
    width = dst.shape[1]
    block_c = min(BLOCK_BYTES // dst.element_size(), 1 << (width - 1).bit_length()) if compiled_gpu(dst.device) else \
        min(256, 1 << (width - 1).bit_length())
    grid = (-(-dst.shape[0] // BLOCK_ROWS), -(-width // block_c))
    gather_rows_kernel[grid](src, src.stride(0), index, dst, dst.stride(0), num_rows, width, BLOCK_R=BLOCK_ROWS,
                             BLOCK_C=block_c, num_warps=4)
    return dst


def gather_rows_reference(src: torch.Tensor, index: torch.Tensor, num_rows: int, dst: torch.Tensor) -> torch.Tensor:
    """The torch twin (reads ``num_rows`` on the host)."""
    dst[:num_rows] = src[index[:num_rows]]
    return dst
