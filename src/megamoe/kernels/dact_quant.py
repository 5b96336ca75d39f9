"""The FP8 dact's outputs quantised before they leave the tile: d_h for dx and for the gate/up wgrad, act·w for the
down wgrad (both formats).

After :func:`megamoe.kernels.expert_gemm_bwd.dact_epilogue` has written a row tile's BF16 ``d_h`` (gate and up
columns n0..n0+BN) and ``act_w`` (columns n0..n0+BN), the same program reads them back (a tile of its own, in
L2) and stores, as the standalone quantisers would from the whole BF16 tensors:

    d_h_q  [R, 2I] e4m3, d_h_s [R, 2I/ROW_BLOCK]        1 x ROW_BLOCK blocks along 2I (dx's K), routed rows
    d_h_t  [2I, R_pad] e4m3, scales                      TOKEN_BLOCK x 1 blocks along the tokens, transposed
    act_t  [I, R_pad] e4m3, scales                       (the wgrads' K): padded row p0 + r of the tile's row r

``p0`` is the tile's first row in the padded token layout (``megamoe.ops.experts_fp8_bwd.token_blocks``: each
expert's rows from a 128-row boundary). A tile is one such 128-row span: it starts at a span boundary of its
expert and its rows past the expert's end are the span's padding, stored as zeros. The token-axis scales are addressed by
(token block, column) strides, so both formats' layouts pass (fp8-block ``[R_pad/128, C]``, mxfp8
``[C, R_pad/32]``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from megamoe.kernels.expert_gemm import _tile_task
from megamoe.kernels.quant import quantize_tile_store


@triton.jit
def _rowwise(src, stride_src, m_left, k_left, row0, col0, C, q_ptr, q_scale_ptr, MX: tl.constexpr,
             ROW_BLOCK: tl.constexpr, SOFT_E4M3: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             PIECES: tl.constexpr):
    """The tile ``src`` (columns col0.. of a C-column tensor) quantised along C into the row-major ``q``
    [R, C], PIECES row slices in turn (a whole tile at once spilled)."""
    HALF: tl.constexpr = BLOCK_M // PIECES
    local = tl.arange(0, HALF)
    cols = tl.arange(0, BLOCK_N)
    for part in tl.static_range(PIECES):
        r0 = part * HALF
        x = tl.load(src + (r0 + local)[:, None] * stride_src + cols[None, :],
                    mask=(r0 + local < m_left)[:, None] & (cols < k_left)[None, :], other=0.0)
        row = (row0 + r0).to(tl.int64)
        quantize_tile_store(x, q_ptr + row * C + col0, C, 1, q_scale_ptr + row * (C // ROW_BLOCK) + col0 // ROW_BLOCK,
                            C // ROW_BLOCK, 1, m_left - r0, k_left, MX, 1, ROW_BLOCK, False, SOFT_E4M3)
        tl.debug_barrier()  # one slice's registers at a time: the compiler would hoist the next slice's loads


@triton.jit
def _tokenwise(src, stride_src, m_left, k_left, col0, p0, R_pad, t_ptr, t_scale_ptr, stride_ts_block,
               stride_ts_col, MX: tl.constexpr, TOKEN_BLOCK: tl.constexpr, SOFT_E4M3: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PIECES: tl.constexpr):
    """The tile ``src`` (columns col0..) quantised along the tokens into the transposed ``t`` [C, R_pad] at
    padded row p0, rows past ``m_left`` as zeros, PIECES column slices in turn."""
    HALF: tl.constexpr = BLOCK_N // PIECES
    local = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HALF)
    for part in tl.static_range(PIECES):
        c0 = part * HALF
        x = tl.load(src + local[:, None] * stride_src + (c0 + cols)[None, :],
                    mask=(local < m_left)[:, None] & (c0 + cols < k_left)[None, :], other=0.0)
        col = col0 + c0
        quantize_tile_store(x, t_ptr + col.to(tl.int64) * R_pad + p0, 1, R_pad,
                            t_scale_ptr + (p0 // TOKEN_BLOCK).to(tl.int64) * stride_ts_block + col * stride_ts_col,
                            stride_ts_block, stride_ts_col, BLOCK_M, k_left - c0, MX, TOKEN_BLOCK, 1, False,
                            SOFT_E4M3)
        tl.debug_barrier()  # one slice's registers at a time


@triton.jit
def quantize_dact_tile(d_h_tile, act_w_tile, stride_tile, up_offset, row0, row_end, expert, n0, I,
                       offsets_ptr, block0_ptr, R_pad,
                       d_h_q_ptr, d_h_s_ptr, d_h_t_ptr, d_h_ts_ptr, stride_ts_block, stride_ts_col,
                       act_t_ptr, act_ts_ptr, stride_as_block, stride_as_col,
                       MX: tl.constexpr, ROW_BLOCK: tl.constexpr, TOKEN_BLOCK: tl.constexpr,
                       SOFT_E4M3: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       PIECES: tl.constexpr = 4):
    """The tile's quantised outputs (module docstring) from its BF16 ``d_h`` (``d_h_tile``: gate column n0 of
    row row0; up ``up_offset`` further; rows ``stride_tile`` apart) and ``act_w`` (``act_w_tile``, rows
    ``stride_tile // 2`` apart); each token-axis scale tensor by its (token block, column) strides."""
    tl.debug_barrier()  # every warp's d_h and act_w of this tile written
    m_left = row_end - row0
    k_left = I - n0
    p0 = tl.load(block0_ptr + expert) * 128 + (row0 - tl.load(offsets_ptr + expert))
    for part in tl.static_range(2):  # gate, then up
        src = d_h_tile + part * up_offset
        col = part * I + n0
        _rowwise(src, stride_tile, m_left, k_left, row0, col, 2 * I, d_h_q_ptr, d_h_s_ptr, MX, ROW_BLOCK,
                 SOFT_E4M3, BLOCK_M, BLOCK_N, PIECES)
        _tokenwise(src, stride_tile, m_left, k_left, col, p0, R_pad, d_h_t_ptr, d_h_ts_ptr, stride_ts_block,
                   stride_ts_col, MX, TOKEN_BLOCK, SOFT_E4M3, BLOCK_M, BLOCK_N, PIECES)
    _tokenwise(act_w_tile, stride_tile // 2, m_left, k_left, n0, p0, R_pad, act_t_ptr, act_ts_ptr, stride_as_block,
               stride_as_col, MX, TOKEN_BLOCK, SOFT_E4M3, BLOCK_M, BLOCK_N, PIECES)
    tl.debug_barrier()  # read before the next tile's epilogue writes the tile again


@triton.jit
def dact_destinations(d_h_ptr, act_w_ptr, pid, TILE_OUT: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """Where :func:`~megamoe.kernels.expert_gemm_bwd.dact_epilogue` writes: program ``pid``'s own tile
    (TILE_OUT: ``[BLOCK_M, 2 BLOCK_N]`` of d_h, ``[BLOCK_M, BLOCK_N]`` of act_w per program), else the routed
    rows."""
    if TILE_OUT:
        d_h_dst = d_h_ptr + pid * (BLOCK_M * 2 * BLOCK_N)
        act_w_dst = act_w_ptr + pid * (BLOCK_M * BLOCK_N)
    else:
        d_h_dst, act_w_dst = d_h_ptr, act_w_ptr
    return d_h_dst, act_w_dst


@triton.jit
def quantize_dact_task(task, num_n, num_tiles, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, d_h_ptr,
                       act_w_ptr, pid, stride_d_h, I, offsets_ptr, block0_ptr, R_pad,
                       d_h_q_ptr, d_h_s_ptr, d_h_t_ptr, d_h_ts_ptr, stride_ts_block, stride_ts_col,
                       act_t_ptr, act_ts_ptr, stride_as_block, stride_as_col, TILE_OUT: tl.constexpr,
                       GROUP_M: tl.constexpr, MX: tl.constexpr, ROW_BLOCK: tl.constexpr, TOKEN_BLOCK: tl.constexpr,
                       SOFT_E4M3: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """:func:`quantize_dact_tile` for dact task ``task``, its indices read again from the tile map.
    ``stride_d_h``: d_h's row stride where it was written (``2 BLOCK_N`` in the program's tile; 2I in the routed
    rows, act_w's I).

    Registers: the FP8-block dact ran at 254 without this; with it ptxas saves ~13 registers of loop state
    around the SwiGLU epilogue (~100 bytes of stack, none inside the K loop: nvdisasm), however the
    quantisation is cut (2, 4 or 8 slices: 232 / 104 / 168 bytes) or placed (at the next task's start: 160).
    mxfp8's dact does not spill."""
    expert, row0, row_end, n = _tile_task(task, num_n, num_tiles, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                                          GROUP_M)
    n0 = n * BLOCK_N
    d_h_tile, act_w_tile = dact_destinations(d_h_ptr, act_w_ptr, pid, TILE_OUT, BLOCK_M, BLOCK_N)
    if TILE_OUT:
        up_offset = BLOCK_N
    else:
        d_h_tile += row0.to(tl.int64) * stride_d_h + n0
        act_w_tile += row0.to(tl.int64) * (stride_d_h // 2) + n0
        up_offset = I
    quantize_dact_tile(d_h_tile, act_w_tile, stride_d_h, up_offset, row0, row_end, expert, n0, I, offsets_ptr,
                       block0_ptr, R_pad, d_h_q_ptr, d_h_s_ptr, d_h_t_ptr, d_h_ts_ptr, stride_ts_block, stride_ts_col,
                       act_t_ptr, act_ts_ptr, stride_as_block, stride_as_col, MX, ROW_BLOCK, TOKEN_BLOCK, SOFT_E4M3,
                       BLOCK_M, BLOCK_N)
