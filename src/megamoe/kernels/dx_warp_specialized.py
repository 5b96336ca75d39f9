"""The BF16 dx on Hopper in Gluon, in ping-pong: a TMA producer warp, two MMA warpgroups taking whole tiles in turn.

``dx_kernel``'s contract (`megamoe.kernels.expert_gemm_bwd`), tasks and bits: d_x = d_h · w_gate_up[l] (K = 2I,
N = D) over the device-built row tiles, each row's K loop the same m64nNk16 sequence. The producer is the dact's
(``dact_warp_specialized.kn_weights_producer``: d_h's two 64-row halves and the weights' [BK x 128] rows as stored),
the consumers the ping-pong down's (``forward_warp_specialized.ping_pong_consumer``): at fine-grained experts' short
K (2I = 512-1536) a cooperative tile's epilogue is a large share of it, and here one warpgroup's stores run under the
other's wgmmas. SCATTER: row r lands at d_x's row ``d_x_index[r]`` (one rank's slots), as ``dx_kernel``'s.

GPU only (Gluon has no interpreter); `megamoe.ops.experts_bwd.dx` runs it on Hopper for 128-row tiles where K is
short (``planner.tiles.ping_pong_dx_tile``), and a GPU test holds it to ``dx_kernel``'s bits. Launch with a scratch
allocator (the descriptors), 4 warps.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from megamoe.kernels.dact_warp_specialized import kn_weights_producer
from megamoe.kernels.forward_fp8_warp_specialized import BLOCK
from megamoe.kernels.forward_warp_specialized import (HALF_M, REGS_PRODUCER, cooperative_consumer,
                                                      invalidate_turns, ping_pong_consumer, ping_pong_turns)
from megamoe.kernels.gluon_ring import invalidate_ring, ring_barriers


@gluon.jit
def dx_ws_kernel(d_h_ptr, w_ptr, d_x_ptr, d_x_index_ptr, stride_d_h, stride_d_x, tile_expert_ptr, tile_row0_ptr,
                 tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, rows, w_rows, K, N, NUM_PROGRAMS: gl.constexpr,
                 BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, SCATTER: gl.constexpr = False,
                 SKIP_EMPTY_HALF: gl.constexpr = False, PING_PONG: gl.constexpr = True,
                 BLOCK_N: gl.constexpr = BLOCK):
    """One persistent launch of 128 x BLOCK_N dx tiles: d_h `[rows, K = 2I]`, w = w_gate_up `[w_rows = L*K, N = D]`,
    out d_x `[rows, N]` (SCATTER: `[S, N]`, row r at ``d_x_index[r]``, int32; else d_x_index is never read), bf16.
    PING_PONG (BLOCK_N 128): each warpgroup whole tiles in turn; else cooperative, each warpgroup 64 rows of every
    tile (``forward_warp_specialized.cooperative_consumer``, one wgmma group in flight). SKIP_EMPTY_HALF: a tile of at
    most 64 rows runs one half's wgmmas only (the same bits)."""
    gl.static_assert(not PING_PONG or BLOCK_N == BLOCK, "the ping-pong dx holds two 64 x 128 accumulators")
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK_K], gl.bfloat16)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], gl.bfloat16)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, HALF_M, BLOCK_K], a_layout)
    w_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, BLOCK_N], w_layout)
    full, empty = ring_barriers(STAGES)
    if not PING_PONG:  # the cooperative consumer as down's: its act, bias and SwiGLU arguments (0.0) never read
        gl.warp_specialize(
            [(cooperative_consumer, (d_x_ptr, d_x_ptr, d_x_ptr, stride_d_x, stride_d_x, tile_expert_ptr,
                                     tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, N, K, 0.0, 0.0,
                                     a_smem, w_smem, full, empty, gl.constexpr(0), gl.constexpr(False),
                                     gl.constexpr(0), gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_N),
                                     gl.constexpr(BLOCK_K), gl.constexpr(GROUP_M), gl.constexpr(STAGES),
                                     gl.constexpr(True), gl.constexpr(False), gl.constexpr(False),
                                     gl.constexpr(False), gl.constexpr(SKIP_EMPTY_HALF), d_x_index_ptr,
                                     gl.constexpr(True), gl.constexpr(SCATTER))),
             (cooperative_consumer, (d_x_ptr, d_x_ptr, d_x_ptr, stride_d_x, stride_d_x, tile_expert_ptr,
                                     tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, N, K, 0.0, 0.0,
                                     a_smem, w_smem, full, empty, gl.constexpr(1), gl.constexpr(False),
                                     gl.constexpr(0), gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_N),
                                     gl.constexpr(BLOCK_K), gl.constexpr(GROUP_M), gl.constexpr(STAGES),
                                     gl.constexpr(True), gl.constexpr(False), gl.constexpr(False),
                                     gl.constexpr(False), gl.constexpr(SKIP_EMPTY_HALF), d_x_index_ptr,
                                     gl.constexpr(True), gl.constexpr(SCATTER))),
             (kn_weights_producer, (d_h_ptr, w_ptr, rows, w_rows, stride_d_h, tile_expert_ptr, tile_row0_ptr,
                                    tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, K, N, a_smem, w_smem, full, empty,
                                    gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_K), gl.constexpr(GROUP_M),
                                    gl.constexpr(STAGES), d_h_ptr, gl.constexpr(False),
                                    gl.constexpr(SKIP_EMPTY_HALF), gl.constexpr(BLOCK_N)))],
            [4, 1], [232, REGS_PRODUCER])
    else:
        turn = ping_pong_turns()
        gl.warp_specialize(
            [(ping_pong_consumer, (d_x_ptr, d_x_ptr, d_x_index_ptr, stride_d_x, tile_expert_ptr, tile_row0_ptr,
                                   tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, N, K, a_smem, w_smem, full, empty,
                                   turn, gl.constexpr(0), gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK),
                                   gl.constexpr(BLOCK_K), gl.constexpr(GROUP_M), gl.constexpr(STAGES),
                                   gl.constexpr(False), gl.constexpr(True), gl.constexpr(SCATTER),
                                   gl.constexpr(SKIP_EMPTY_HALF))),
             (ping_pong_consumer, (d_x_ptr, d_x_ptr, d_x_index_ptr, stride_d_x, tile_expert_ptr, tile_row0_ptr,
                                   tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, N, K, a_smem, w_smem, full, empty,
                                   turn, gl.constexpr(1), gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK),
                                   gl.constexpr(BLOCK_K), gl.constexpr(GROUP_M), gl.constexpr(STAGES),
                                   gl.constexpr(False), gl.constexpr(True), gl.constexpr(SCATTER),
                                   gl.constexpr(SKIP_EMPTY_HALF))),
             (kn_weights_producer, (d_h_ptr, w_ptr, rows, w_rows, stride_d_h, tile_expert_ptr, tile_row0_ptr,
                                    tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, K, N, a_smem, w_smem, full, empty,
                                    gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_K), gl.constexpr(GROUP_M),
                                    gl.constexpr(STAGES), d_h_ptr, gl.constexpr(False),
                                    gl.constexpr(SKIP_EMPTY_HALF)))],
            [4, 1], [232, REGS_PRODUCER])
        invalidate_turns(turn)
    invalidate_ring(full, empty, STAGES)
