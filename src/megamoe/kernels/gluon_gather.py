"""Rows by index into a warp-specialised ring slot, for a producer warpgroup: the Gluon GEMMs' operand that one rank
reads from its tokens in place of a routed copy (Hopper's TMA has no gather).

``row_starts`` loads the rows' indices once (a tile's rows stay for all its K steps; a wgrad's K rows,
``row_indices``, are loaded two steps ahead and made pointers, ``row_starts_of``, at their step), ``copy_rows_async``
issues a step's cp.async copies of 16 bytes and zero-fills what lies past the rows or the columns (as TMA fills past
a descriptor's end), and ``land_on`` makes each producer thread's arrival on the step's ``full`` barrier wait for
its copies (``cp.async.mbarrier.arrive.noinc``: the barrier expects it, ``full_arrivals``). So the step's ``expect``
and its TMA loads go first, from one thread, and nothing we write orders the producer warps (SonicMoE's Hopper
gathers do the same: QuACK's ``PipelineTmaCpAsync``); Triton 3.6 lowers the arrive after a ``bar.sync`` of the
producer warps, so they still meet once a step (seen in the sm_90 build). cp.async writes through the generic
proxy and the wgmma reads through the async one: a consumer fences (``fence_async_shared``) after its ``full`` wait
and before its wgmma.

GATHER_WARPS: one producer warp gathering (2026-12-05, one H200: benchmarks/results/2026-12-05-gather-on-load) ran
the step 1.37x slower than copying the rows first: 32 pieces of 16 bytes per lane per operand and K step do not
keep two wgmma warpgroups fed. Four warps (a quarter each, 4 x 32 x 48 = 1 x 32 x 192 registers) with a named
barrier between the copies and the expect of every step: 1.10x slower (qwen3-30b-a3b 8192 tokens, step 6.27
against 5.70 ms; benchmarks/results/2026-12-06-gathering-warpgroup). The arrivals without increment (no named
barrier, the weights' TMA issued before the gathers) are built and checked offline, not yet measured.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

#: The gathering producer's warps and their registers (its rows' start pointers and a step's pieces), beside two
#: 232-register consumer warpgroups: 2 x 128 x 232 + 4 x 32 x 48 = 65,536.
GATHER_WARPS = gl.constexpr(4)
REGS_GATHER = gl.constexpr(48)


@gluon.constexpr_function
def full_arrivals(gather):
    """A ring's ``full`` barrier count: the expect's arrival, and with ``gather`` each producer thread's
    (:func:`land_on`)."""
    return 1 + (32 * GATHER_WARPS.value if gather else 0)


@gluon.constexpr_function
def _rows_layout(cols):
    """GATHER_WARPS warps over [rows, cols] bf16: 16-byte pieces, a row's pieces across lanes, rows across warps."""
    lanes = min(cols // 8, 32)
    return gl.BlockedLayout([1, 8], [32 // lanes, lanes], [GATHER_WARPS.value, 1], [1, 0])


@gluon.jit
def row_indices(index_ptr, row0, row_end, ROWS: gl.constexpr, COLS: gl.constexpr):
    """``index[row0 + q]`` for q < ROWS (0 past ``row_end``): the source rows of a step, loaded ahead of its
    :func:`row_starts_of` (a wgrad's K steps each need new rows: loaded two steps ahead, the load's latency is off
    the producer's path)."""
    layout: gl.constexpr = _rows_layout(COLS)
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    return gl.load(index_ptr + rows, mask=rows < row_end, other=0)


@gluon.jit
def row_starts_of(src_ptr, source_rows, row0, row_end, stride, ROWS: gl.constexpr, COLS: gl.constexpr):
    """(``src + source_rows[q] * stride``, ``row0 + q < row_end``): the start pointers of :func:`row_indices`'
    rows and which rows exist, for :func:`copy_rows_async`."""
    layout: gl.constexpr = _rows_layout(COLS)
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    return src_ptr + source_rows.to(gl.int64) * stride, rows < row_end


@gluon.jit
def row_starts(src_ptr, index_ptr, row0, row_end, stride, ROWS: gl.constexpr, COLS: gl.constexpr):
    """(``src + index[row0 + q] * stride`` for q < ROWS, ``row0 + q < row_end``): the rows' start pointers and which
    rows exist, for :func:`copy_rows_async` (a tile whose rows stay for all its K steps)."""
    return row_starts_of(src_ptr, row_indices(index_ptr, row0, row_end, ROWS, COLS), row0, row_end, stride, ROWS,
                         COLS)


@gluon.jit
def copy_rows_async(starts, row_ok, col0, COLS_TOTAL, smem, COLS: gl.constexpr):
    """``smem[q, c] = starts[q][col0 + c]`` where ``row_ok[q]`` and ``col0 + c < COLS_TOTAL`` (zero elsewhere), by
    cp.async (:func:`land_on` tells a barrier when they land)."""
    layout: gl.constexpr = _rows_layout(COLS)
    cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    pointers = starts[:, None] + cols[None, :]
    async_copy.async_copy_global_to_shared(smem, pointers, mask=row_ok[:, None] & (cols < COLS_TOTAL)[None, :])


@gluon.jit
def land_on(bar):
    """This thread's arrival on ``bar`` once every cp.async it issued has landed; counted in the barrier's
    :func:`full_arrivals` (no increment), so it needs no order against the step's expect."""
    async_copy.mbarrier_arrive(bar, increment_count=False)
