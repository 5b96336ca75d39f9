"""Expert FFNs over schedule-grouped rows: tile planning, launches and the torch twin.

The routed buffer holds rows grouped by local expert, as the pull schedule
lays them out: expert l owns rows ``[offsets[l], offsets[l] + counts[l])``.
:func:`expert_forward` runs gate/up + SwiGLU and down on every region with
persistent Triton kernels (`megamoe.kernels.expert_gemm`); the task list is
built on the device, so empty experts cost nothing and nothing syncs the
host. :func:`expert_forward_reference` is the plain-PyTorch twin.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass

import torch
import triton
from triton.runtime import _allocation
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe import checks
from megamoe.kernels import expert_gemm, expert_gemm_bwd
from megamoe.kernels import schedule as schedule_kernels
from megamoe.reference import expert_ffn, swiglu


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


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Partial tiles read rows past an expert region (their results are masked at the store); under the
# interpreter numpy warns about whatever values those rows hold. The warning says nothing about results.
warnings.filterwarnings("ignore", message="(overflow|invalid value) encountered", category=RuntimeWarning,
                        module="triton.runtime.interpreter")


#: The GEMMs of the expert FFN: forward gate/up and down; backward dact, dx and wgrad.
GEMM_KINDS = ("gate_up", "down", "dact", "dx", "wgrad")


#: Forward tiles of 64 rows (one warpgroup, 4 stages) when experts hold at most this many rows on average:
#: ~170-row experts (kimi-k2 at EP 1) ran 4 % faster than with 128-row tiles, ~256-row ones 9 % slower
#: (benchmarks/results/2026-11-30-replay, tiles_ab.py; 128-row tiles compute 256 rows of a 170-row expert,
#: 64-row ones 192).
FEW_ROWS_PER_EXPERT = 192


def plan_tiles(kind: str, device: torch.device, rows_per_expert: float | None = None) -> TileConfig:
    """The tile shape for ``kind`` (one of :data:`GEMM_KINDS`) on ``device``.

    GPU (H200, benchmarks/results/2026-11-29-expert-gemm-forward): 128-row
    tiles with 8 warps; gate/up computes a 128x128 gate and a 128x128 up tile
    (a 128x256 tile of h) so SwiGLU fits in the epilogue, 3 stages, groups of
    4 row tiles; down 128x256, 3 stages, groups of 8, and the flattened task
    loop (+2-5 %; it costs gate/up 15-20 %). 64-row tiles lost 25-35 % there
    (341- and 4096-row experts); the forward takes them when ``rows_per_expert``
    (the load's mean) is at most :data:`FEW_ROWS_PER_EXPERT`. The
    interpreter gets small tiles: it runs one program at a time.
    """
    if kind not in GEMM_KINDS:
        raise ValueError(f"kind must be one of {GEMM_KINDS}, got {kind!r}")
    if device.type != "cuda" or interpreting():
        return TileConfig(32, 32, 32, num_warps=4, num_stages=1)
    few = rows_per_expert is not None and rows_per_expert <= FEW_ROWS_PER_EXPERT
    if kind == "gate_up" and few:
        return TileConfig(64, 128, 64, num_warps=4, num_stages=4, group_m=8)
    if kind == "down" and few:
        return TileConfig(64, 256, 64, num_warps=4, num_stages=4, group_m=8, flatten=True)
    if kind == "gate_up":
        return TileConfig(128, 128, 64, num_warps=8, num_stages=3, group_m=4)
    if kind in ("down", "dx"):
        return TileConfig(128, 256, 64, num_warps=8, num_stages=3, group_m=8, flatten=kind == "down")
    if kind == "wgrad":
        # K runs over an expert's rows: 128x256 blocks halve the fills and stores per FLOP of 128x128
        # (-22 %), BK 32 pads a 341-row expert to 352 rows instead of 384, and the flattened loop
        # overlaps a block's store with the next block's loads (2026-11-30-wgrad).
        return TileConfig(128, 256, 32, num_warps=8, num_stages=5, group_m=8, flatten=True)
    # dact: a heavy epilogue (loads h, writes d_h and act_w); 4 stages measured 11-18 % faster than 3.
    return TileConfig(128, 128, 64, num_warps=8, num_stages=4, group_m=8)


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
        num_tiles: int32 `[1]` tiles in use.
        minibatch_tiles: int32 `[num_minibatches + 1]` tiles of minibatch j are
            ``[minibatch_tiles[j], minibatch_tiles[j + 1])``.
        block_m: rows per tile.
    """

    tile_expert: torch.Tensor
    tile_row0: torch.Tensor
    tile_row_end: torch.Tensor
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
        (a.tile_expert, a.tile_row0, a.tile_row_end, a.num_tiles, a.minibatch_tiles),
        (b.tile_expert, b.tile_row0, b.tile_row_end, b.num_tiles, b.minibatch_tiles))), block_m)


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
    return RowTiles((segment % max(experts, 1)).to(torch.int32), row0.to(torch.int32), row_end.to(torch.int32),
                    num_tiles, minibatch_tiles, block_m)


def _row_tiles_by_kernel(counts, offsets, capacity: int, block_m: int, minibatch: int, batches: int,
                         cut: bool | torch.Tensor) -> RowTiles:
    experts, device = counts.numel(), counts.device
    max_tiles = -(-capacity // block_m) + experts + batches
    tile_expert, tile_row0, tile_row_end = (torch.empty(max_tiles, dtype=torch.int32, device=device)
                                            for _ in range(3))
    new = torch.empty if experts else torch.zeros  # the kernel writes every entry of these two
    num_tiles = new(1, dtype=torch.int32, device=device)
    minibatch_tiles = new(batches + 1, dtype=torch.int32, device=device)
    if experts:
        flag = cut if isinstance(cut, torch.Tensor) else counts  # never read with a constant CUT
        schedule_kernels.row_tiles_kernel[(batches,)](
            counts, offsets, flag, tile_expert, tile_row0, tile_row_end, num_tiles, minibatch_tiles, experts,
            batches, minibatch, block_m, EXPERTS=triton.next_power_of_2(experts),
            CUT=-1 if isinstance(cut, torch.Tensor) else int(cut))
    return RowTiles(tile_expert, tile_row0, tile_row_end, num_tiles, minibatch_tiles, block_m)


@dataclass
class ExpertForward:
    """What the forward expert compute leaves: `h [R, 2I]` (kept for the backward), `act [R, I]`, `y [R, D]`.

    Only rows inside expert regions are written.
    """

    h: torch.Tensor
    act: torch.Tensor
    y: torch.Tensor


@dataclass
class ExpertForwardQuantized:
    """Outputs of a forward on FP8 operands (FP8-block or MXFP8): `h [R, 2I]` bf16 (None when not
    stored), `act_q [R, I]` E4M3 with `act_scale` (the down GEMM's input, quantised along I: fp32
    `[R, I/128]` for FP8-block, E8M0 uint8 `[R, I/32]` for MXFP8), `y [R, D]` bf16. Only rows inside
    expert regions are written."""

    h: torch.Tensor | None
    act_q: torch.Tensor
    act_scale: torch.Tensor
    y: torch.Tensor

    @classmethod
    def given_or_empty(cls, out: ExpertForwardQuantized | None, rows: int, intermediate: int, hidden: int,
                       scale_block: int, scale_dtype: torch.dtype, device: torch.device,
                       store_h: bool) -> ExpertForwardQuantized:
        """``out``, or new uninitialised outputs for ``rows`` rows (h only with ``store_h``); ValueError when
        ``store_h`` and ``out`` has no h."""
        if out is None:
            out = cls(
                h=torch.empty(rows, 2 * intermediate, dtype=torch.bfloat16, device=device) if store_h else None,
                act_q=torch.empty(rows, intermediate, dtype=torch.float8_e4m3fn, device=device),
                act_scale=torch.empty(rows, intermediate // scale_block, dtype=scale_dtype, device=device),
                y=torch.empty(rows, hidden, dtype=torch.bfloat16, device=device),
            )
        if store_h and out.h is None:
            raise ValueError("store_h=True needs out.h")
        return out


def _check(x_rows, counts, offsets, w_gate_up, w_down) -> tuple[int, int, int]:
    if x_rows.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError("x_rows must be [R, D], w_gate_up [L, 2I, D] and w_down [L, D, I]")
    experts, two_i, d = w_gate_up.shape
    i = two_i // 2
    if x_rows.shape[1] != d or tuple(w_down.shape) != (experts, d, i) or two_i % 2:
        raise ValueError(
            f"shapes disagree: x_rows {tuple(x_rows.shape)}, w_gate_up {tuple(w_gate_up.shape)}, "
            f"w_down {tuple(w_down.shape)}"
        )
    if tuple(counts.shape) != (experts,) or tuple(offsets.shape) != (experts,):
        raise ValueError(f"counts and offsets must be [{experts}], got {tuple(counts.shape)}, {tuple(offsets.shape)}")
    for name, t in (("x_rows", x_rows), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be bfloat16, got {t.dtype}")
        if t.device != x_rows.device:
            raise ValueError(f"{name} is on {t.device}, x_rows on {x_rows.device}")
    if i % 8:
        raise ValueError(f"the intermediate size I must be a multiple of 8 (16-byte rows), got {i}")
    return experts, i, d


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


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, block)


def _num_programs(device: torch.device, requested: int | None) -> int:
    if requested is not None:
        if requested < 1:
            raise ValueError(f"num_programs must be >= 1, got {requested}")
        return requested
    if device.type == "cuda" and not interpreting():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


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
        *head, row_tiles.tile_expert, row_tiles.tile_row0, row_tiles.tile_row_end, row_tiles.num_tiles, *tail,
        **{name: value for name, value in tile.items() if name in kernel.arg_names},
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **constexprs,
    )


def expert_forward(
    x_rows: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
    num_programs: int | None = None,
    out: ExpertForward | None = None,
    tiles: dict[str, TileConfig] | None = None,
    minibatch: int | None = None,
) -> ExpertForward:
    """Gate/up + SwiGLU and down for every expert region of ``x_rows`` (BF16).

    Args:
        x_rows: bf16 `[R, D]` routed rows, grouped by local expert.
        counts: int `[L]` rows of each expert; offsets: int `[L]` region starts.
        w_gate_up: bf16 `[L, 2I, D]`; w_down: bf16 `[L, D, I]`; I a multiple of 8.
        num_programs: persistent grid size (default: the SM count).
        out: preallocated outputs to fill (rows outside regions are left alone).
        tiles: {"gate_up": TileConfig, "down": TileConfig} to pin tile shapes.
        minibatch: also cut tiles at multiples of this many rows (the megakernel's minibatches);
            the result is the same bits.
    """
    experts, i, d = _check(x_rows, counts, offsets, w_gate_up, w_down)
    rows = x_rows.shape[0]
    device = x_rows.device
    if out is None:
        out = ExpertForward(
            h=torch.empty(rows, 2 * i, dtype=torch.bfloat16, device=device),
            act=torch.empty(rows, i, dtype=torch.bfloat16, device=device),
            y=torch.empty(rows, d, dtype=torch.bfloat16, device=device),
        )
    tiles = tiles or {}
    gate_up(x_rows, counts, offsets, w_gate_up, out.h, out.act, swiglu_limit=swiglu_limit,
            num_programs=num_programs, tiles=tiles.get("gate_up"), minibatch=minibatch)
    down(out.act, counts, offsets, w_down, out.y, num_programs=num_programs, tiles=tiles.get("down"),
         minibatch=minibatch)
    return out


def gate_up(
    x_rows: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    w_gate_up: torch.Tensor,
    h: torch.Tensor,
    act: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
    num_programs: int | None = None,
    tiles: TileConfig | None = None,
    minibatch: int | None = None,
) -> None:
    """h = x_rows · w_gate_upᵀ and act = SwiGLU(h) on every expert region (one persistent launch)."""
    experts, two_i, d = w_gate_up.shape
    i = two_i // 2
    rows = x_rows.shape[0]
    if rows == 0 or experts == 0:
        return
    cfg = tiles or plan_tiles("gate_up", x_rows.device)
    launch_row_tasks(
        expert_gemm.gate_up_kernel, cfg, _num_programs(x_rows.device, num_programs),
        counts.to(torch.int32), offsets.to(torch.int32), rows,
        head=(_descriptor(x_rows, [cfg.block_m, cfg.block_k]),
              _descriptor(w_gate_up.view(experts * 2 * i, d), [cfg.block_n, cfg.block_k]),
              h, act, h.stride(0), act.stride(0)),
        tail=(i, d, float(swiglu_limit or 0.0)),
        minibatch=minibatch,
        HAS_LIMIT=swiglu_limit is not None,
    )


def down(
    act: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    w_down: torch.Tensor,
    y: torch.Tensor,
    *,
    num_programs: int | None = None,
    tiles: TileConfig | None = None,
    minibatch: int | None = None,
) -> None:
    """y = act · w_downᵀ on every expert region (one persistent launch)."""
    experts, d, i = w_down.shape
    rows = act.shape[0]
    if rows == 0 or experts == 0:
        return
    cfg = tiles or plan_tiles("down", act.device)
    launch_row_tasks(
        expert_gemm.down_kernel, cfg, _num_programs(act.device, num_programs),
        counts.to(torch.int32), offsets.to(torch.int32), rows,
        head=(_descriptor(act, [cfg.block_m, cfg.block_k]),
              _descriptor(w_down.view(experts * d, i), [cfg.block_n, cfg.block_k]), y, y.stride(0)),
        tail=(d, i),
        minibatch=minibatch,
    )


def expert_forward_reference(
    x_rows: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
) -> ExpertForward:
    """The torch twin of :func:`expert_forward` in FP32 (rows outside regions stay NaN)."""
    i, d = w_gate_up.shape[1] // 2, w_gate_up.shape[2]
    rows = x_rows.shape[0]
    nan = dict(dtype=torch.float32, device=x_rows.device)
    out = ExpertForward(torch.full((rows, 2 * i), float("nan"), **nan), torch.full((rows, i), float("nan"), **nan),
                        torch.full((rows, d), float("nan"), **nan))
    for l, (start, count) in enumerate(zip(offsets.tolist(), counts.tolist())):
        x = x_rows[start : start + count].float()
        h = x @ w_gate_up[l].float().T
        out.h[start : start + count] = h
        out.act[start : start + count] = swiglu(h, swiglu_limit)
        out.y[start : start + count] = expert_ffn(x, w_gate_up[l].float(), w_down[l].float(), swiglu_limit)
    return out


@dataclass
class ExpertGrads:
    """Gradients of the expert FFNs: `d_x [R, D]` and `d_router [R]` per routed row (rows outside
    regions undefined), `d_w_gate_up [L, 2I, D]` and `d_w_down [L, D, I]` (every expert written)."""

    d_x: torch.Tensor
    d_router: torch.Tensor
    d_w_gate_up: torch.Tensor
    d_w_down: torch.Tensor


def expert_backward(
    dy_rows: torch.Tensor,
    row_weights: torch.Tensor,
    x_rows: torch.Tensor,
    h: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
    num_programs: int | None = None,
    tiles: dict[str, TileConfig] | None = None,
) -> ExpertGrads:
    """Backward of :func:`expert_forward` for routed rows (BF16; see `megamoe.kernels.expert_gemm_bwd`).

    Args:
        dy_rows: bf16 `[R, D]` upstream gradient of each row's token, not scaled by its router weight.
        row_weights: float32 `[R]` router weight of each row's route.
        x_rows: bf16 `[R, D]` the forward's input rows; h: bf16 `[R, 2I]` its saved pre-activation.
        counts, offsets, w_gate_up, w_down: as in :func:`expert_forward`.
    """
    experts, i, d = _check(x_rows, counts, offsets, w_gate_up, w_down)
    rows = x_rows.shape[0]
    device = x_rows.device
    # contiguous: the wgrad kernel addresses x_rows and dy_rows by row length
    checks.check_tensors((("x_rows", x_rows, (rows, d), torch.bfloat16),
                          ("dy_rows", dy_rows, (rows, d), torch.bfloat16),
                          ("row_weights", row_weights, (rows,), torch.float32),
                          ("h", h, (rows, 2 * i), torch.bfloat16)), device)
    tiles = tiles or {}
    cfg = {kind: tiles.get(kind) or plan_tiles(kind, device) for kind in ("dact", "dx", "wgrad")}
    grads = ExpertGrads(
        d_x=torch.empty(rows, d, dtype=torch.bfloat16, device=device),
        d_router=torch.zeros(rows, dtype=torch.float32, device=device),
        d_w_gate_up=torch.empty(w_gate_up.shape, dtype=torch.bfloat16, device=device),
        d_w_down=torch.empty(w_down.shape, dtype=torch.bfloat16, device=device),
    )
    if experts == 0:
        return grads
    programs = _num_programs(device, num_programs)
    counts, offsets = counts.to(torch.int32), offsets.to(torch.int32)
    d_h = torch.empty(rows, 2 * i, dtype=torch.bfloat16, device=device)
    act_w = torch.empty(rows, i, dtype=torch.bfloat16, device=device)
    if rows:
        c = cfg["dact"]
        num_n = -(-i // c.block_n)
        partial = torch.zeros(rows, num_n, dtype=torch.float32, device=device)
        launch_row_tasks(
            expert_gemm_bwd.dact_swiglu_bwd_kernel, c, programs, counts, offsets, rows,
            head=(_descriptor(dy_rows, [c.block_m, c.block_k]),
                  _descriptor(w_down.view(experts * d, i), [c.block_k, c.block_n]),
                  h, row_weights, d_h, act_w, partial,
                  h.stride(0), d_h.stride(0), act_w.stride(0), partial.stride(0)),
            tail=(d, i, float(swiglu_limit or 0.0)),
            HAS_LIMIT=swiglu_limit is not None,
        )
        grads.d_router = partial.sum(dim=1)  # n-tiles added in a fixed order
        c = cfg["dx"]
        launch_row_tasks(
            expert_gemm_bwd.dx_kernel, c, programs, counts, offsets, rows,
            head=(_descriptor(d_h, [c.block_m, c.block_k]),
                  _descriptor(w_gate_up.view(experts * 2 * i, d), [c.block_k, c.block_n]),
                  grads.d_x, grads.d_x.stride(0)),
            tail=(d, i),
        )
    if rows == 0:
        grads.d_w_gate_up.zero_()
        grads.d_w_down.zero_()
        return grads
    c = cfg["wgrad"]
    with scratch_allocator():
        for a, b, out in ((dy_rows, act_w, grads.d_w_down), (d_h, x_rows, grads.d_w_gate_up)):
            expert_gemm_bwd.wgrad_kernel[(programs,)](
                a, b, out, offsets, counts, experts, out.shape[1], out.shape[2],
                DOT_FP32=interpreting(), NUM_PROGRAMS=programs,
                BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, FLATTEN=c.flatten,
                num_warps=c.num_warps, num_stages=c.num_stages,
            )
    return grads


def expert_backward_reference(
    dy_rows: torch.Tensor,
    row_weights: torch.Tensor,
    x_rows: torch.Tensor,
    h: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
) -> ExpertGrads:
    """The torch twin of :func:`expert_backward` in FP32, from the same saved ``h``.

    Autograd runs from h (as the kernels do: the clamp masks see the saved
    BF16 pre-activation), then d_x = d_h · w_gate_up and dW_gate_up = d_hᵀ · x.
    Rows outside expert regions are NaN.
    """
    rows, d = x_rows.shape
    nan = dict(dtype=torch.float32, device=x_rows.device)
    grads = ExpertGrads(torch.full((rows, d), float("nan"), **nan), torch.full((rows,), float("nan"), **nan),
                        torch.zeros(w_gate_up.shape, **nan), torch.zeros(w_down.shape, **nan))
    for l, (start, count) in enumerate(zip(offsets.tolist(), counts.tolist())):
        sl = slice(start, start + count)
        h_l, w_down_l, w = (t.float().requires_grad_() for t in (h[sl], w_down[l], row_weights[sl]))
        y = swiglu(h_l, swiglu_limit) @ w_down_l.T
        d_h, grads.d_w_down[l], grads.d_router[sl] = torch.autograd.grad(
            (y * w[:, None] * dy_rows[sl].float()).sum(), [h_l, w_down_l, w])
        grads.d_x[sl] = d_h @ w_gate_up[l].float()
        grads.d_w_gate_up[l] = d_h.T @ x_rows[sl].float()
    return grads
