"""Backward expert GEMM tiles in MXFP8 (E4M3 elements, an E8M0 scale per 32 along each GEMM's reduction axis):
the dact dgrad (its epilogue the BF16 one's) and the weight gradients on operands quantised along the tokens.

    dy_q [R, D] e4m3, dy_scale [R, D/32] u8              upstream gradient rows, 32-blocks along D
    w_down_t_q [L*I, D] e4m3, scale [L*I, D/32] u8        w_downᵀ quantised along D (dact's K), not the forward's
    g = dy · w_down[l]  ->  the BF16 dact epilogue (SwiGLU backward in FP32 from h, d_h, act_w, router partials)

    a_t_q [M_out, R_pad] e4m3, a_scale [M_out, R_pad/32] u8  an operand transposed, 32-blocks along the tokens;
    b_t_q [N_out, R_pad] e4m3, b_scale [N_out, R_pad/32] u8  each expert's rows start a 128-row span, zero-padded
    out[l] = Σ over expert l's spans of dequant(a_t_q) · dequant(b_t_q)ᵀ                  [L, M_out, N_out] bf16

Hopper has no block-scaled MMA: both dequantise each loaded tile to bf16 (exact, see
`megamoe.kernels.expert_gemm_mxfp8`) and chain bf16 wgmmas in fp32. The dx dgrad is the forward's down kernel on
w_gate_upᵀ quantised along 2I.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megamoe.kernels.convert import to_bf16
from megamoe.kernels.expert_gemm import tile_dot
from megamoe.kernels.tasks import first_task, tile_task
from megamoe.kernels.expert_gemm_bwd import dact_epilogue
from megamoe.kernels.wgrad_carry import carry_end, carry_start, wgrad_mode
from megamoe.kernels.expert_gemm_mxfp8 import _block_scales, _dequant, _mx_gemm_pair

#: The rows each expert's token span is padded to (a multiple of every BLOCK_K the wgrad takes).
SPAN: tl.constexpr = tl.constexpr(128)


@triton.jit
def dact_mxfp8_kernel(
    dy_desc, w_t_desc, dy_scale_ptr, w_t_scale_ptr, h_ptr, row_w_ptr, d_h_ptr, act_w_ptr, d_w_partial_ptr,
    stride_dys, stride_ws, stride_h, stride_d_h, stride_act_w, stride_partial,
    tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr,
    D, I, W_ROWS, limit, alpha,
    ACT: tl.constexpr, DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    """Persistent MXFP8 dact over every (row tile, n-tile) task: g = dequant(dy_q) · dequant(w_down_t_q[l])ᵀ
    (K = D), then the BF16 dact epilogue. W_ROWS: rows of the flattened [L*I, D] weight."""
    num_n = tl.cdiv(I, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr)
    for task in tl.range(tl.program_id(0), num_tiles * num_n, NUM_PROGRAMS, flatten=FLATTEN):
        expert, row0, row_end, n = tile_task(
            task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, GROUP_M)
        row_ok = row0 + tl.arange(0, BLOCK_M) < row_end
        g, _unused = _mx_gemm_pair(dy_desc, w_t_desc, dy_scale_ptr, w_t_scale_ptr, stride_dys, stride_ws, row0,
                                   row_ok, expert * I + n * BLOCK_N, 0, W_ROWS, D, False, DOT_FP32,
                                   BLOCK_M, BLOCK_N, BLOCK_K)
        dact_epilogue(g, h_ptr + row0.to(tl.int64) * stride_h, row_w_ptr, d_h_ptr, act_w_ptr, d_w_partial_ptr,
                      stride_h, stride_d_h, stride_act_w, stride_partial, row0, row_end, n, I, limit, alpha, ACT,
                      DOT_FP32, BLOCK_M, BLOCK_N)


@triton.jit
def wgrad_mxfp8_kernel(
    a_desc, b_desc, a_scale_ptr, b_scale_ptr, out_ptr, span0_ptr, counts_ptr, num_experts, OUT_M, OUT_N, K,
    stride_as, stride_bs, modes_ptr, carry_in_ptr, carry_out_ptr,
    DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FLATTEN: tl.constexpr, CARRY: tl.constexpr = False,
):
    """out[l] = A[rows of l]ᵀ · B[rows of l] from the token-axis-quantised transposes (module docstring):
    expert l's rows are its ``cdiv(counts[l], 128)`` spans from span ``span0[l]``, reduced in order; an expert
    with no rows gets zeros. CARRY: one window of the backward's rows, as ``wgrad_kernel``
    (``megamoe.kernels.wgrad_carry``). K: the padded rows (R_pad). Tasks are (expert, m-tile, n-tile) blocks dealt
    round-robin; each expert's output block is stored through a TMA descriptor made here, as the fp8-block
    wgrad's (launch with ``megamoe.ops.launch.scratch_allocator``)."""
    tl.static_assert(SPAN % BLOCK_K == 0, "a K step must not cross a span")
    num_n = tl.cdiv(OUT_N, BLOCK_N)
    per_expert = tl.cdiv(OUT_M, BLOCK_M) * num_n
    pid = tl.program_id(0)
    for expert in range(0, num_experts):
        first = first_task(pid, NUM_PROGRAMS, expert * per_expert)
        mode = wgrad_mode(modes_ptr, expert, CARRY)
        if (first < per_expert) & (mode != 0):
            k0 = tl.load(span0_ptr + expert) * SPAN
            k_end = k0 + tl.cdiv(tl.load(counts_ptr + expert), SPAN) * SPAN
            out_desc = tl.make_tensor_descriptor(out_ptr + tl.cast(expert, tl.int64) * OUT_M * OUT_N,
                                                 shape=[OUT_M, OUT_N], strides=[OUT_N, 1],
                                                 block_shape=[BLOCK_M, BLOCK_N])
            for task in tl.range(first, per_expert, NUM_PROGRAMS, flatten=FLATTEN):
                m0 = task // num_n * BLOCK_M
                n0 = task % num_n * BLOCK_N
                ms = m0 + tl.arange(0, BLOCK_M)
                ns = n0 + tl.arange(0, BLOCK_N)
                acc = carry_start(mode, carry_in_ptr, m0, n0, OUT_M, OUT_N, CARRY, BLOCK_M, BLOCK_N)
                for k in range(k0, k_end, BLOCK_K):
                    a = _dequant(a_desc.load([m0, k]), _block_scales(a_scale_ptr, ms.to(tl.int64), stride_as, k, K,
                                                                     ms < OUT_M, BLOCK_K), DOT_FP32)
                    b = _dequant(b_desc.load([n0, k]), _block_scales(b_scale_ptr, ns.to(tl.int64), stride_bs, k, K,
                                                                     ns < OUT_N, BLOCK_K), DOT_FP32)
                    acc = tile_dot(a, b.T, acc, DOT_FP32)
                if carry_end(acc, mode, carry_out_ptr, m0, n0, OUT_M, OUT_N, CARRY, BLOCK_M, BLOCK_N):
                    out_desc.store([m0, n0], to_bf16(acc, DOT_FP32))
