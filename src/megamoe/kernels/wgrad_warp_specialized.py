"""The expert wgrad on Hopper, warp-specialised in Gluon: a TMA producer warp and two MMA warpgroups.

``wgrad_kernel``'s contract and blocks (``out[l] = A[rows of l]ᵀ · B[rows of l]``, 128 x BLOCK_N blocks dealt
expert by expert, each expert's blocks round-robin from a rotating first program) and its bits: the rows are
reduced in the same order with the same wgmma shape (m64nNk16). What differs is who waits for what. In the Triton
kernel every warp waits for each K step's TMA data and for the CTA barriers around every TMA issue
(benchmarks/results/2026-12-03-wgrad-variants: 30 % and 25 % of the stall samples; the tensor cores wait on
nothing). Here

- a producer warp makes each expert's descriptors (ending at its last row: the hardware zero-fills the partial
  last K step) and issues the K steps' TMA loads into STAGES slots (``full`` barriers with the bytes expected),
  waiting only for a slot's ``empty`` barrier. A descriptor lives in a global scratch slot that a load reads
  until it lands, so even and odd experts take turns in two slots and a slot is rewritten only after its last
  load has landed (a rewrite under loads in flight sends them to the wrong expert's rows);
- two consumer warpgroups, rows 0-63 and 64-127 of a block (each its own A half, a 64-wide TMA box), each
  waiting for a slot, running its wgmma over the block's columns, waiting for it and releasing the slot; then
  converting its 64 x BLOCK_N half and storing it by TMA through one 3-D descriptor over every expert's block
  (made once, so never rewritten under a store; a partial block is clipped at its expert's edge), the store
  waited for only before that buffer's next use; by default (SPLIT_STORE) in four 64-column quarters through two
  64 x 64 buffers, whose freed shared memory deepens the ring.

With CARRY (one window of the backward's rows, ``megamoe.kernels.wgrad_carry``'s modes) both sides skip an
expert without a mode, the consumers start a block from ``carry_in`` and leave ``carry_out`` (plain global
loads and stores of the accumulator's registers: one block per window) as ``wgrad_kernel`` does.

One block's loads, consumer half and store are ``megamoe.kernels.wgrad_blocks``'s; the dynamic deal's partitions
``megamoe.kernels.wgrad_dynamic``'s, the planned deal's ``megamoe.kernels.wgrad_planned``'s (this kernel launches
any of the three).

GPU only: Gluon has no interpreter mode, so the CPU runs ``wgrad_kernel`` (`megamoe.ops.experts_bwd`), and a GPU test
holds the two to the same bits. Launch with a scratch allocator (the descriptors), 4 warps.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

from megamoe.kernels.gluon_gather import GATHER_WARPS, REGS_GATHER, full_arrivals
from megamoe.kernels.gluon_ring import invalidate_ring, ring_barriers
from megamoe.kernels.tasks import first_task
from megamoe.kernels.wgrad_blocks import (HALF_M, SPLIT_N, first_rows, half_block, load_block, out_descriptor,
                                          site_descriptors)
from megamoe.kernels.wgrad_carry import STORE
from megamoe.kernels.wgrad_dynamic import TAG, consumer_dynamic, producer_dynamic
from megamoe.kernels.wgrad_planned import consumer_planned, producer_planned

REGS_PRODUCER = gl.constexpr(40)  # the TMA producer warp's registers
REGS_PLANNED = gl.constexpr(64)  # the plan's TMA producer: two deal entries held ahead


@gluon.constexpr_function
def gather_registers(a_gather, block_k, planned=False):
    """The worker partitions' registers (the second consumer's, the producer's; the first consumer gets what they
    leave): 232 / 40 with the TMA producer (64 with the plan's, which holds two deal entries ahead: at 40 and 48
    the sm_90 build reserved 24 bytes of stack), 232 / 48 gathering A's 64-wide halves (A_GATHER) in 32-row K
    steps. In the 64-row steps a pass gathers in (``megamoe.ops.expert_wgrad.gathering_wgrad_tile``) the producer
    holds a step's row pointers and the next two steps' indices: at 48 registers the sm_90 build spilled 48 bytes, at
    96 none, beside consumers of 208 (2 x 128 x 208 + 4 x 32 x 96 = 65,536) that spill nothing either. (x gathered
    as B, 256-wide rows, spilled 160 bytes at 48 in 32-row steps and 56 at any split in 64-row ones: x is gathered
    as A now, the block stored transposed, OUT_T.)"""
    if a_gather and block_k > 32:
        return [208, 96]
    if a_gather:
        return [232, REGS_GATHER.value]
    return [232, REGS_PLANNED.value if planned else REGS_PRODUCER.value]


@gluon.jit
def window_task(expert, per_expert, modes_ptr, NUM_PROGRAMS: gl.constexpr, CARRY: gl.constexpr):
    """``(first, mode)``: this program's first block of ``expert`` (blocks are numbered expert-major and dealt
    round-robin: ``first_task``), or ``per_expert`` (no block) for an expert without a mode in this window,
    and its mode (CARRY; else STORE, the launch without windows). The producer and the consumers skip the same
    experts, so they agree on the ring's steps whatever the counts say."""
    first = first_task(gl.program_id(0), NUM_PROGRAMS, expert * per_expert)
    if CARRY:
        mode = gl.load(modes_ptr + expert)
        first = gl.where(mode != 0, first, per_expert)
    else:
        mode = STORE
    return first, mode


@gluon.jit
def _load_expert(a_ptr, b_ptr, a_index_ptr, offsets_ptr, counts_ptr, modes_ptr, expert, OUT_M, OUT_N,
                 a_smem, b_smem, full, empty, g, site_last, NUM_PROGRAMS: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_K: gl.constexpr, STAGES: gl.constexpr, CARRY: gl.constexpr, A_GATHER: gl.constexpr):
    """Issue this program's K steps of ``expert``'s blocks from ``g`` on; its descriptors go where the descriptors
    of this call site's previous expert were (one global scratch slot per call site), whose last load was step
    ``site_last``. Returns the next step and this site's last one."""
    num_n = gl.cdiv(OUT_N, BLOCK_N)
    per_expert = gl.cdiv(OUT_M, 2 * HALF_M) * num_n
    first, _ = window_task(expert, per_expert, modes_ptr, NUM_PROGRAMS, CARRY)
    if first < per_expert:
        row0 = gl.load(offsets_ptr + expert)
        row_end = row0 + gl.load(counts_ptr + expert)
        a_desc, b_desc = site_descriptors(a_ptr, b_ptr, row_end, site_last, g, full, OUT_M, OUT_N, BLOCK_N, BLOCK_K,
                                          STAGES)
        # every block of the expert starts at its first rows: their indices loaded once, not a round trip a block
        rows_now, rows_next = first_rows(a_index_ptr, row0, row_end, BLOCK_K, A_GATHER)
        for task in range(first, per_expert, NUM_PROGRAMS):
            g = load_block(a_ptr, a_desc, b_desc, a_index_ptr, rows_now, rows_next, row0, row_end,
                           task // num_n * (2 * HALF_M), task % num_n * BLOCK_N, OUT_M, a_smem, b_smem, full, empty, g,
                           BLOCK_N, BLOCK_K, STAGES, A_GATHER)
        site_last = g - 1
    return g, site_last


@gluon.jit
def _producer(a_ptr, b_ptr, a_index_ptr, offsets_ptr, counts_ptr, modes_ptr, num_experts, OUT_M, OUT_N,
              a_smem, b_smem, full, empty, NUM_PROGRAMS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              STAGES: gl.constexpr, CARRY: gl.constexpr, A_GATHER: gl.constexpr):
    """Experts in pairs through two call sites of ``_load_expert``: each rewrites its own descriptors every other
    expert, so the loads of one expert's last blocks stay in flight while the next expert's are issued."""
    g = 0  # the program's K steps across its blocks: slot g % STAGES, phase (g // STAGES) & 1
    last_even = -1
    last_odd = -1
    for pair in range(0, num_experts, 2):
        g, last_even = _load_expert(a_ptr, b_ptr, a_index_ptr, offsets_ptr, counts_ptr, modes_ptr, pair,
                                    OUT_M, OUT_N, a_smem, b_smem, full, empty, g, last_even, NUM_PROGRAMS, BLOCK_N,
                                    BLOCK_K, STAGES, CARRY, A_GATHER)
        if pair + 1 < num_experts:
            g, last_odd = _load_expert(a_ptr, b_ptr, a_index_ptr, offsets_ptr, counts_ptr, modes_ptr,
                                       pair + 1, OUT_M, OUT_N, a_smem, b_smem, full, empty, g, last_odd, NUM_PROGRAMS,
                                       BLOCK_N, BLOCK_K, STAGES, CARRY, A_GATHER)


@gluon.jit
def _consumer(out_ptr, offsets_ptr, counts_ptr, modes_ptr, carry_in_ptr, carry_out_ptr, num_experts, dealt, OUT_M,
              OUT_N, a_smem, b_smem, c_smem, full, empty, HALF: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, MMA_IN_FLIGHT: gl.constexpr,
              CARRY: gl.constexpr, GATHER: gl.constexpr, OUT_T: gl.constexpr, SPLIT_STORE: gl.constexpr):
    """Rows HALF * 64 .. HALF * 64 + 63 of every block of this program (one warpgroup), of experts 0 .. dealt - 1
    (none, or all ``num_experts``)."""
    num_n = gl.cdiv(OUT_N, BLOCK_N)
    per_expert = gl.cdiv(OUT_M, 2 * HALF_M) * num_n
    BOX_N: gl.constexpr = SPLIT_N if SPLIT_STORE else BLOCK_N
    out_desc = out_descriptor(out_ptr, num_experts, OUT_M, OUT_N, BOX_N, OUT_T)
    g = 0
    for expert in range(0, dealt):
        first, mode = window_task(expert, per_expert, modes_ptr, NUM_PROGRAMS, CARRY)
        if first < per_expert:
            row0 = gl.load(offsets_ptr + expert)
            row_end = row0 + gl.load(counts_ptr + expert)
            for task in range(first, per_expert, NUM_PROGRAMS):
                g = half_block(out_desc, a_smem, b_smem, c_smem, full, empty, g, expert, mode, row0, row_end,
                                task // num_n * (2 * HALF_M), task % num_n * BLOCK_N, carry_in_ptr, carry_out_ptr,
                                OUT_M, OUT_N, HALF, BLOCK_N, BLOCK_K, STAGES, MMA_IN_FLIGHT, CARRY, GATHER, OUT_T,
                                SPLIT_STORE)
    tma.store_wait(pendings=0)


@gluon.jit
def wgrad_ws_kernel(a_ptr, b_ptr, out_ptr, offsets_ptr, counts_ptr, num_experts, OUT_M, OUT_N, modes_ptr,
                    carry_in_ptr, carry_out_ptr, a_index_ptr, NUM_PROGRAMS: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                    MMA_IN_FLIGHT: gl.constexpr = False, CARRY: gl.constexpr = False, A_GATHER: gl.constexpr = False,
                    OUT_T: gl.constexpr = False, deal_ptr=None, DYNAMIC: gl.constexpr = False,
                    SPLIT_STORE: gl.constexpr = False, PLANNED: gl.constexpr = False, skip_ptr=None):
    """out[l] = A[rows of l]ᵀ · B[rows of l] (`wgrad_kernel`'s contract: A `[R, OUT_M]`, B `[R, OUT_N]`, out
    `[L, OUT_M, OUT_N]`, contiguous bf16), blocks of 128 x BLOCK_N; 4 warps here (the first consumer), 4 + 1 in
    the worker partitions. CARRY: one window of the backward's rows, as ``wgrad_kernel`` (``modes [L]`` int32, the
    fp32 blocks ``carry_in`` / ``carry_out`` `[OUT_M, OUT_N]`; unread without CARRY). A_GATHER: A's row r is row
    ``a_index[r]`` (int32 `[R]`) of ``a`` `[S, OUT_M]` (one rank's d_out or x: each routed row's token, read in place
    of a copy; the index is unread without the flag), brought in by cp.async in the producer warpgroup
    (``megamoe.kernels.gluon_gather``). OUT_T: out is `[L, OUT_N, OUT_M]` (and the carries `[OUT_N, OUT_M]`), each
    block stored transposed: the gate/up wgrad with x gathered as A, ``out[l] = (x_rowsᵀ · d_h)ᵀ``, which reads each
    x row once per BLOCK_N (256) of 2I; gathered as B it was read once per 128.
    DYNAMIC: the blocks taken from a counter as programs come free (``deal`` int32 `[2 + 4 L]`, zero, the blocks to
    deal, the experts heaviest first with their rows: ``wgrad_dynamic.dealt_block``), the producer naming each block
    to the consumers in a tag step of the ring; a block is still reduced by one program in one order, so the bits
    are the static deal's.
    PLANNED: the same deal's order in a fixed plan, a round's blocks side by side, a snake over the programs
    (``wgrad_planned.planned_block``): no counter, the consumers find their blocks themselves.
    ``skip_ptr`` (the static deal; int32 `[1]`, the plan's count of blocks: ``deal[1:]``): nothing to do where it is
    not 0, the plan's launch beside this one deals them (``megamoe.ops.expert_wgrad.WGRAD_PLAN_SKEW``).
    SPLIT_STORE (256-wide blocks, not with DYNAMIC): each consumer stores its half in four 64-column quarters
    through two 64 x 64 buffers (``wgrad_blocks.store_half_split``), leaving the ring 32 KB more
    (``wgrad_ws_stages``)."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, HALF_M], gl.bfloat16)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], gl.bfloat16)
    C_ROWS: gl.constexpr = BLOCK_N if OUT_T else HALF_M
    C_COLS: gl.constexpr = HALF_M if OUT_T else BLOCK_N
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C_ROWS, C_COLS], gl.bfloat16)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, BLOCK_K, HALF_M], a_layout)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, BLOCK_N], b_layout)
    gl.static_assert(not (SPLIT_STORE and DYNAMIC), "the dynamic deal stores whole halves")
    gl.static_assert(not (PLANNED and DYNAMIC), "one deal: planned or from the counter")
    if SPLIT_STORE:  # two 64 x 64 buffers a consumer (wgrad_blocks.store_half_split)
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, SPLIT_N], gl.bfloat16)
        c0 = gl.allocate_shared_memory(gl.bfloat16, [2, HALF_M, SPLIT_N], q_layout)
        c1 = gl.allocate_shared_memory(gl.bfloat16, [2, HALF_M, SPLIT_N], q_layout)
    else:
        c0 = gl.allocate_shared_memory(gl.bfloat16, [C_ROWS, C_COLS], c_layout)
        c1 = gl.allocate_shared_memory(gl.bfloat16, [C_ROWS, C_COLS], c_layout)
    full, empty = ring_barriers(STAGES, full_arrivals(A_GATHER))
    if DYNAMIC:
        tags = gl.allocate_shared_memory(gl.int32, [STAGES, TAG], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        gl.warp_specialize(
            [(consumer_dynamic, (out_ptr, modes_ptr, carry_in_ptr, carry_out_ptr, num_experts, OUT_M, OUT_N, a_smem,
                                  b_smem, c0, tags, full, empty, gl.constexpr(0), gl.constexpr(BLOCK_N),
                                  gl.constexpr(BLOCK_K), gl.constexpr(STAGES), gl.constexpr(MMA_IN_FLIGHT),
                                  gl.constexpr(CARRY), gl.constexpr(A_GATHER), gl.constexpr(OUT_T))),
             (consumer_dynamic, (out_ptr, modes_ptr, carry_in_ptr, carry_out_ptr, num_experts, OUT_M, OUT_N, a_smem,
                                  b_smem, c1, tags, full, empty, gl.constexpr(1), gl.constexpr(BLOCK_N),
                                  gl.constexpr(BLOCK_K), gl.constexpr(STAGES), gl.constexpr(MMA_IN_FLIGHT),
                                  gl.constexpr(CARRY), gl.constexpr(A_GATHER), gl.constexpr(OUT_T))),
             (producer_dynamic, (a_ptr, b_ptr, a_index_ptr, deal_ptr, OUT_M, OUT_N,
                                  a_smem, b_smem, tags, full, empty, gl.constexpr(BLOCK_N), gl.constexpr(BLOCK_K),
                                  gl.constexpr(STAGES), gl.constexpr(A_GATHER)))],
            [4, GATHER_WARPS if A_GATHER else 1], gather_registers(A_GATHER, BLOCK_K))
    elif PLANNED:
        if gl.load(deal_ptr + 1) != 0:  # blocks dealt (else the static deal's launch beside this one takes them)
            gl.warp_specialize(
                [(consumer_planned, (out_ptr, deal_ptr, modes_ptr, carry_in_ptr, carry_out_ptr, num_experts, OUT_M,
                                     OUT_N, a_smem, b_smem, c0, full, empty, gl.constexpr(0),
                                     gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_N), gl.constexpr(BLOCK_K),
                                     gl.constexpr(STAGES), gl.constexpr(MMA_IN_FLIGHT), gl.constexpr(CARRY),
                                     gl.constexpr(A_GATHER), gl.constexpr(OUT_T), gl.constexpr(SPLIT_STORE))),
                 (consumer_planned, (out_ptr, deal_ptr, modes_ptr, carry_in_ptr, carry_out_ptr, num_experts, OUT_M,
                                     OUT_N, a_smem, b_smem, c1, full, empty, gl.constexpr(1),
                                     gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_N), gl.constexpr(BLOCK_K),
                                     gl.constexpr(STAGES), gl.constexpr(MMA_IN_FLIGHT), gl.constexpr(CARRY),
                                     gl.constexpr(A_GATHER), gl.constexpr(OUT_T), gl.constexpr(SPLIT_STORE))),
                 (producer_planned, (a_ptr, b_ptr, a_index_ptr, deal_ptr, OUT_M, OUT_N, a_smem, b_smem, full, empty,
                                     gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_N), gl.constexpr(BLOCK_K),
                                     gl.constexpr(STAGES), gl.constexpr(A_GATHER)))],
                [4, GATHER_WARPS if A_GATHER else 1], gather_registers(A_GATHER, BLOCK_K, planned=True))
    else:
        dealt = num_experts
        if skip_ptr is not None:  # the plan's launch took the blocks
            dealt = gl.where(gl.load(skip_ptr) != 0, 0, num_experts)
        # constexprs reach the partitions only wrapped; the tuples are written out (no unpacking in Gluon)
        gl.warp_specialize(
            [(_consumer, (out_ptr, offsets_ptr, counts_ptr, modes_ptr, carry_in_ptr, carry_out_ptr, num_experts, dealt,
                          OUT_M, OUT_N, a_smem, b_smem, c0, full, empty, gl.constexpr(0),
                          gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_N), gl.constexpr(BLOCK_K),
                          gl.constexpr(STAGES), gl.constexpr(MMA_IN_FLIGHT), gl.constexpr(CARRY), gl.constexpr(A_GATHER),
                          gl.constexpr(OUT_T), gl.constexpr(SPLIT_STORE))),
             (_consumer, (out_ptr, offsets_ptr, counts_ptr, modes_ptr, carry_in_ptr, carry_out_ptr, num_experts, dealt,
                          OUT_M, OUT_N, a_smem, b_smem, c1, full, empty, gl.constexpr(1),
                          gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_N), gl.constexpr(BLOCK_K),
                          gl.constexpr(STAGES), gl.constexpr(MMA_IN_FLIGHT), gl.constexpr(CARRY), gl.constexpr(A_GATHER),
                          gl.constexpr(OUT_T), gl.constexpr(SPLIT_STORE))),
             (_producer, (a_ptr, b_ptr, a_index_ptr, offsets_ptr, counts_ptr, modes_ptr, dealt, OUT_M,
                          OUT_N, a_smem, b_smem, full, empty, gl.constexpr(NUM_PROGRAMS),
                          gl.constexpr(BLOCK_N), gl.constexpr(BLOCK_K), gl.constexpr(STAGES), gl.constexpr(CARRY),
                          gl.constexpr(A_GATHER)))],
            [4, GATHER_WARPS if A_GATHER else 1], gather_registers(A_GATHER, BLOCK_K))
    invalidate_ring(full, empty, STAGES)

