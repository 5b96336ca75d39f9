"""Backward expert GEMM tiles in FP8-block: the dact dgrad on E4M3 operands (its epilogue the BF16 one's), and
the weight gradients on operands quantised along the token axis.

    dy_q [R, D] e4m3, dy_scale [R, D/128]            upstream gradient rows, 1x128 blocks along D
    w_down_t_q [L*I, D] e4m3, scale [L, I/128, D/128]  w_downᵀ per expert, 128x128 blocks
    g = dy · w_down[l]  ->  the BF16 dact epilogue (SwiGLU backward in FP32 from h, d_h, act_w, router partials)

    a_t_q [M_out, R_pad] e4m3, a_scale [R_pad/128, M_out]  an operand transposed, 128-row blocks of each expert's
    b_t_q [N_out, R_pad] e4m3, b_scale [R_pad/128, N_out]  rows (each expert's rows start a block; zero-padded)
    out[l] = Σ_kb (a_t_q[:, kb] · b_t_q[:, kb]ᵀ) * (a_scale[kb] ⊗ b_scale[kb])   [L, M_out, N_out] bf16

Promotion as in the forward (`megamoe.kernels.expert_gemm_fp8`): one fresh FP8 product per 128-K block, folded
into the fp32 accumulator with its scales. The dx dgrad is the forward's down kernel on w_gate_upᵀ.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megamoe.kernels.convert import to_bf16
from megamoe.kernels.tasks import first_task, tile_task
from megamoe.kernels.expert_gemm_bwd import dact_epilogue
from megamoe.kernels.wgrad_carry import carry_end, carry_start, wgrad_mode
from megamoe.kernels.expert_gemm_fp8 import _dot_block, _w_scales


@triton.jit
def dact_fp8_kernel(
    dy_desc, w_t_desc, dy_scale_ptr, w_t_scale_ptr, h_ptr, row_w_ptr, d_h_ptr, act_w_ptr, d_w_partial_ptr,
    stride_dys, stride_ws_n, stride_h, stride_d_h, stride_act_w, stride_partial,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr,
    D, I, limit, alpha,
    ACT: tl.constexpr, DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
):
    """Persistent FP8 dact over every (row tile, n-tile) task: g = dequant(dy_q) · dequant(w_down_t_q[l])ᵀ
    (K = D), then the BF16 dact epilogue."""
    tl.static_assert(BLOCK_N <= 128, "dact tiles lie in one 128-row weight block (one scale per K step)")
    num_n = tl.cdiv(I, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr)
    for task in tl.range(tl.program_id(0), num_tiles * num_n, NUM_PROGRAMS, flatten=FLATTEN):
        expert, row0, row_end, n = tile_task(
            task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, GROUP_M)
        n0 = n * BLOCK_N
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        ds_rows = dy_scale_ptr + rows.to(tl.int64) * stride_dys
        ws_base = w_t_scale_ptr + expert.to(tl.int64) * (I // 128) * stride_ws_n
        g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, D, 128):
            kb = k // 128
            a = dy_desc.load([row0, k])
            w = w_t_desc.load([expert * I + n0, k])
            a_s = tl.load(ds_rows + kb, mask=row_ok, other=0.0)
            g += _dot_block(a, w, DOT_FP32) * (a_s[:, None] * _w_scales(ws_base, n0, kb, stride_ws_n, BLOCK_N))
        dact_epilogue(g, h_ptr + row0.to(tl.int64) * stride_h, row_w_ptr, d_h_ptr, act_w_ptr, d_w_partial_ptr,
                      stride_h, stride_d_h, stride_act_w, stride_partial, row0, row_end, n, I, limit, alpha, ACT,
                      DOT_FP32, BLOCK_M, BLOCK_N)


@triton.jit
def wgrad_fp8_kernel(
    a_desc, b_desc, a_scale_ptr, b_scale_ptr, out_ptr, block0_ptr, counts_ptr, num_experts, OUT_M, OUT_N,
    stride_as, stride_bs, modes_ptr, carry_in_ptr, carry_out_ptr,
    DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FLATTEN: tl.constexpr, CARRY: tl.constexpr = False,
):
    """out[l] = A[rows of l]ᵀ · B[rows of l] from the token-axis-quantised transposes (module docstring):
    expert l's rows are its ``cdiv(counts[l], 128)`` blocks from block ``block0[l]``, reduced in order; an
    expert with no rows gets zeros. CARRY: one window of the backward's rows, as ``wgrad_kernel``
    (``megamoe.kernels.wgrad_carry``). Tasks are (expert, m-tile, n-tile) blocks dealt round-robin. A K step's
    scales are ``[R_pad/128, C]`` rows (``stride_as`` / ``stride_bs`` apart), contiguous along the block's
    rows or columns. Each expert's output block is stored through a TMA descriptor made here (launch with
    ``megamoe.ops.launch.scratch_allocator``): it clips partial blocks and leaves the registers to the next
    block's MMAs. The promotion still waits on the scale loads (ncu: the first FMULs on them hold ~17 % of
    the stall samples); TMA boxes of scales and a prefetch a step ahead in registers were both slower
    (the latter spills; 2026-12-02-fp8-backward-tiles)."""
    num_n = tl.cdiv(OUT_N, BLOCK_N)
    per_expert = tl.cdiv(OUT_M, BLOCK_M) * num_n
    pid = tl.program_id(0)
    for expert in range(0, num_experts):
        first = first_task(pid, NUM_PROGRAMS, expert * per_expert)
        mode = wgrad_mode(modes_ptr, expert, CARRY)
        if (first < per_expert) & (mode != 0):
            kb0 = tl.load(block0_ptr + expert)
            kb_end = kb0 + tl.cdiv(tl.load(counts_ptr + expert), 128)
            out_desc = tl.make_tensor_descriptor(out_ptr + tl.cast(expert, tl.int64) * OUT_M * OUT_N,
                                                 shape=[OUT_M, OUT_N], strides=[OUT_N, 1],
                                                 block_shape=[BLOCK_M, BLOCK_N])
            for task in tl.range(first, per_expert, NUM_PROGRAMS, flatten=FLATTEN):
                m0 = task // num_n * BLOCK_M
                n0 = task % num_n * BLOCK_N
                ms = m0 + tl.arange(0, BLOCK_M)
                ns = n0 + tl.arange(0, BLOCK_N)
                acc = carry_start(mode, carry_in_ptr, m0, n0, OUT_M, OUT_N, CARRY, BLOCK_M, BLOCK_N)
                for kb in range(kb0, kb_end):
                    a = a_desc.load([m0, kb * 128])
                    b = b_desc.load([n0, kb * 128])
                    sa = tl.load(a_scale_ptr + kb * stride_as + ms, mask=ms < OUT_M, other=0.0)
                    sb = tl.load(b_scale_ptr + kb * stride_bs + ns, mask=ns < OUT_N, other=0.0)
                    acc += _dot_block(a, b, DOT_FP32) * (sa[:, None] * sb[None, :])
                if carry_end(acc, mode, carry_out_ptr, m0, n0, OUT_M, OUT_N, CARRY, BLOCK_M, BLOCK_N):
                    out_desc.store([m0, n0], to_bf16(acc, DOT_FP32))
