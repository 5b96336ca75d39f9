"""The expert GEMM tests' loads: rows per expert laid out as regions with gaps between them, as dispatch leaves them.

A load is ``(counts per expert, gap rows between regions)``; :func:`regions` lays it out (expert ``e``'s rows start
at ``offsets[e] = sum(counts[:e]) + e * gap``, and 5 spare rows follow the last region), so a kernel that writes
outside its expert's rows shows up as written gap rows. Each test file draws its own tensors over the layout.
"""

from __future__ import annotations

import torch

# On a GPU machine the tests run compiled on the GPU; on the CPU under the interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

#: An empty expert, fewer rows than a tile, regions not aligned to the tile; all rows to one expert; a single row;
#: no rows at all.
LOADS = {
    "mixed": ([5, 0, 40, 33], 3),
    "one-expert": ([0, 70, 0], 0),
    "single-row": ([1], 0),
    "no-rows": ([0, 0], 0),
}

#: The FP8 backwards' loads: their wgrads quantise along the token axis in 128-row blocks, so the mixed load has an
#: expert of 140 rows (a partial last block, more than one K block of rows).
FP8_BACKWARD_LOADS = {
    "mixed": ([5, 0, 140, 33], 3),
    "one-expert": LOADS["one-expert"],
    "no-rows": LOADS["no-rows"],
}


def regions(counts: list[int], gap: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(counts_E, offsets_E, rows)`` of a load: int32 CPU tensors and the rows of the buffer that holds it."""
    offsets, cursor = [], 0
    for c in counts:
        offsets.append(cursor)
        cursor += c + gap
    return torch.tensor(counts, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32), cursor + 5


def in_regions(counts: torch.Tensor, offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """``[rows]`` bool on DEVICE: True on the rows of some expert's region, False on the gaps and spare rows."""
    mask = torch.zeros(rows, dtype=torch.bool, device=DEVICE)
    for o, c in zip(offsets.tolist(), counts.tolist()):
        mask[o : o + c] = True
    return mask


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The relative L1 error of ``a`` against ``b``, in FP32."""
    return float((a.float() - b.float()).abs().sum() / b.float().abs().sum().clamp_min(1e-30))
