"""The dact on Hopper, warp-specialised in Gluon (BF16 and FP8-block): a TMA producer warp, two MMA warpgroups.

``dact_swiglu_bwd_kernel``'s and ``dact_fp8_kernel``'s contracts (`megamoe.kernels.expert_gemm_bwd`,
`expert_gemm_fp8_bwd`), 128 x 128 tiles, tasks and bits: g = dy · w_down[l] (K = D, N = I), then the SwiGLU
backward from the saved h. FP8-block: g's GEMM is down's shape (the transposed weights K-major in 128 x 128
blocks), so the producer is the forward's (``forward_producer``) and each warpgroup's K loop FP8 down's
(``paired_k_steps``: two K steps' products in flight, one promoted under the other's wgmmas). BF16: a producer
of [64 x BK] dy halves and [BK x 128] w_down slices (N-major, as stored), the K loop the forward's (one wgmma group
left in flight). The epilogue (:func:`dact_epilogue`) is the Triton dact's on a warpgroup's 64 rows: the tile split
into column halves and quarters in the same order, each quarter's SwiGLU backward by the shared ``swiglu_bwd`` in
the Triton dact's register layout (its row sums reduce in the same order: the router-gradient partials' bits; in
the MMA's layout 400-600 of them differed on the GPU), d_h (gate and up columns) and act·w stored in bf16 through
16-byte row runs, the rows' partial for the n-tile.

Measured (benchmarks/results/2026-12-04-fp8-dact-warp-specialized): the FP8 dact 3.87 -> 2.92 ms and the BF16 one
4.56 -> 4.13 ms on kimi-k2's 341-row experts (3.69 -> 3.09 on glm-5's 256-row ones), the Triton dacts' bits.

GPU only (Gluon has no interpreter); `megamoe.ops.experts_bwd` / `experts_fp8_bwd` run them on Hopper for
128 x 128 tiles, and GPU tests hold them to the Triton dacts' bits. Launch with a scratch allocator (the
descriptors), 4 warps.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

from megamoe.kernels.convert import to_bf16
from megamoe.kernels.activation import activation_bwd
from megamoe.kernels.forward_fp8_warp_specialized import BLOCK, REGS_CONSUMER, REGS_PRODUCER, paired_k_steps
from megamoe.kernels.forward_warp_specialized import HALF_M, expect_a_halves, forward_producer
from megamoe.kernels.gluon_gather import (GATHER_WARPS, REGS_GATHER, copy_rows_async, full_arrivals, land_on,
                                         row_starts)
from megamoe.kernels.gluon_ring import drain_steps, invalidate_ring, pass_steps, release_step, ring_barriers
from megamoe.kernels.quant import mxfp8_round_tile
from megamoe.kernels.tasks import tile_task
from megamoe.kernels.wgrad_blocks import column_halves


@gluon.jit
def _quarter(g, c0, first, row_end, h_ptr, row_w_ptr, d_h_ptr, act_w_ptr, stride_h, stride_d_h, stride_act_w, I,
             limit, alpha, ACT: gl.constexpr, d_h_grid_ptr, D_H_GRID: gl.constexpr):
    """The SwiGLU backward of columns c0.. of rows first.. (``g`` [64, 32], in its split layout): d_h and act·w
    stored (D_H_GRID: d_h on the MXFP8 grid too, each row's 32 columns one block), the rows' partial returned.
    The math runs in the Triton dact's layout (``io``: 16-byte row runs, 8 columns per thread, 4 lanes per row),
    so the rows' sums reduce in its order and give its bits; the loads and stores are coalesced there too."""
    io: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])  # bf16 [64, 32]: 8 per thread
    g = gl.convert_layout(g, io)
    rows = first + gl.arange(0, g.shape[0], layout=gl.SliceLayout(1, io))
    cols = c0 + gl.arange(0, g.shape[1], layout=gl.SliceLayout(0, io))
    row_ok = rows < row_end
    mask = row_ok[:, None] & (cols < I)[None, :]
    rows64 = rows.to(gl.int64)
    h_tile = h_ptr + (rows64[:, None] * stride_h + cols[None, :])
    gate = gl.load(h_tile, mask=mask, other=0.0).to(gl.float32)
    up = gl.load(h_tile + I, mask=mask, other=0.0).to(gl.float32)
    w = gl.load(row_w_ptr + rows, mask=row_ok, other=0.0)
    part, act_w, d_gate, d_up = activation_bwd(g, gate, up, w[:, None], limit, alpha, ACT)
    act_w_tile = act_w_ptr + (rows64[:, None] * stride_act_w + cols[None, :])
    gl.store(act_w_tile, to_bf16(act_w, False), mask=mask)
    d_h_tile = d_h_ptr + (rows64[:, None] * stride_d_h + cols[None, :])
    d_gate = to_bf16(d_gate, False)
    gl.store(d_h_tile, d_gate, mask=mask)
    d_up = to_bf16(d_up, False)
    gl.store(d_h_tile + I, d_up, mask=mask)
    if D_H_GRID:  # dx's operand as mx_round_activations(d_h) gives it, without a pass over d_h
        grid_tile = d_h_grid_ptr + (rows64[:, None] * stride_d_h + cols[None, :])
        gl.store(grid_tile, mxfp8_round_tile(d_gate, 1).to(gl.bfloat16), mask=mask)
        gl.store(grid_tile + I, mxfp8_round_tile(d_up, 1).to(gl.bfloat16), mask=mask)
    return part


@gluon.jit
def _half(g, c0, first, row_end, h_ptr, row_w_ptr, d_h_ptr, act_w_ptr, stride_h, stride_d_h, stride_act_w, I, limit,
          alpha, ACT: gl.constexpr, d_h_grid_ptr, D_H_GRID: gl.constexpr):
    """Columns c0.. of ``g`` [64, 64] as two quarters, the Triton dact's ``_dact_quarters`` order."""
    lo, hi = column_halves(g)
    part = _quarter(lo, c0, first, row_end, h_ptr, row_w_ptr, d_h_ptr, act_w_ptr, stride_h, stride_d_h,
                    stride_act_w, I, limit, alpha, ACT, d_h_grid_ptr, D_H_GRID)
    part += _quarter(hi, c0 + g.shape[1] // 2, first, row_end, h_ptr, row_w_ptr, d_h_ptr, act_w_ptr, stride_h,
                     stride_d_h, stride_act_w, I, limit, alpha, ACT, d_h_grid_ptr, D_H_GRID)
    return part


@gluon.jit
def _fp8_consumer(dy_scale_ptr, w_scale_ptr, h_ptr, row_w_ptr, d_h_ptr, act_w_ptr, d_w_partial_ptr, stride_dys,
              stride_ws_n, stride_h, stride_d_h, stride_act_w, stride_partial, tile_expert_ptr, tile_row0_ptr,
              tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, I, D, limit, alpha, a_smem, w_smem, full, empty,
              HALF: gl.constexpr, ACT: gl.constexpr, NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, SKIP_EMPTY_HALF: gl.constexpr):
    """FP8-block: rows HALF * 64 .. HALF * 64 + 63 of every tile of this program (one warpgroup); SKIP_EMPTY_HALF as
    the BF16 consumer's."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 32])
    num_n = gl.cdiv(I, BLOCK)
    num_tasks = gl.load(num_tiles_ptr) * num_n
    g = 0  # the program's K steps, in the producer's order
    for task in range(gl.program_id(0), num_tasks, NUM_PROGRAMS):
        expert, row0, row_end, n = tile_task(task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                                             tile_run_ptr, GROUP_M)
        if SKIP_EMPTY_HALF and HALF == 1 and row_end - row0 <= HALF_M:
            g = pass_steps(full, empty, g, D // BLOCK, STAGES)
        else:
            first = row0 + HALF * HALF_M
            rows = first + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, mma))
            row_ok = rows < row_end
            ds_rows = dy_scale_ptr + rows.to(gl.int64) * stride_dys
            ws_n = w_scale_ptr + (expert.to(gl.int64) * (I // BLOCK) + n) * stride_ws_n
            acc, g = paired_k_steps(ds_rows, row_ok, ws_n, D, g, a_smem, w_smem, full, empty, HALF, STAGES, mma)
            dact_epilogue(acc, n, first, row_end, h_ptr, row_w_ptr, d_h_ptr, act_w_ptr, d_w_partial_ptr, stride_h,
                          stride_d_h, stride_act_w, stride_partial, I, limit, alpha, ACT, d_h_ptr, False)


@gluon.jit
def dact_epilogue(acc, n, first, row_end, h_ptr, row_w_ptr, d_h_ptr, act_w_ptr, d_w_partial_ptr, stride_h,
                  stride_d_h, stride_act_w, stride_partial, I, limit, alpha, ACT: gl.constexpr, d_h_grid_ptr,
                  D_H_GRID: gl.constexpr):
    """The dact epilogue of g = ``acc`` [64, 128] (rows first.., n-tile n) in the Triton dact's order: column
    halves, each as two quarters (the router-gradient partials' sum order), then the rows' partial stored.
    D_H_GRID: d_h on the MXFP8 grid along 2I also stored at ``d_h_grid_ptr`` (d_h's strides)."""
    lo, hi = column_halves(acc)
    n0 = n * BLOCK
    part = _half(lo, n0, first, row_end, h_ptr, row_w_ptr, d_h_ptr, act_w_ptr, stride_h, stride_d_h, stride_act_w,
                 I, limit, alpha, ACT, d_h_grid_ptr, D_H_GRID)
    part += _half(hi, n0 + BLOCK // 2, first, row_end, h_ptr, row_w_ptr, d_h_ptr, act_w_ptr, stride_h, stride_d_h,
                  stride_act_w, I, limit, alpha, ACT, d_h_grid_ptr, D_H_GRID)
    part_rows = first + gl.arange(0, HALF_M, layout=part.type.layout)
    gl.store(d_w_partial_ptr + part_rows.to(gl.int64) * stride_partial + n, part, mask=part_rows < row_end)


@gluon.jit
def dact_fp8_ws_kernel(dy_ptr, w_t_ptr, dy_scale_ptr, w_t_scale_ptr, h_ptr, row_w_ptr, d_h_ptr, act_w_ptr,
                       d_w_partial_ptr, stride_dy, stride_dys, stride_ws_n, stride_h, stride_d_h, stride_act_w,
                       stride_partial, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr,
                       rows, w_rows, D, I, limit, alpha, ACT: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                       BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                       SKIP_EMPTY_HALF: gl.constexpr = False):
    """One persistent launch of 128 x 128 dact tiles: dy `[rows, D]` e4m3 with dy_scale `[rows, D/128]`, w_t =
    w_down_t_q `[w_rows = L*I, D]` with scales `[L*I/128, D/128]` rows of stride_ws_n; h `[rows, 2I]` bf16, row_w
    `[rows]` fp32; out d_h `[rows, 2I]`, act_w `[rows, I]` bf16, d_w_partial `[rows, I/128]` fp32. SKIP_EMPTY_HALF:
    a tile of at most 64 rows runs one warpgroup's wgmmas (the same bits)."""
    gl.static_assert(BLOCK_K == BLOCK, "FP8-block dact K steps are its 128-wide scale blocks")
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK], gl.float8e4nv)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], gl.float8e4nv)
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * STAGES, HALF_M, BLOCK], a_layout)
    w_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK, BLOCK], w_layout)
    full, empty = ring_barriers(STAGES)
    gl.warp_specialize(
        [(_fp8_consumer, (dy_scale_ptr, w_t_scale_ptr, h_ptr, row_w_ptr, d_h_ptr, act_w_ptr, d_w_partial_ptr,
                      stride_dys, stride_ws_n, stride_h, stride_d_h, stride_act_w, stride_partial, tile_expert_ptr,
                      tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, I, D, limit, alpha, a_smem, w_smem,
                      full, empty, gl.constexpr(0), gl.constexpr(ACT), gl.constexpr(NUM_PROGRAMS),
                      gl.constexpr(GROUP_M), gl.constexpr(STAGES), gl.constexpr(SKIP_EMPTY_HALF))),
         (_fp8_consumer, (dy_scale_ptr, w_t_scale_ptr, h_ptr, row_w_ptr, d_h_ptr, act_w_ptr, d_w_partial_ptr,
                      stride_dys, stride_ws_n, stride_h, stride_d_h, stride_act_w, stride_partial, tile_expert_ptr,
                      tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, I, D, limit, alpha, a_smem, w_smem,
                      full, empty, gl.constexpr(1), gl.constexpr(ACT), gl.constexpr(NUM_PROGRAMS),
                      gl.constexpr(GROUP_M), gl.constexpr(STAGES), gl.constexpr(SKIP_EMPTY_HALF))),
         (forward_producer, (dy_ptr, w_t_ptr, rows, w_rows, stride_dy, tile_expert_ptr, tile_row0_ptr,
                             tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, I, D, a_smem, w_smem, full, empty,
                             gl.constexpr(False), gl.constexpr(NUM_PROGRAMS), BLOCK, BLOCK, gl.constexpr(GROUP_M),
                             gl.constexpr(STAGES), dy_ptr, gl.constexpr(False), gl.constexpr(SKIP_EMPTY_HALF)))],
        [4, 1], [REGS_CONSUMER, REGS_PRODUCER])
    invalidate_ring(full, empty, STAGES)


@gluon.jit
def kn_weights_producer(a_ptr, w_ptr, rows, w_rows, stride_a, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                        tile_run_ptr, num_tiles_ptr, K, N, a_smem, w_smem, full, empty, NUM_PROGRAMS: gl.constexpr,
                        BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, a_index_ptr,
                        A_GATHER: gl.constexpr, SKIP_EMPTY_HALF: gl.constexpr = False,
                        BLOCK_N: gl.constexpr = BLOCK):
    """BF16 with weights stored K by N (w `[w_rows = L*K, N]`: w_down for the dact, w_gate_up for dx): each task's
    K steps, A's two 64-row halves [64 x BK] and the expert's weight rows k.. as stored ([BK x BLOCK_N], N-major; the
    descriptor spans every expert's rows as the Triton kernels' do). A_GATHER: A row r is row ``a_index[r]`` of a
    (``megamoe.kernels.gluon_gather``). SKIP_EMPTY_HALF: a tile's bottom A half not loaded where it has no rows
    (``forward_warp_specialized.expect_a_halves``)."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK_K], gl.bfloat16)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], gl.bfloat16)
    a_desc = tma.make_tensor_descriptor(a_ptr, [rows, K], [stride_a, 1], [HALF_M, BLOCK_K], a_layout)
    w_desc = tma.make_tensor_descriptor(w_ptr, [w_rows, N], [N, 1], [BLOCK_K, BLOCK_N], w_layout)
    A_TMA_ROWS: gl.constexpr = 0 if A_GATHER else 2 * HALF_M
    step_bytes: gl.constexpr = (A_TMA_ROWS + BLOCK_N) * BLOCK_K * 2
    a_half_bytes: gl.constexpr = HALF_M * BLOCK_K * 2
    num_n = gl.cdiv(N, BLOCK_N)
    num_tasks = gl.load(num_tiles_ptr) * num_n
    g = 0
    for task in range(gl.program_id(0), num_tasks, NUM_PROGRAMS):
        expert, row0, row_end, n = tile_task(task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                                             tile_run_ptr, GROUP_M)
        if A_GATHER:  # the tile's rows, once for its K steps
            top, top_ok = row_starts(a_ptr, a_index_ptr, row0, row_end, stride_a, HALF_M, BLOCK_K)
            bottom, bottom_ok = row_starts(a_ptr, a_index_ptr, row0 + HALF_M, row_end, stride_a, HALF_M, BLOCK_K)
        for k in range(0, K, BLOCK_K):
            s = g % STAGES
            mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)  # the first round finds every slot free
            if A_GATHER:
                mbarrier.expect(full.index(s), step_bytes)
            else:
                expect_a_halves(a_desc, row0, row_end, k, full.index(s), a_smem, s, step_bytes, a_half_bytes,
                                SKIP_EMPTY_HALF)
            tma.async_copy_global_to_shared(w_desc, [expert * K + k, n * BLOCK_N], full.index(s), w_smem.index(s))
            if A_GATHER:  # under the weights' TMA; each thread's landing one of the barrier's arrivals
                copy_rows_async(top, top_ok, k, K, a_smem.index(2 * s), BLOCK_K)
                copy_rows_async(bottom, bottom_ok, k, K, a_smem.index(2 * s + 1), BLOCK_K)
                land_on(full.index(s))
            g += 1


@gluon.jit
def _bf16_consumer(h_ptr, row_w_ptr, d_h_ptr, act_w_ptr, d_w_partial_ptr, stride_h, stride_d_h, stride_act_w,
                   stride_partial, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, I, D,
                   limit, alpha, a_smem, w_smem, full, empty, HALF: gl.constexpr, ACT: gl.constexpr,
                   NUM_PROGRAMS: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                   A_GATHER: gl.constexpr, d_h_grid_ptr, D_H_GRID: gl.constexpr, SKIP_EMPTY_HALF: gl.constexpr):
    """BF16: rows HALF * 64 .. HALF * 64 + 63 of every tile of this program (one warpgroup); the K loop the BF16
    forward's (one wgmma group in flight), the same m64n128k16 sequence as the Triton dact's. SKIP_EMPTY_HALF: the
    bottom warpgroup passes the steps of a tile of at most 64 rows (``gluon_ring.pass_steps``)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 16])
    num_n = gl.cdiv(I, BLOCK)
    num_tasks = gl.load(num_tiles_ptr) * num_n
    g = 0
    for task in range(gl.program_id(0), num_tasks, NUM_PROGRAMS):
        expert, row0, row_end, n = tile_task(task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                                             tile_run_ptr, GROUP_M)
        if SKIP_EMPTY_HALF and HALF == 1 and row_end - row0 <= HALF_M:
            g = pass_steps(full, empty, g, gl.cdiv(D, BLOCK_K), STAGES)
        else:
            acc = gl.zeros((HALF_M, BLOCK), gl.float32, mma)
            for k in range(0, D, BLOCK_K):
                s = g % STAGES
                mbarrier.wait(full.index(s), (g // STAGES) & 1)
                if A_GATHER:  # cp.async's generic-proxy writes before the wgmma's async-proxy reads
                    fence_async_shared()
                acc = warpgroup_mma(a_smem.index(2 * s + HALF), w_smem.index(s), acc, is_async=True)
                acc = release_step(acc, empty, s, k == 0, STAGES, True)
                g += 1
            acc = drain_steps(acc, empty, g, D > 0, STAGES, True)
            dact_epilogue(acc, n, row0 + HALF * HALF_M, row_end, h_ptr, row_w_ptr, d_h_ptr, act_w_ptr,
                          d_w_partial_ptr, stride_h, stride_d_h, stride_act_w, stride_partial, I, limit, alpha, ACT,
                          d_h_grid_ptr, D_H_GRID)


@gluon.jit
def dact_ws_kernel(dy_ptr, w_ptr, h_ptr, row_w_ptr, d_h_ptr, act_w_ptr, d_w_partial_ptr, stride_dy, stride_h,
                   stride_d_h, stride_act_w, stride_partial, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                   tile_run_ptr, num_tiles_ptr, rows, w_rows, D, I, limit, alpha, dy_index_ptr, d_h_grid_ptr,
                   ACT: gl.constexpr, NUM_PROGRAMS: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                   STAGES: gl.constexpr, A_GATHER: gl.constexpr = False, D_H_GRID: gl.constexpr = False,
                   SKIP_EMPTY_HALF: gl.constexpr = False):
    """One persistent launch of 128 x 128 BF16 dact tiles: dy `[rows, D]`, w = w_down `[w_rows = L*D, I]`, h `[rows,
    2I]` bf16, row_w `[rows]` fp32; out d_h `[rows, 2I]`, act_w `[rows, I]` bf16, d_w_partial `[rows, I/128]`.
    A_GATHER: dy row r is row ``dy_index[r]`` (int32) of dy `[S, D]` (one rank reads d_out in place of routed
    copies; else dy_index is never read). D_H_GRID: d_h rounded to the MXFP8 grid along 2I also stored at
    ``d_h_grid_ptr`` (d_h's strides; MXFP8 run as BF16 operands, dx's operand; else never written).
    SKIP_EMPTY_HALF: a tile of at most 64 rows runs one warpgroup's wgmmas (the same bits)."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK_K], gl.bfloat16)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK], gl.bfloat16)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, HALF_M, BLOCK_K], a_layout)
    w_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, BLOCK], w_layout)
    full, empty = ring_barriers(STAGES, full_arrivals(A_GATHER))
    gl.warp_specialize(
        [(_bf16_consumer, (h_ptr, row_w_ptr, d_h_ptr, act_w_ptr, d_w_partial_ptr, stride_h, stride_d_h, stride_act_w,
                           stride_partial, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr,
                           num_tiles_ptr, I, D, limit, alpha, a_smem, w_smem, full, empty, gl.constexpr(0),
                           gl.constexpr(ACT), gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_K),
                           gl.constexpr(GROUP_M), gl.constexpr(STAGES), gl.constexpr(A_GATHER), d_h_grid_ptr,
                           gl.constexpr(D_H_GRID), gl.constexpr(SKIP_EMPTY_HALF))),
         (_bf16_consumer, (h_ptr, row_w_ptr, d_h_ptr, act_w_ptr, d_w_partial_ptr, stride_h, stride_d_h, stride_act_w,
                           stride_partial, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr,
                           num_tiles_ptr, I, D, limit, alpha, a_smem, w_smem, full, empty, gl.constexpr(1),
                           gl.constexpr(ACT), gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_K),
                           gl.constexpr(GROUP_M), gl.constexpr(STAGES), gl.constexpr(A_GATHER), d_h_grid_ptr,
                           gl.constexpr(D_H_GRID), gl.constexpr(SKIP_EMPTY_HALF))),
         (kn_weights_producer, (dy_ptr, w_ptr, rows, w_rows, stride_dy, tile_expert_ptr, tile_row0_ptr,
                                tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, D, I, a_smem, w_smem, full, empty,
                                gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_K), gl.constexpr(GROUP_M),
                                gl.constexpr(STAGES), dy_index_ptr, gl.constexpr(A_GATHER),
                                gl.constexpr(SKIP_EMPTY_HALF)))],
        [4, GATHER_WARPS if A_GATHER else 1], [REGS_CONSUMER, REGS_GATHER if A_GATHER else REGS_PRODUCER])
    invalidate_ring(full, empty, STAGES)
