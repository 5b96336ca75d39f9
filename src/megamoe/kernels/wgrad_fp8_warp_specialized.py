"""The FP8-block expert wgrad on Hopper, warp-specialised in Gluon: a TMA producer warp and two MMA warpgroups.

``wgrad_fp8_kernel``'s contract (`megamoe.kernels.expert_gemm_fp8_bwd`: operands quantised along each expert's
tokens, transposed, each expert's rows from a 128-row block ``block0[l]``, zero-padded), its 128 x 128 blocks dealt
expert by expert round-robin, and its bits: each block's K steps (the expert's token blocks, in order) are promoted
as ``acc += p * (a_scale ⊗ b_scale)``. An expert's K loop is short (a 341-row expert has 3 steps), so in the Triton
kernel every block pays the pipeline's fill and its store. Here

- a producer warp walks the program's blocks and issues every K step's TMA loads (the A block's two 64-row halves
  and the B block) into a ring that runs on across blocks and experts; the descriptors span the whole padded
  operands, are made once and never rewritten (the padding is real zeros, so no expert needs its own);
  with the step's two scale rows (A's 128, B's 128) beside them, so no consumer waits on a global load;
- two consumer warpgroups, rows 0-63 and 64-127 of each block, each wait for a step, run its product, read the
  scales from the slot, wait for the product, release the slot and promote it (one warpgroup's promotion under the
  other's wgmmas), then store their 64 x 128 half by TMA through one 3-D descriptor over every expert's block (a
  partial block is clipped at its expert's edge), waited for only before the buffer's next use.

Measured (benchmarks/results/2026-12-04-fp8-backward-warp-specialized, 2026-12-04-fp8-dact-warp-specialized): both
wgrads 14.8 -> 12.2 ms on kimi-k2's 341-row experts with the scales loaded by the consumers a step ahead, 10.5 ms
with them in the ring; latency-bound (the promotion costs two FP32 operations per element).

With CARRY (one window of the backward's rows, ``megamoe.kernels.wgrad_carry``) both sides skip an expert
without a mode, and a block's accumulator starts from ``carry_in`` and ends in ``carry_out`` as
``wgrad_fp8_kernel``'s (the promotion adds to it), through the BF16 wgrad's helpers.

GPU only (Gluon has no interpreter); `megamoe.ops.experts_fp8_bwd` runs it on Hopper for 128 x 128 blocks and a GPU
test holds it to ``wgrad_fp8_kernel``'s bits. Launch with a scratch allocator (the descriptors), 4 warps.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from megamoe.kernels.gluon_ring import invalidate_ring, ring_barriers
from megamoe.kernels.wgrad_blocks import carry_end_half, carry_start_half, store_half
from megamoe.kernels.wgrad_warp_specialized import window_task

HALF_M = gl.constexpr(64)  # rows of one consumer warpgroup
BLOCK = gl.constexpr(128)  # the K step (a scale block of tokens) and the block's columns
REGS_CONSUMER, REGS_PRODUCER = gl.constexpr(232), gl.constexpr(40)  # 232 for the first consumer too (see below)


@gluon.jit
def _producer(a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, block0_ptr, counts_ptr, modes_ptr, num_experts, OUT_M, OUT_N,
              K_PAD, stride_as, stride_bs, a_smem, b_smem, as_smem, bs_smem, full, empty, NUM_PROGRAMS: gl.constexpr,
              STAGES: gl.constexpr, CARRY: gl.constexpr):
    """This program's K steps, block by block, expert by expert: slot g % STAGES, phase (g // STAGES) & 1; a
    step's operand blocks and scale rows land in the slot."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK], gl.float8e4nv)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], gl.float8e4nv)
    s_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK], gl.float32)
    a_desc = tma.make_tensor_descriptor(a_ptr, [OUT_M, K_PAD], [K_PAD, 1], [HALF_M, BLOCK], a_layout)
    b_desc = tma.make_tensor_descriptor(b_ptr, [OUT_N, K_PAD], [K_PAD, 1], [BLOCK, BLOCK], b_layout)
    as_desc = tma.make_tensor_descriptor(a_scale_ptr, [K_PAD // BLOCK, OUT_M], [stride_as, 1], [1, BLOCK], s_layout)
    bs_desc = tma.make_tensor_descriptor(b_scale_ptr, [K_PAD // BLOCK, OUT_N], [stride_bs, 1], [1, BLOCK], s_layout)
    step_bytes: gl.constexpr = 2 * BLOCK * BLOCK + 2 * BLOCK * 4  # A and B 128 x 128 e4m3, two fp32 scale rows
    num_n = gl.cdiv(OUT_N, BLOCK)
    per_expert = gl.cdiv(OUT_M, BLOCK) * num_n
    g = 0
    for expert in range(0, num_experts):
        kb0 = gl.load(block0_ptr + expert)
        kb_end = kb0 + gl.cdiv(gl.load(counts_ptr + expert), BLOCK)
        first, _ = window_task(expert, per_expert, modes_ptr, NUM_PROGRAMS, CARRY)
        for task in range(first, per_expert, NUM_PROGRAMS):
            m0 = task // num_n * BLOCK
            n0 = task % num_n * BLOCK
            for kb in range(kb0, kb_end):
                s = g % STAGES
                mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)  # the first round finds every slot free
                mbarrier.expect(full.index(s), step_bytes)
                tma.async_copy_global_to_shared(a_desc, [m0, kb * BLOCK], full.index(s), a_smem.index(2 * s))
                tma.async_copy_global_to_shared(a_desc, [m0 + HALF_M, kb * BLOCK], full.index(s),
                                                a_smem.index(2 * s + 1))
                tma.async_copy_global_to_shared(b_desc, [n0, kb * BLOCK], full.index(s), b_smem.index(s))
                tma.async_copy_global_to_shared(as_desc, [kb, m0], full.index(s), as_smem.index(s))
                tma.async_copy_global_to_shared(bs_desc, [kb, n0], full.index(s), bs_smem.index(s))
                g += 1


@gluon.jit
def _consumer(out_ptr, block0_ptr, counts_ptr, modes_ptr, carry_in_ptr, carry_out_ptr, num_experts, OUT_M, OUT_N,
              a_smem, b_smem, as_smem, bs_smem, c_smem, full, empty, HALF: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
              STAGES: gl.constexpr, CARRY: gl.constexpr):
    """Rows HALF * 64 .. HALF * 64 + 63 of every block of this program (one warpgroup)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 32])
    num_n = gl.cdiv(OUT_N, BLOCK)
    per_expert = gl.cdiv(OUT_M, BLOCK) * num_n
    # one descriptor over every expert's block (3-D: a partial block is clipped at its expert's edge), made once: a
    # store in flight reads it until it lands, so it is never rewritten
    out_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, HALF_M, BLOCK], gl.bfloat16)
    out_desc = tma.make_tensor_descriptor(out_ptr, [num_experts, OUT_M, OUT_N], [OUT_M * OUT_N, OUT_N, 1],
                                          [1, HALF_M, BLOCK], out_layout)
    g = 0
    for expert in range(0, num_experts):
        kb0 = gl.load(block0_ptr + expert)
        kb_end = kb0 + gl.cdiv(gl.load(counts_ptr + expert), BLOCK)
        first, mode = window_task(expert, per_expert, modes_ptr, NUM_PROGRAMS, CARRY)
        for task in range(first, per_expert, NUM_PROGRAMS):
            m0 = task // num_n * BLOCK + HALF * HALF_M
            n0 = task % num_n * BLOCK
            if CARRY:
                acc = carry_start_half(mode, carry_in_ptr, m0, n0, OUT_M, OUT_N, mma, HALF_M, BLOCK)
            else:
                acc = gl.zeros((HALF_M, BLOCK), gl.float32, mma)
            for kb in range(kb0, kb_end):
                s = g % STAGES
                mbarrier.wait(full.index(s), (g // STAGES) & 1)
                p = warpgroup_mma(a_smem.index(2 * s + HALF), b_smem.index(s).permute((1, 0)),
                                  gl.zeros((HALF_M, BLOCK), gl.float32, mma), use_acc=False, is_async=True)
                # the scales from the slot, [64, 1] and [1, 128] in the product's layout, under its wgmmas
                sa_col = as_smem.index(s).slice(HALF * HALF_M, HALF_M, dim=1).permute((1, 0)).load(mma)
                sb_row = bs_smem.index(s).load(mma)
                p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
                scale = sa_col * sb_row
                mbarrier.arrive(empty.index(s), count=1)
                acc += p * scale
                g += 1
            if CARRY:
                if carry_end_half(acc, mode, carry_out_ptr, m0, n0, OUT_M, OUT_N, HALF_M, BLOCK):
                    store_half(acc, out_desc, c_smem, expert, m0, n0, HALF_M, BLOCK)
            else:
                store_half(acc, out_desc, c_smem, expert, m0, n0, HALF_M, BLOCK)
    tma.store_wait(pendings=0)


@gluon.jit
def wgrad_fp8_ws_kernel(a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, out_ptr, block0_ptr, counts_ptr, num_experts, OUT_M,
                        OUT_N, K_PAD, stride_as, stride_bs, modes_ptr, carry_in_ptr, carry_out_ptr,
                        NUM_PROGRAMS: gl.constexpr, STAGES: gl.constexpr, CARRY: gl.constexpr = False):
    """out[l] = Σ_kb (a_t[:, kb] · b_t[:, kb]ᵀ) * (a_scale[kb] ⊗ b_scale[kb]) over expert l's token blocks: a_t
    `[OUT_M, K_PAD]`, b_t `[OUT_N, K_PAD]` e4m3, a_scale `[K_PAD/128, OUT_M]`, b_scale `[K_PAD/128, OUT_N]` fp32
    (rows stride_as / stride_bs apart, multiples of 4 for TMA), out `[L, OUT_M, OUT_N]` bf16; 128 x 128 blocks.
    4 warps here (the first consumer), 4 + 1 in the worker partitions: warp_specialize's default partition gets the
    registers the workers leave, 232 with a producer of 40. CARRY: one window of the backward's rows, as
    ``wgrad_fp8_kernel`` (``modes [L]`` int32, the fp32 blocks ``carry_in`` / ``carry_out`` `[OUT_M, OUT_N]`;
    unread without CARRY)."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK], gl.float8e4nv)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], gl.float8e4nv)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK], gl.bfloat16)
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * STAGES, HALF_M, BLOCK], a_layout)
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK, BLOCK], b_layout)
    s_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK], gl.float32)
    as_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK], s_layout)
    bs_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK], s_layout)
    c0 = gl.allocate_shared_memory(gl.bfloat16, [HALF_M, BLOCK], c_layout)
    c1 = gl.allocate_shared_memory(gl.bfloat16, [HALF_M, BLOCK], c_layout)
    full, empty = ring_barriers(STAGES)
    gl.warp_specialize(
        [(_consumer, (out_ptr, block0_ptr, counts_ptr, modes_ptr, carry_in_ptr, carry_out_ptr, num_experts, OUT_M,
                      OUT_N, a_smem, b_smem, as_smem, bs_smem, c0, full, empty, gl.constexpr(0),
                      gl.constexpr(NUM_PROGRAMS), gl.constexpr(STAGES), gl.constexpr(CARRY))),
         (_consumer, (out_ptr, block0_ptr, counts_ptr, modes_ptr, carry_in_ptr, carry_out_ptr, num_experts, OUT_M,
                      OUT_N, a_smem, b_smem, as_smem, bs_smem, c1, full, empty, gl.constexpr(1),
                      gl.constexpr(NUM_PROGRAMS), gl.constexpr(STAGES), gl.constexpr(CARRY))),
         (_producer, (a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, block0_ptr, counts_ptr, modes_ptr, num_experts, OUT_M,
                      OUT_N, K_PAD, stride_as, stride_bs, a_smem, b_smem, as_smem, bs_smem, full, empty,
                      gl.constexpr(NUM_PROGRAMS), gl.constexpr(STAGES), gl.constexpr(CARRY)))],
        [4, 1], [REGS_CONSUMER, REGS_PRODUCER])
    invalidate_ring(full, empty, STAGES)
