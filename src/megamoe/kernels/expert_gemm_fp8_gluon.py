"""FP8-block down projection in Gluon: the per-128-K promotion runs under the next step's wgmma.

Same task, operands and arithmetic as `megamoe.kernels.expert_gemm_fp8.down_fp8_kernel`
(persistent programs over device-built (row tile, n-tile) tasks; every K step of 128 runs the FP8
product into a fresh fp32 tile and folds it into the accumulator with the step's scales,
``acc += p * (a_scale[:, kb] * w_scale[nb, kb])``). What Triton 3.6 cannot express, Gluon can: the
step's product is issued asynchronously and the wait keeps one wgmma group in flight
(``warpgroup_mma_wait(1)``), so the promotion of step k-1 runs while the tensor cores compute step k.
Triton waits for every group right after the dot, and the tensor cores idle through each promotion.

    act_q [R, I] e4m3 (TMA, [BLOCK_M, 128] boxes), act_scale [R, I/128] fp32
    w_down_q [L*D, I] e4m3 (TMA, [BLOCK_N = 128, 128] boxes), scale [L, D/128, I/128] fp32
    y [R, D] bf16, rows < row_end of each tile

Pipeline: STAGES shared-memory slots per operand, one mbarrier each; a slot is refilled once the
wgmma that read it has completed in both warpgroups (a CTA barrier after the wait). Loads are
numbered across the program's tiles, so slots and barrier phases run on without a reset.
GPU only (Gluon has no interpreter): the CPU tests compile it for sm_90; the GPU tests compare it
bitwise with the Triton kernel.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from megamoe.kernels.expert_gemm import grouped_task

SCALE_BLOCK = gl.constexpr(128)


@gluon.jit
def _issue_load(act_desc, w_desc, a_smem, w_smem, bars, g, row0, w_row, k, pred, STAGES: gl.constexpr):
    """TMA loads of global step g (act rows row0.., W rows w_row.., columns k..k+128) into slot g % STAGES."""
    s = g % STAGES
    bar = bars.index(s)
    mbarrier.expect(bar, act_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(act_desc, [row0, k], bar, a_smem.index(s), pred=pred)
    tma.async_copy_global_to_shared(w_desc, [w_row, k], bar, w_smem.index(s), pred=pred)


@gluon.jit
def _task_coords(task, num_n, num_tiles, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, D,
                 BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """Task -> (expert, first row, row end, n-tile, first W row)."""
    tile, n = grouped_task(task, num_n, num_tiles, GROUP_M)
    expert = gl.load(tile_expert_ptr + tile)
    return expert, gl.load(tile_row0_ptr + tile), gl.load(tile_row_end_ptr + tile), n, expert * D + n * BLOCK_N


@gluon.jit
def _issue_first_loads(act_desc, w_desc, a_smem, w_smem, bars, g0, row0, w_row, num_k, pred,
                       STAGES: gl.constexpr):
    """The first min(STAGES, num_k) K steps of a task (global steps g0..), every slot being free."""
    for j in gl.static_range(STAGES):
        _issue_load(act_desc, w_desc, a_smem, w_smem, bars, g0 + j, row0, w_row, j * SCALE_BLOCK,
                    pred & (j < num_k), STAGES)


@gluon.jit
def _issue_step(act_desc, a_smem, w_smem, bars, g, zero, STAGES: gl.constexpr):
    """Wait for global step g's operands and issue its product into a fresh fp32 tile (async)."""
    s = g % STAGES
    mbarrier.wait(bars.index(s), (g // STAGES) & 1)
    return warpgroup_mma(a_smem.index(s), w_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _retire_step(acc, product, scale, act_desc, w_desc, a_smem, w_smem, bars, g0, j, row0, w_row, num_k,
                 IN_FLIGHT: gl.constexpr, STAGES: gl.constexpr):
    """Promote step j's product once at most IN_FLIGHT products are pending, then refill its slot with
    step j + STAGES (after both warpgroups are past step j's wgmma)."""
    p = warpgroup_mma_wait(num_outstanding=IN_FLIGHT, deps=(product,))
    acc = acc + p * gl.expand_dims(scale, 1)
    gl.thread_barrier()
    _issue_load(act_desc, w_desc, a_smem, w_smem, bars, g0 + j + STAGES, row0, w_row, (j + STAGES) * SCALE_BLOCK,
                j + STAGES < num_k, STAGES)
    return acc


@gluon.jit
def down_fp8_gluon_kernel(
    act_desc, w_desc, act_scale_ptr, w_scale_ptr, y_ptr,
    stride_as, stride_ws_n, stride_y,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, num_tiles_ptr,
    D, K,
    NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """Persistent FP8-block down projection over every (row tile, n-tile) task (K % 128 == 0).

    A task's first loads are issued before the previous task's epilogue, and each step's scales one
    step before its promotion (their latency under a wgmma)."""
    BLOCK_M: gl.constexpr = act_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    gl.static_assert(BLOCK_N == SCALE_BLOCK, "one weight scale per K step: BLOCK_N = 128")
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

    a_smem = gl.allocate_shared_memory(act_desc.dtype, [STAGES] + act_desc.block_type.shape, act_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(STAGES):
        mbarrier.init(bars.index(slot), count=1)

    num_n = gl.cdiv(D, BLOCK_N)
    num_tiles = gl.load(num_tiles_ptr)
    num_tasks = num_tiles * num_n
    num_k = K // SCALE_BLOCK
    zero = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
    first = gl.program_id(0)
    if first < num_tasks:
        _, row0, _, _, w_row = _task_coords(first, num_n, num_tiles, tile_expert_ptr, tile_row0_ptr,
                                            tile_row_end_ptr, D, BLOCK_N, GROUP_M)
        _issue_first_loads(act_desc, w_desc, a_smem, w_smem, bars, 0, row0, w_row, num_k, True, STAGES)
    done = 0  # tasks this program has finished: its loads are numbered done * num_k + step
    for task in range(first, num_tasks, NUM_PROGRAMS):
        expert, row0, row_end, n, w_row = _task_coords(task, num_n, num_tiles, tile_expert_ptr, tile_row0_ptr,
                                                       tile_row_end_ptr, D, BLOCK_N, GROUP_M)
        g0 = done * num_k
        rows = row0 + gl.arange(0, BLOCK_M, layout=rows_layout)
        as_rows = act_scale_ptr + rows.to(gl.int64) * stride_as
        row_ok = rows < row_end
        ws = w_scale_ptr + (expert.to(gl.int64) * num_n + n) * stride_ws_n

        # Two product tiles alternate (a, b): one is promoted while the other's wgmma runs. Unrolled by
        # two so that neither is copied while its wgmma is in flight (ptxas would serialise them).
        acc = zero
        prod_a = _issue_step(act_desc, a_smem, w_smem, bars, g0, zero, STAGES)
        scale_a = gl.load(as_rows, mask=row_ok, other=0.0) * gl.load(ws)
        for k in range(1, num_k - 1, 2):
            prod_b = _issue_step(act_desc, a_smem, w_smem, bars, g0 + k, zero, STAGES)
            scale_b = gl.load(as_rows + k, mask=row_ok, other=0.0) * gl.load(ws + k)
            acc = _retire_step(acc, prod_a, scale_a, act_desc, w_desc, a_smem, w_smem, bars, g0, k - 1, row0, w_row,
                               num_k, 1, STAGES)
            prod_a = _issue_step(act_desc, a_smem, w_smem, bars, g0 + k + 1, zero, STAGES)
            scale_a = gl.load(as_rows + (k + 1), mask=row_ok, other=0.0) * gl.load(ws + (k + 1))
            acc = _retire_step(acc, prod_b, scale_b, act_desc, w_desc, a_smem, w_smem, bars, g0, k, row0, w_row,
                               num_k, 1, STAGES)
        if num_k % 2 == 0:  # the last step, num_k - 1, is left
            last = num_k - 1
            prod_b = _issue_step(act_desc, a_smem, w_smem, bars, g0 + last, zero, STAGES)
            scale_b = gl.load(as_rows + last, mask=row_ok, other=0.0) * gl.load(ws + last)
            acc = _retire_step(acc, prod_a, scale_a, act_desc, w_desc, a_smem, w_smem, bars, g0, last - 1, row0,
                               w_row, num_k, 1, STAGES)
            acc = _retire_step(acc, prod_b, scale_b, act_desc, w_desc, a_smem, w_smem, bars, g0, last, row0,
                               w_row, num_k, 0, STAGES)
        else:
            acc = _retire_step(acc, prod_a, scale_a, act_desc, w_desc, a_smem, w_smem, bars, g0, num_k - 1, row0,
                               w_row, num_k, 0, STAGES)
        # every slot is free (the last retire's barrier): the next task's first loads go now, under this epilogue
        done += 1
        following = task + NUM_PROGRAMS
        if following < num_tasks:
            _, next_row0, _, _, next_w_row = _task_coords(following, num_n, num_tiles, tile_expert_ptr,
                                                          tile_row0_ptr, tile_row_end_ptr, D, BLOCK_N, GROUP_M)
            _issue_first_loads(act_desc, w_desc, a_smem, w_smem, bars, done * num_k, next_row0, next_w_row,
                               num_k, True, STAGES)

        out = gl.convert_layout(acc.to(y_ptr.dtype.element_ty), out_layout)
        out_rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_layout))
        cols = n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_layout))
        mask = gl.expand_dims(out_rows < row_end, 1) & gl.expand_dims(cols < D, 0)
        ptrs = y_ptr + gl.expand_dims(out_rows.to(gl.int64) * stride_y, 1) + gl.expand_dims(cols, 0)
        gl.store(ptrs, out, mask=mask)

    for slot in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(slot))
