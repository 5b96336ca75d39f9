"""FP8-block down projection in Gluon, warp-specialised: one warpgroup promotes while the other's wgmma runs.

Same tasks, operands and arithmetic as `megamoe.kernels.expert_gemm_fp8.down_fp8_kernel`
(persistent programs over device-built (row tile, n-tile) tasks; every 128-K step's FP8 product goes
into a fresh fp32 tile and is folded into the accumulator with the step's scales,
``acc += p * (a_scale[:, kb] * w_scale[nb, kb])``), so the same bits. The structure is what Triton 3.6
cannot express: its two warpgroups move in step (CTA barriers around every pipeline stage), and each
waits for its wgmma before promoting, so the tensor cores idle through every promotion. Here

- a producer warp issues the TMA loads of every task's K steps into STAGES slots (``full`` barriers,
  with the bytes expected), waiting for a slot's ``empty`` barrier before refilling it;
- two consumer warpgroups (partitions of 4 warps, rows 0-63 and 64-127 of the tile) each wait for a
  slot, run their wgmma, wait for it, promote, and release the slot (one arrive each on ``empty``).
  Nothing but the barriers ties them, so one's promotion runs under the other's wgmma.

A tile is 128 rows x BLOCK_N = 128 or 256 columns; with 256 a warpgroup computes its two 128-column
halves one after the other (one fresh product tile at a time: 192 accumulator registers, not 256), and
every K step reads 48 KB for 8.4 MFLOP instead of 32 KB for 4.2: these kernels are bound by the
L2-to-SM bytes (~5.5-6 TB/s), not by the tensor cores.

    act_q [R, I] e4m3 (TMA, [128, 128] boxes), act_scale [R, I/128] fp32
    w_down_q [L*D, I] e4m3 (TMA, [BLOCK_N, 128] boxes), scale [L, D/128, I/128] fp32
    y [R, D] bf16, rows < row_end of each tile

GPU only (Gluon has no interpreter mode): the CPU tests compile it for sm_90; the GPU tests compare it
bitwise with the Triton kernel.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from megamoe.kernels.expert_gemm import grouped_task

SCALE_BLOCK = gl.constexpr(128)
HALF_M = gl.constexpr(64)  # rows of one consumer warpgroup


@gluon.jit
def _task_coords(task, num_n, num_tiles, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, D,
                 BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """Task -> (expert, first row, row end, n-tile, first W row)."""
    tile, n = grouped_task(task, num_n, num_tiles, GROUP_M)
    expert = gl.load(tile_expert_ptr + tile)
    return expert, gl.load(tile_row0_ptr + tile), gl.load(tile_row_end_ptr + tile), n, expert * D + n * BLOCK_N


@gluon.jit
def _producer(act_desc, w_desc, a_smem, w_smem, full, empty,
              tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, num_tiles_ptr, D, K,
              NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """TMA loads of every K step of the program's tasks, STAGES slots ahead of the consumers."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    num_n = gl.cdiv(D, BLOCK_N)
    num_tiles = gl.load(num_tiles_ptr)
    num_k = K // SCALE_BLOCK
    g = 0  # the program's K steps, numbered across its tasks: slot g % STAGES, phase (g // STAGES) & 1
    for task in range(gl.program_id(0), num_tiles * num_n, NUM_PROGRAMS):
        _, row0, _, _, w_row = _task_coords(task, num_n, num_tiles, tile_expert_ptr, tile_row0_ptr,
                                            tile_row_end_ptr, D, BLOCK_N, GROUP_M)
        for k in range(num_k):
            s = g % STAGES
            mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)  # the first round finds every slot free
            mbarrier.expect(full.index(s), act_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(act_desc, [row0, k * SCALE_BLOCK], full.index(s), a_smem.index(s))
            tma.async_copy_global_to_shared(w_desc, [w_row, k * SCALE_BLOCK], full.index(s), w_smem.index(s))
            g += 1


@gluon.jit
def _promote_half(acc, a, w_slot, h: gl.constexpr, zero, scale):
    """acc + (a · w_slot[h*128 : h*128+128]ᵀ) * scale[:, None]: one fresh product, waited for at once."""
    p = warpgroup_mma(a, w_slot.slice(h * SCALE_BLOCK, SCALE_BLOCK, dim=0).permute((1, 0)), zero, use_acc=False,
                      is_async=True)
    p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
    return acc + p * gl.expand_dims(scale, 1)


@gluon.jit
def _store_half(y_ptr, acc, rows, row_ok, col0, D, stride_y, cols_layout: gl.constexpr):
    cols = col0 + gl.arange(0, SCALE_BLOCK, layout=cols_layout)
    mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < D, 0)
    ptrs = y_ptr + gl.expand_dims(rows.to(gl.int64) * stride_y, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _consumer(a_smem, w_smem, full, empty, act_scale_ptr, w_scale_ptr, y_ptr, stride_as, stride_ws_n, stride_y,
              tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, num_tiles_ptr, D, K,
              HALF: gl.constexpr, NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """Rows HALF*64 .. HALF*64+63 of every task's [128 x BLOCK_N] output tile (one warpgroup)."""
    BLOCK_N: gl.constexpr = w_smem.shape[1]
    TWO: gl.constexpr = BLOCK_N == 2 * SCALE_BLOCK
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, SCALE_BLOCK, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    num_n = gl.cdiv(D, BLOCK_N)
    num_nb = D // SCALE_BLOCK
    num_tiles = gl.load(num_tiles_ptr)
    num_k = K // SCALE_BLOCK
    zero = gl.zeros((HALF_M, SCALE_BLOCK), gl.float32, mma)
    g = 0
    for task in range(gl.program_id(0), num_tiles * num_n, NUM_PROGRAMS):
        expert, row0, row_end, n, _ = _task_coords(task, num_n, num_tiles, tile_expert_ptr, tile_row0_ptr,
                                                   tile_row_end_ptr, D, BLOCK_N, GROUP_M)
        rows = row0 + HALF * HALF_M + gl.arange(0, HALF_M, layout=rows_layout)
        row_ok = rows < row_end
        as_rows = act_scale_ptr + rows.to(gl.int64) * stride_as
        nb = n * (BLOCK_N // SCALE_BLOCK)
        ws = w_scale_ptr + (expert.to(gl.int64) * num_nb + nb) * stride_ws_n
        second_ok = nb + 1 < num_nb  # D a multiple of 128, not always of 256
        acc0 = zero
        acc1 = zero
        a_s = gl.load(as_rows, mask=row_ok, other=0.0)
        w_s0 = gl.load(ws)
        w_s1 = gl.load(ws + stride_ws_n, mask=TWO & second_ok, other=0.0)
        for k in range(num_k):
            s = g % STAGES
            mbarrier.wait(full.index(s), (g // STAGES) & 1)
            a = a_smem.index(s).slice(HALF * HALF_M, HALF_M, dim=0)
            more = k + 1 < num_k  # the next step's scales load under this step's wgmma
            next_a_s = gl.load(as_rows + (k + 1), mask=row_ok & more, other=0.0)
            next_w_s0 = gl.load(ws + (k + 1), mask=more, other=0.0)
            next_w_s1 = gl.load(ws + stride_ws_n + (k + 1), mask=TWO & second_ok & more, other=0.0)
            acc0 = _promote_half(acc0, a, w_smem.index(s), 0, zero, a_s * w_s0)
            if TWO:
                acc1 = _promote_half(acc1, a, w_smem.index(s), 1, zero, a_s * w_s1)
            mbarrier.arrive(empty.index(s), count=1)
            a_s, w_s0, w_s1 = next_a_s, next_w_s0, next_w_s1
            g += 1
        cols_layout: gl.constexpr = gl.SliceLayout(0, mma)
        _store_half(y_ptr, acc0, rows, row_ok, n * BLOCK_N, D, stride_y, cols_layout)
        if TWO:
            _store_half(y_ptr, acc1, rows, row_ok, n * BLOCK_N + SCALE_BLOCK, D, stride_y, cols_layout)


@gluon.jit
def down_fp8_gluon_kernel(
    act_desc, w_desc, act_scale_ptr, w_scale_ptr, y_ptr,
    stride_as, stride_ws_n, stride_y,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, num_tiles_ptr,
    D, K,
    NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
):
    """Persistent FP8-block down projection over every (row tile, n-tile) task (K % 128 == 0); 4 warps
    here (the first consumer), 4 + 1 in the worker partitions."""
    gl.static_assert(act_desc.block_type.shape[0] == 2 * HALF_M, "act boxes of 128 rows: two consumers")
    gl.static_assert(w_desc.block_type.shape[0] == SCALE_BLOCK or w_desc.block_type.shape[0] == 2 * SCALE_BLOCK,
                     "W boxes of 128 or 256 rows")
    a_smem = gl.allocate_shared_memory(act_desc.dtype, [STAGES] + act_desc.block_type.shape, act_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(STAGES):
        mbarrier.init(full.index(slot), count=1)
        mbarrier.init(empty.index(slot), count=2)  # one arrive per consumer warpgroup
    # constexprs reach the partitions only wrapped, in tuples written out (joined tuples unwrap them)
    gl.warp_specialize(
        [(_consumer, (a_smem, w_smem, full, empty, act_scale_ptr, w_scale_ptr, y_ptr, stride_as, stride_ws_n,
                      stride_y, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, num_tiles_ptr, D, K,
                      gl.constexpr(0), gl.constexpr(NUM_PROGRAMS), gl.constexpr(GROUP_M), gl.constexpr(STAGES))),
         (_consumer, (a_smem, w_smem, full, empty, act_scale_ptr, w_scale_ptr, y_ptr, stride_as, stride_ws_n,
                      stride_y, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, num_tiles_ptr, D, K,
                      gl.constexpr(1), gl.constexpr(NUM_PROGRAMS), gl.constexpr(GROUP_M), gl.constexpr(STAGES))),
         (_producer, (act_desc, w_desc, a_smem, w_smem, full, empty, tile_expert_ptr, tile_row0_ptr,
                      tile_row_end_ptr, num_tiles_ptr, D, K, gl.constexpr(NUM_PROGRAMS), gl.constexpr(GROUP_M),
                      gl.constexpr(STAGES)))],
        [4, 1], [232, 40])
    for slot in gl.static_range(STAGES):
        mbarrier.invalidate(full.index(slot))
        mbarrier.invalidate(empty.index(slot))
