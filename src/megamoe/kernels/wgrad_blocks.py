"""One block of the Gluon wgrad (``out[l] = A[rows of l]ᵀ · B[rows of l]``, 128 x BLOCK_N, two 64-row consumer halves),
the parts every deal of its blocks shares: the producer's K-step loads of a block, a consumer's half (its wgmmas
from zeros or the backward window's carry, then its BF16 store by TMA or its carry out), the output descriptor and
the carry's addressing. The deals are :mod:`megamoe.kernels.wgrad_warp_specialized` (each expert's blocks round robin),
:mod:`megamoe.kernels.wgrad_dynamic` (from a counter) and :mod:`megamoe.kernels.wgrad_planned` (the counter's order
in a fixed plan); the FP8 wgrad reuses the carry and the store."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

from megamoe.kernels.gluon_gather import copy_rows_async, land_on, row_indices, row_starts_of
from megamoe.kernels.gluon_ring import drain_steps, release_step
from megamoe.kernels.wgrad_carry import CARRY_IN, CARRY_OUT, STORE

HALF_M = gl.constexpr(64)  # rows of one consumer warpgroup
SPLIT_N = gl.constexpr(64)  # columns of one store of a split epilogue (SPLIT_STORE)


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
def site_descriptors(a_ptr, b_ptr, row_end, site_last, g, full, OUT_M, OUT_N, BLOCK_N: gl.constexpr,
                     BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """A call site's A and B descriptors over an expert's rows (up to ``row_end``), made once the site's last load
    (step ``site_last``; -1: none) has landed, unless a later load into its slot was issued (that one waited for
    the slot's release, so it landed): the TMA unit reads a descriptor until its load lands."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, HALF_M], gl.bfloat16)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], gl.bfloat16)
    if (site_last >= 0) & (g - site_last <= STAGES):
        mbarrier.wait(full.index(site_last % STAGES), (site_last // STAGES) & 1)
    rows = gl.maximum(row_end, 1)
    a_desc = tma.make_tensor_descriptor(a_ptr, [rows, OUT_M], [OUT_M, 1], [BLOCK_K, HALF_M], a_layout)
    b_desc = tma.make_tensor_descriptor(b_ptr, [rows, OUT_N], [OUT_N, 1], [BLOCK_K, BLOCK_N], b_layout)
    return a_desc, b_desc


@gluon.jit
def first_rows(a_index_ptr, row0, row_end, BLOCK_K: gl.constexpr, A_GATHER: gl.constexpr):
    """A_GATHER: the row indices of the first two K steps from ``row0`` (:func:`load_block`'s ``rows_now`` and
    ``rows_next``), loaded by the caller where their round trip is off the producer's path (once an expert, or a
    block ahead); else zeros, never read."""
    if A_GATHER:
        return (row_indices(a_index_ptr, row0, row_end, BLOCK_K, HALF_M),
                row_indices(a_index_ptr, row0 + BLOCK_K, row_end, BLOCK_K, HALF_M))
    else:
        return 0, 0


@gluon.jit
def load_block(a_ptr, a_desc, b_desc, a_index_ptr, rows_now, rows_next, row0, row_end, m0, n0, OUT_M, a_smem,
               b_smem, full, empty, g, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
               A_GATHER: gl.constexpr):
    """Issue the block at (m0, n0)'s K steps (rows row0 .. row_end of its expert) into the ring from step g on;
    returns the next step. A_GATHER: A's rows gathered by cp.async, each step's indices loaded two steps ahead (a
    32-row K step's wgmmas take about as long as a dependent global load; loaded one step ahead, the gathering
    wgrads ran 2x the copied rows' time, 2026-12-06), the first two steps' by the caller (:func:`first_rows`)."""
    A_TMA_BYTES: gl.constexpr = 0 if A_GATHER else 2 * BLOCK_K * HALF_M * 2
    step_bytes: gl.constexpr = A_TMA_BYTES + BLOCK_K * BLOCK_N * 2
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
def column_halves(x):
    """``x`` `[R, N]` -> its first and last N / 2 columns, in registers (the wgmma layout holds a row's columns in
    one thread's registers, so the split moves no data)."""
    R: gl.constexpr = x.shape[0]
    N: gl.constexpr = x.shape[1]
    return gl.split(x.reshape([R, 2, N // 2]).permute((0, 2, 1)))


@gluon.jit
def store_quarter(x, out_desc, c_smem, i: gl.constexpr, expert, r0, n0, OUT_T: gl.constexpr):
    """Quarter i of a half's block (``x`` `[64, 64]` bf16, its columns n0 + 64 i ..) by TMA from buffer i % 2 of
    ``c_smem``, once that buffer's store two quarters back has left it."""
    buf = c_smem.index(i % 2)
    tma.store_wait(pendings=1)
    if OUT_T:
        buf.store(gl.permute(x, (1, 0)))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [expert, n0 + i * SPLIT_N, r0], buf.reshape([1, SPLIT_N, HALF_M]))
    else:
        buf.store(x)
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [expert, r0, n0 + i * SPLIT_N], buf.reshape([1, HALF_M, SPLIT_N]))


@gluon.jit
def store_half_split(acc, out_desc, c_smem, expert, r0, n0, OUT_T: gl.constexpr = False):
    """The half's BF16 gradient (`[64, 256]`) in four 64-column quarters through two 64 x 64 buffers in turn: a
    quarter of the shared memory a whole half's buffer takes, left to the ring."""
    gl.static_assert(acc.shape[1] == 4 * SPLIT_N, "a split store takes 256-wide blocks")
    lo, hi = column_halves(acc.to(gl.bfloat16))
    q0, q1 = column_halves(lo)
    q2, q3 = column_halves(hi)
    store_quarter(q0, out_desc, c_smem, 0, expert, r0, n0, OUT_T)
    store_quarter(q1, out_desc, c_smem, 1, expert, r0, n0, OUT_T)
    store_quarter(q2, out_desc, c_smem, 2, expert, r0, n0, OUT_T)
    store_quarter(q3, out_desc, c_smem, 3, expert, r0, n0, OUT_T)


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
def half_block(out_desc, a_smem, b_smem, c_smem, full, empty, g, expert, mode, row0, row_end, m0, n0, carry_in_ptr,
                carry_out_ptr, OUT_M, OUT_N, HALF: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                STAGES: gl.constexpr, MMA_IN_FLIGHT: gl.constexpr, CARRY: gl.constexpr, GATHER: gl.constexpr,
                OUT_T: gl.constexpr, SPLIT_STORE: gl.constexpr = False):
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
    store = True
    if CARRY:
        store = carry_end_half(acc, mode, carry_out_ptr, r0, n0, OUT_M, OUT_N, HALF_M, BLOCK_N, OUT_T)
    if store:
        if SPLIT_STORE:
            store_half_split(acc, out_desc, c_smem, expert, r0, n0, OUT_T)
        else:
            store_half(acc, out_desc, c_smem, expert, r0, n0, HALF_M, BLOCK_N, OUT_T)
    return g
