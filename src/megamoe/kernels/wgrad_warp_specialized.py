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
  waited for only before that buffer's next use.

With CARRY (one window of the backward's rows, ``megamoe.kernels.wgrad_carry``'s modes) both sides skip an
expert without a mode, the consumers start a block from ``carry_in`` and leave ``carry_out`` (plain global
loads and stores of the accumulator's registers: one block per window) as ``wgrad_kernel`` does.

GPU only: Gluon has no interpreter mode, so the CPU runs ``wgrad_kernel`` (`megamoe.ops.experts_bwd`), and a GPU test
holds the two to the same bits. Launch with a scratch allocator (the descriptors), 4 warps.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

from megamoe.kernels.gluon_gather import (GATHER_WARPS, REGS_GATHER, copy_rows_async, full_arrivals, land_on,
                                         row_indices, row_starts_of)
from megamoe.kernels.gluon_ring import drain_steps, invalidate_ring, release_step, ring_barriers
from megamoe.kernels.tasks import first_task
from megamoe.kernels.wgrad_carry import CARRY_IN, CARRY_OUT, STORE

HALF_M = gl.constexpr(64)  # rows of one consumer warpgroup
REGS_PRODUCER = gl.constexpr(40)  # the TMA producer warp's registers


@gluon.constexpr_function
def gather_registers(a_gather, block_k):
    """The worker partitions' registers (the second consumer's, the producer's; the first consumer gets what they
    leave): 232 / 40 with the TMA producer, 232 / 48 gathering A's 64-wide halves (A_GATHER) in 32-row K steps. In
    the 64-row steps a pass gathers in (``megamoe.ops.experts_bwd.gathering_wgrad_tile``) the producer holds a
    step's row pointers and the next two steps' indices: at 48 registers the sm_90 build spilled 48 bytes, at 96
    none, beside consumers of 208 (2 x 128 x 208 + 4 x 32 x 96 = 65,536) that spill nothing either. (x gathered
    as B, 256-wide rows, spilled 160 bytes at 48 in 32-row steps and 56 at any split in 64-row ones: x is gathered
    as A now, the block stored transposed, OUT_T.)"""
    if a_gather and block_k > 32:
        return [208, 96]
    return [232, REGS_GATHER.value if a_gather else REGS_PRODUCER.value]


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
def carry_offsets(rows, cols, OUT_M, OUT_N, OUT_T: gl.constexpr = False):
    """Element offsets of the block's (rows, cols) in a carry laid out as the gradient: `[OUT_M, OUT_N]`, or with
    OUT_T `[OUT_N, OUT_M]`."""
    if OUT_T:
        return cols.to(gl.int64)[None, :] * OUT_M + rows[:, None]
    return rows.to(gl.int64)[:, None] * OUT_N + cols[None, :]


@gluon.jit
def carry_start_half(mode, carry_in_ptr, r0, n0, OUT_M, OUT_N, layout: gl.constexpr, ROWS: gl.constexpr,
                     BLOCK_N: gl.constexpr, OUT_T: gl.constexpr = False):
    """A consumer's starting accumulator (``ROWS x BLOCK_N`` from row ``r0``, in the wgmma's ``layout``): carry_in's
    with CARRY_IN (``wgrad_carry.carry_start``'s elements), else zeros."""
    if (mode & CARRY_IN) != 0:
        rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        mask = (rows < OUT_M)[:, None] & (cols < OUT_N)[None, :]
        acc = gl.load(carry_in_ptr + carry_offsets(rows, cols, OUT_M, OUT_N, OUT_T), mask=mask, other=0.0)
    else:
        acc = gl.zeros((ROWS, BLOCK_N), gl.float32, layout)
    return acc


@gluon.jit
def carry_end_half(acc, mode, carry_out_ptr, r0, n0, OUT_M, OUT_N, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                   OUT_T: gl.constexpr = False):
    """With CARRY_OUT the accumulator into carry_out (``wgrad_carry.carry_end``'s elements); returns whether the
    BF16 gradient is to be written (STORE)."""
    if (mode & CARRY_OUT) != 0:
        rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc.type.layout))
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc.type.layout))
        mask = (rows < OUT_M)[:, None] & (cols < OUT_N)[None, :]
        gl.store(carry_out_ptr + carry_offsets(rows, cols, OUT_M, OUT_N, OUT_T), acc, mask=mask)
    return (mode & STORE) != 0


@gluon.jit
def _load_block(a_ptr, a_desc, b_desc, a_index_ptr, row0, row_end, m0, n0, OUT_M, a_smem, b_smem, full, empty, g,
                BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, A_GATHER: gl.constexpr):
    """Issue the block at (m0, n0)'s K steps (rows row0 .. row_end of its expert) into the ring from step g on;
    returns the next step. A_GATHER: A's rows gathered by cp.async, each step's indices loaded two steps ahead (a
    32-row K step's wgmmas take about as long as a dependent global load; loaded one step ahead, the gathering
    wgrads ran 2x the copied rows' time, 2026-12-06)."""
    A_TMA_BYTES: gl.constexpr = 0 if A_GATHER else 2 * BLOCK_K * HALF_M * 2
    step_bytes: gl.constexpr = A_TMA_BYTES + BLOCK_K * BLOCK_N * 2
    if A_GATHER:
        rows_now = row_indices(a_index_ptr, row0, row_end, BLOCK_K, HALF_M)
        rows_next = row_indices(a_index_ptr, row0 + BLOCK_K, row_end, BLOCK_K, HALF_M)
    for k in range(row0, row_end, BLOCK_K):
        s = g % STAGES
        mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)  # the first round finds every slot free
        mbarrier.expect(full.index(s), step_bytes)
        if not A_GATHER:
            tma.async_copy_global_to_shared(a_desc, [k, m0], full.index(s), a_smem.index(2 * s))
            tma.async_copy_global_to_shared(a_desc, [k, m0 + HALF_M], full.index(s), a_smem.index(2 * s + 1))
        tma.async_copy_global_to_shared(b_desc, [k, n0], full.index(s), b_smem.index(s))
        # A's gather under B's TMA; each thread's landing one of the barrier's arrivals
        if A_GATHER:
            starts, ok = row_starts_of(a_ptr, rows_now, k, row_end, OUT_M, BLOCK_K, HALF_M)
            copy_rows_async(starts, ok, m0, OUT_M, a_smem.index(2 * s), HALF_M)
            copy_rows_async(starts, ok, m0 + HALF_M, OUT_M, a_smem.index(2 * s + 1), HALF_M)
            land_on(full.index(s))
            rows_now = rows_next
            rows_next = row_indices(a_index_ptr, k + 2 * BLOCK_K, row_end, BLOCK_K, HALF_M)
        g += 1
    return g


@gluon.jit
def _load_expert(a_ptr, b_ptr, a_index_ptr, offsets_ptr, counts_ptr, modes_ptr, expert, OUT_M, OUT_N,
                 a_smem, b_smem, full, empty, g, site_last, NUM_PROGRAMS: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_K: gl.constexpr, STAGES: gl.constexpr, CARRY: gl.constexpr, A_GATHER: gl.constexpr):
    """Issue this program's K steps of ``expert``'s blocks from ``g`` on; its descriptors go where the descriptors
    of this call site's previous expert were (one global scratch slot per call site), whose last load was step
    ``site_last``. Returns the next step and this site's last one."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, HALF_M], gl.bfloat16)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], gl.bfloat16)
    num_n = gl.cdiv(OUT_N, BLOCK_N)
    per_expert = gl.cdiv(OUT_M, 2 * HALF_M) * num_n
    first, _ = window_task(expert, per_expert, modes_ptr, NUM_PROGRAMS, CARRY)
    if first < per_expert:
        # the TMA unit reads a descriptor until its load lands: wait for the site's last load before rewriting it,
        # unless a later load into the same slot was issued (that one waited for the slot's release, so it landed)
        if (site_last >= 0) & (g - site_last <= STAGES):
            mbarrier.wait(full.index(site_last % STAGES), (site_last // STAGES) & 1)
        row0 = gl.load(offsets_ptr + expert)
        row_end = row0 + gl.load(counts_ptr + expert)
        rows = gl.maximum(row_end, 1)
        a_desc = tma.make_tensor_descriptor(a_ptr, [rows, OUT_M], [OUT_M, 1], [BLOCK_K, HALF_M], a_layout)
        b_desc = tma.make_tensor_descriptor(b_ptr, [rows, OUT_N], [OUT_N, 1], [BLOCK_K, BLOCK_N], b_layout)
        for task in range(first, per_expert, NUM_PROGRAMS):
            g = _load_block(a_ptr, a_desc, b_desc, a_index_ptr, row0, row_end, task // num_n * (2 * HALF_M),
                            task % num_n * BLOCK_N, OUT_M, a_smem, b_smem, full, empty, g, BLOCK_N, BLOCK_K, STAGES,
                            A_GATHER)
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
def store_half(acc, out_desc, c_smem, expert, r0, n0, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
               OUT_T: gl.constexpr = False):
    """The half's BF16 gradient by TMA from ``c_smem``, waited for only before the buffer's next use (OUT_T: the
    block transposed, at (n0, r0) of an `[L, OUT_N, OUT_M]` gradient)."""
    tma.store_wait(pendings=0)  # this half's previous block has left c_smem
    if OUT_T:
        c_smem.store(gl.permute(acc.to(gl.bfloat16), (1, 0)))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [expert, n0, r0], c_smem.reshape([1, BLOCK_N, ROWS]))
    else:
        c_smem.store(acc.to(gl.bfloat16))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [expert, r0, n0], c_smem.reshape([1, ROWS, BLOCK_N]))


@gluon.jit
def out_descriptor(out_ptr, num_experts, OUT_M, OUT_N, BLOCK_N: gl.constexpr, OUT_T: gl.constexpr):
    """One descriptor over every expert's block (3-D: a partial block is clipped at its expert's edge), made once: a
    store in flight reads it until it lands, so it is never rewritten. OUT_T: the blocks stored transposed."""
    if OUT_T:
        layout_t: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_N, HALF_M], gl.bfloat16)
        return tma.make_tensor_descriptor(out_ptr, [num_experts, OUT_N, OUT_M], [OUT_M * OUT_N, OUT_M, 1],
                                          [1, BLOCK_N, HALF_M], layout_t)
    else:
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, HALF_M, BLOCK_N], gl.bfloat16)
        return tma.make_tensor_descriptor(out_ptr, [num_experts, OUT_M, OUT_N], [OUT_M * OUT_N, OUT_N, 1],
                                          [1, HALF_M, BLOCK_N], layout)


@gluon.jit
def _half_block(out_desc, a_smem, b_smem, c_smem, full, empty, g, expert, mode, row0, row_end, m0, n0, carry_in_ptr,
                carry_out_ptr, OUT_M, OUT_N, HALF: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                STAGES: gl.constexpr, MMA_IN_FLIGHT: gl.constexpr, CARRY: gl.constexpr, GATHER: gl.constexpr,
                OUT_T: gl.constexpr):
    """One consumer's half of the block at (m0, n0) of ``expert``: its K steps from ring step g (returns the next),
    the rows reduced in order from zeros or the window's carry, then stored (or carried out, by ``mode``)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    r0 = m0 + HALF * HALF_M
    if CARRY:
        acc = carry_start_half(mode, carry_in_ptr, r0, n0, OUT_M, OUT_N, mma, HALF_M, BLOCK_N, OUT_T)
    else:
        acc = gl.zeros((HALF_M, BLOCK_N), gl.float32, mma)
    for k in range(row0, row_end, BLOCK_K):
        s = g % STAGES
        mbarrier.wait(full.index(s), (g // STAGES) & 1)
        if GATHER:  # cp.async wrote through the generic proxy; the wgmma reads through the async one
            fence_async_shared()
        acc = warpgroup_mma(a_smem.index(2 * s + HALF).permute((1, 0)), b_smem.index(s), acc, is_async=True)
        acc = release_step(acc, empty, s, k == row0, STAGES, MMA_IN_FLIGHT)
        g += 1
    acc = drain_steps(acc, empty, g, row_end > row0, STAGES, MMA_IN_FLIGHT)
    if CARRY:
        if carry_end_half(acc, mode, carry_out_ptr, r0, n0, OUT_M, OUT_N, HALF_M, BLOCK_N, OUT_T):
            store_half(acc, out_desc, c_smem, expert, r0, n0, HALF_M, BLOCK_N, OUT_T)
    else:
        store_half(acc, out_desc, c_smem, expert, r0, n0, HALF_M, BLOCK_N, OUT_T)
    return g


@gluon.jit
def _consumer(out_ptr, offsets_ptr, counts_ptr, modes_ptr, carry_in_ptr, carry_out_ptr, num_experts, OUT_M, OUT_N,
              a_smem, b_smem, c_smem, full, empty, HALF: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, MMA_IN_FLIGHT: gl.constexpr,
              CARRY: gl.constexpr, GATHER: gl.constexpr, OUT_T: gl.constexpr):
    """Rows HALF * 64 .. HALF * 64 + 63 of every block of this program (one warpgroup)."""
    num_n = gl.cdiv(OUT_N, BLOCK_N)
    per_expert = gl.cdiv(OUT_M, 2 * HALF_M) * num_n
    out_desc = out_descriptor(out_ptr, num_experts, OUT_M, OUT_N, BLOCK_N, OUT_T)
    g = 0
    for expert in range(0, num_experts):
        first, mode = window_task(expert, per_expert, modes_ptr, NUM_PROGRAMS, CARRY)
        if first < per_expert:
            row0 = gl.load(offsets_ptr + expert)
            row_end = row0 + gl.load(counts_ptr + expert)
            for task in range(first, per_expert, NUM_PROGRAMS):
                g = _half_block(out_desc, a_smem, b_smem, c_smem, full, empty, g, expert, mode, row0, row_end,
                                task // num_n * (2 * HALF_M), task % num_n * BLOCK_N, carry_in_ptr, carry_out_ptr,
                                OUT_M, OUT_N, HALF, BLOCK_N, BLOCK_K, STAGES, MMA_IN_FLIGHT, CARRY, GATHER, OUT_T)
    tma.store_wait(pendings=0)


@gluon.jit
def dealt_block(deal_ptr, t, per_expert):
    """DYNAMIC: the t-th block taken from the launch's counter, ``(expert, task)``. ``deal`` int32 `[2 + L]`: the
    counter, the blocks to deal and the experts heaviest first; even takes walk the blocks from the heaviest expert,
    odd ones from the lightest (write-bound light blocks beside compute-bound heavy ones, the heaviest started
    first)."""
    half = t // 2
    pos = half + (t % 2) * (gl.load(deal_ptr + 1) - 1 - 2 * half)
    return gl.load(deal_ptr + 2 + pos // per_expert), pos % per_expert


@gluon.jit
def _tag_step(tags, full, empty, g, block, STAGES: gl.constexpr, FULL_ARRIVALS: gl.constexpr, WARPS: gl.constexpr):
    """A ring step that carries no data, only the next block's number for the consumers (-1: no more blocks)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    s = g % STAGES
    mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
    tags.index(s).store(gl.full([1], block, gl.int32, layout))
    mbarrier.arrive(full.index(s), count=FULL_ARRIVALS)
    return g + 1


@gluon.jit
def _producer_dynamic(a_ptr, b_ptr, a_index_ptr, offsets_ptr, counts_ptr, deal_ptr, OUT_M, OUT_N,
                      a_smem, b_smem, tags, full, empty, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                      STAGES: gl.constexpr, A_GATHER: gl.constexpr):
    """DYNAMIC: takes blocks from the launch's counter until none is left; each block's K steps follow a tag step
    that names it. Descriptors are remade when the expert changes, in two call sites used in turn (a rewrite waits
    for the last load through that site to land, as ``_load_expert``'s)."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, HALF_M], gl.bfloat16)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], gl.bfloat16)
    WARPS: gl.constexpr = GATHER_WARPS.value if A_GATHER else 1
    FULL: gl.constexpr = full_arrivals(A_GATHER)
    num_n = gl.cdiv(OUT_N, BLOCK_N)
    per_expert = gl.cdiv(OUT_M, 2 * HALF_M) * num_n
    total = gl.load(deal_ptr + 1)
    g = 0
    last_expert = -1
    site = 1
    site_last0 = -1
    site_last1 = -1
    row0 = 0
    row_end = 0
    # both sites' descriptors exist from the start (over one row) so that the loop carries them
    a_desc0 = tma.make_tensor_descriptor(a_ptr, [1, OUT_M], [OUT_M, 1], [BLOCK_K, HALF_M], a_layout)
    b_desc0 = tma.make_tensor_descriptor(b_ptr, [1, OUT_N], [OUT_N, 1], [BLOCK_K, BLOCK_N], b_layout)
    a_desc1 = tma.make_tensor_descriptor(a_ptr, [1, OUT_M], [OUT_M, 1], [BLOCK_K, HALF_M], a_layout)
    b_desc1 = tma.make_tensor_descriptor(b_ptr, [1, OUT_N], [OUT_N, 1], [BLOCK_K, BLOCK_N], b_layout)
    t = gl.atomic_add(deal_ptr, 1)
    while t < total:
        expert, task = dealt_block(deal_ptr, t, per_expert)
        g = _tag_step(tags, full, empty, g, t, STAGES, FULL, WARPS)
        if expert != last_expert:
            last_expert = expert
            site = 1 - site
            row0 = gl.load(offsets_ptr + expert)
            row_end = row0 + gl.load(counts_ptr + expert)
            rows = gl.maximum(row_end, 1)
            if site == 0:
                if (site_last0 >= 0) & (g - site_last0 <= STAGES):
                    mbarrier.wait(full.index(site_last0 % STAGES), (site_last0 // STAGES) & 1)
                a_desc0 = tma.make_tensor_descriptor(a_ptr, [rows, OUT_M], [OUT_M, 1], [BLOCK_K, HALF_M], a_layout)
                b_desc0 = tma.make_tensor_descriptor(b_ptr, [rows, OUT_N], [OUT_N, 1], [BLOCK_K, BLOCK_N],
                                                     b_layout)
            else:
                if (site_last1 >= 0) & (g - site_last1 <= STAGES):
                    mbarrier.wait(full.index(site_last1 % STAGES), (site_last1 // STAGES) & 1)
                a_desc1 = tma.make_tensor_descriptor(a_ptr, [rows, OUT_M], [OUT_M, 1], [BLOCK_K, HALF_M], a_layout)
                b_desc1 = tma.make_tensor_descriptor(b_ptr, [rows, OUT_N], [OUT_N, 1], [BLOCK_K, BLOCK_N],
                                                     b_layout)
        m0 = task // num_n * (2 * HALF_M)
        n0 = task % num_n * BLOCK_N
        if site == 0:
            g = _load_block(a_ptr, a_desc0, b_desc0, a_index_ptr, row0, row_end, m0, n0, OUT_M, a_smem, b_smem, full,
                            empty, g, BLOCK_N, BLOCK_K, STAGES, A_GATHER)
            if row_end > row0:
                site_last0 = g - 1
        else:
            g = _load_block(a_ptr, a_desc1, b_desc1, a_index_ptr, row0, row_end, m0, n0, OUT_M, a_smem, b_smem, full,
                            empty, g, BLOCK_N, BLOCK_K, STAGES, A_GATHER)
            if row_end > row0:
                site_last1 = g - 1
        t = gl.atomic_add(deal_ptr, 1)
    _tag_step(tags, full, empty, g, -1, STAGES, FULL, WARPS)


@gluon.jit
def _consumer_dynamic(out_ptr, offsets_ptr, counts_ptr, modes_ptr, carry_in_ptr, carry_out_ptr, deal_ptr, num_experts,
                      OUT_M, OUT_N, a_smem, b_smem, c_smem, tags, full, empty, HALF: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                      MMA_IN_FLIGHT: gl.constexpr, CARRY: gl.constexpr, GATHER: gl.constexpr, OUT_T: gl.constexpr):
    """DYNAMIC: rows HALF * 64 .. HALF * 64 + 63 of each block the producer's tag steps name, in their order."""
    tag_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    num_n = gl.cdiv(OUT_N, BLOCK_N)
    per_expert = gl.cdiv(OUT_M, 2 * HALF_M) * num_n
    out_desc = out_descriptor(out_ptr, num_experts, OUT_M, OUT_N, BLOCK_N, OUT_T)
    mbarrier.wait(full.index(0), 0)
    t = gl.max(tags.index(0).load(tag_layout), 0)
    mbarrier.arrive(empty.index(0), count=1)
    g = 1
    while t >= 0:
        expert, task = dealt_block(deal_ptr, t, per_expert)
        if CARRY:
            mode = gl.load(modes_ptr + expert)
        else:
            mode = STORE
        row0 = gl.load(offsets_ptr + expert)
        row_end = row0 + gl.load(counts_ptr + expert)
        g = _half_block(out_desc, a_smem, b_smem, c_smem, full, empty, g, expert, mode, row0, row_end,
                        task // num_n * (2 * HALF_M), task % num_n * BLOCK_N, carry_in_ptr, carry_out_ptr, OUT_M,
                        OUT_N, HALF, BLOCK_N, BLOCK_K, STAGES, MMA_IN_FLIGHT, CARRY, GATHER, OUT_T)
        s = g % STAGES
        mbarrier.wait(full.index(s), (g // STAGES) & 1)
        t = gl.max(tags.index(s).load(tag_layout), 0)
        mbarrier.arrive(empty.index(s), count=1)
        g += 1
    tma.store_wait(pendings=0)


@gluon.jit
def wgrad_ws_kernel(a_ptr, b_ptr, out_ptr, offsets_ptr, counts_ptr, num_experts, OUT_M, OUT_N, modes_ptr,
                    carry_in_ptr, carry_out_ptr, a_index_ptr, NUM_PROGRAMS: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                    MMA_IN_FLIGHT: gl.constexpr = False, CARRY: gl.constexpr = False, A_GATHER: gl.constexpr = False,
                    OUT_T: gl.constexpr = False, deal_ptr=None, DYNAMIC: gl.constexpr = False):
    """out[l] = A[rows of l]ᵀ · B[rows of l] (`wgrad_kernel`'s contract: A `[R, OUT_M]`, B `[R, OUT_N]`, out
    `[L, OUT_M, OUT_N]`, contiguous bf16), blocks of 128 x BLOCK_N; 4 warps here (the first consumer), 4 + 1 in
    the worker partitions. CARRY: one window of the backward's rows, as ``wgrad_kernel`` (``modes [L]`` int32, the
    fp32 blocks ``carry_in`` / ``carry_out`` `[OUT_M, OUT_N]`; unread without CARRY). A_GATHER: A's row r is row
    ``a_index[r]`` (int32 `[R]`) of ``a`` `[S, OUT_M]` (one rank's d_out or x: each routed row's token, read in place
    of a copy; the index is unread without the flag), brought in by cp.async in the producer warpgroup
    (``megamoe.kernels.gluon_gather``). OUT_T: out is `[L, OUT_N, OUT_M]` (and the carries `[OUT_N, OUT_M]`), each
    block stored transposed: the gate/up wgrad with x gathered as A, ``out[l] = (x_rowsᵀ · d_h)ᵀ``, which reads each
    x row once per BLOCK_N (256) of 2I; gathered as B it was read once per 128.
    DYNAMIC: the blocks taken from a counter as programs come free (``deal`` int32 `[2 + L]`, zero, the blocks to deal,
    the experts heaviest first: :func:`dealt_block`), the producer naming each block to the consumers in a tag step
    of the ring; a block is still reduced by one program in one order, so the bits are the static deal's."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, HALF_M], gl.bfloat16)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], gl.bfloat16)
    C_ROWS: gl.constexpr = BLOCK_N if OUT_T else HALF_M
    C_COLS: gl.constexpr = HALF_M if OUT_T else BLOCK_N
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C_ROWS, C_COLS], gl.bfloat16)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, BLOCK_K, HALF_M], a_layout)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, BLOCK_N], b_layout)
    c0 = gl.allocate_shared_memory(gl.bfloat16, [C_ROWS, C_COLS], c_layout)
    c1 = gl.allocate_shared_memory(gl.bfloat16, [C_ROWS, C_COLS], c_layout)
    full, empty = ring_barriers(STAGES, full_arrivals(A_GATHER))
    if DYNAMIC:
        tags = gl.allocate_shared_memory(gl.int32, [STAGES, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        gl.warp_specialize(
            [(_consumer_dynamic, (out_ptr, offsets_ptr, counts_ptr, modes_ptr, carry_in_ptr, carry_out_ptr, deal_ptr,
                                  num_experts, OUT_M, OUT_N, a_smem, b_smem, c0, tags, full, empty, gl.constexpr(0),
                                  gl.constexpr(BLOCK_N), gl.constexpr(BLOCK_K), gl.constexpr(STAGES),
                                  gl.constexpr(MMA_IN_FLIGHT), gl.constexpr(CARRY), gl.constexpr(A_GATHER),
                                  gl.constexpr(OUT_T))),
             (_consumer_dynamic, (out_ptr, offsets_ptr, counts_ptr, modes_ptr, carry_in_ptr, carry_out_ptr, deal_ptr,
                                  num_experts, OUT_M, OUT_N, a_smem, b_smem, c1, tags, full, empty, gl.constexpr(1),
                                  gl.constexpr(BLOCK_N), gl.constexpr(BLOCK_K), gl.constexpr(STAGES),
                                  gl.constexpr(MMA_IN_FLIGHT), gl.constexpr(CARRY), gl.constexpr(A_GATHER),
                                  gl.constexpr(OUT_T))),
             (_producer_dynamic, (a_ptr, b_ptr, a_index_ptr, offsets_ptr, counts_ptr, deal_ptr, OUT_M, OUT_N,
                                  a_smem, b_smem, tags, full, empty, gl.constexpr(BLOCK_N), gl.constexpr(BLOCK_K),
                                  gl.constexpr(STAGES), gl.constexpr(A_GATHER)))],
            [4, GATHER_WARPS if A_GATHER else 1], gather_registers(A_GATHER, BLOCK_K))
    else:
        # constexprs reach the partitions only wrapped; the tuples are written out (no unpacking in Gluon)
        gl.warp_specialize(
            [(_consumer, (out_ptr, offsets_ptr, counts_ptr, modes_ptr, carry_in_ptr, carry_out_ptr, num_experts, OUT_M,
                          OUT_N, a_smem, b_smem, c0, full, empty, gl.constexpr(0),
                          gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_N), gl.constexpr(BLOCK_K),
                          gl.constexpr(STAGES), gl.constexpr(MMA_IN_FLIGHT), gl.constexpr(CARRY), gl.constexpr(A_GATHER),
                          gl.constexpr(OUT_T))),
             (_consumer, (out_ptr, offsets_ptr, counts_ptr, modes_ptr, carry_in_ptr, carry_out_ptr, num_experts, OUT_M,
                          OUT_N, a_smem, b_smem, c1, full, empty, gl.constexpr(1),
                          gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_N), gl.constexpr(BLOCK_K),
                          gl.constexpr(STAGES), gl.constexpr(MMA_IN_FLIGHT), gl.constexpr(CARRY), gl.constexpr(A_GATHER),
                          gl.constexpr(OUT_T))),
             (_producer, (a_ptr, b_ptr, a_index_ptr, offsets_ptr, counts_ptr, modes_ptr, num_experts, OUT_M,
                          OUT_N, a_smem, b_smem, full, empty, gl.constexpr(NUM_PROGRAMS),
                          gl.constexpr(BLOCK_N), gl.constexpr(BLOCK_K), gl.constexpr(STAGES), gl.constexpr(CARRY),
                          gl.constexpr(A_GATHER)))],
            [4, GATHER_WARPS if A_GATHER else 1], gather_registers(A_GATHER, BLOCK_K))
    invalidate_ring(full, empty, STAGES)
