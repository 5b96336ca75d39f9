"""The forward expert tiles on Hopper, warp-specialised in Gluon: a TMA producer warp and two MMA warpgroups.

``gate_up_kernel`` and ``down_kernel``'s contracts, tasks (``row_tile_task`` order over the device-built tile map)
and bits: each row's K loop is the same sequence of m64nNk16 wgmmas. What differs is who waits for what, as in
``wgrad_warp_specialized``: under ncu the Triton gate/up kernel's warps wait on the CTA barriers around each TMA
issue in 32 % of stall samples (benchmarks/results/2026-12-03-wgrad-ring-depth). Here

- a producer warp walks the program's tasks and issues each K step's TMA loads (the tile's two 64-row halves of A
  and the weight slice: gate and up slices for gate/up) into a ring of STAGES slots, waiting only for a slot's
  ``empty`` barrier. Both descriptors span whole tensors and are made once, so nothing is rewritten under a load;
- two consumer warpgroups, rows 0-63 and 64-127 of each tile, wait for a slot's ``full`` barrier, run their
  wgmmas, release the slot and, at the tile's end, store their half with masked stores (rows of the tile's
  region only: the rows past it belong to the next expert, which another program may be writing).

gate/up's gate and up slices share a ring slot ([2 x BLOCK_N, BLOCK_K]), so one m64n256k16 wgmma computes both
(two m64n128 wgmmas read the A half twice from shared memory).

down may run in ping-pong instead (PING_PONG): each warpgroup takes whole 128-row tiles in turn (two 64-row
accumulators of BLOCK_N columns), so one's stores run under the other's wgmmas. At kimi-k2's K = 2048 that tied
(benchmarks/results/2026-12-04-forward-ping-pong); it is kept for short K (fine-grained experts: I = 256-768, 4-12
K steps a tile), where a cooperative tile's epilogue is a large share of its time and the tensor cores idle through
it: ~4 % off the expert forward there on one H100 (benchmarks/results/2026-12-07-ping-pong-down).

SKIP_EMPTY_HALF: a tile of at most 64 rows (an expert's tail) runs in one warpgroup, the other passing its steps
(``gluon_ring.pass_steps``) and the producer loading no bottom A half, so the tensor cores do half a tile's work
there; the ping-pong runs such a tile's top half alone. Behind ``megamoe.ops.experts.SKIP_EMPTY_HALF``.

GPU only (Gluon has no interpreter); `megamoe.ops.experts.gate_up` runs it on Hopper for 128-row tiles (-3.1 to
-3.4 % on 341-row experts; the cooperative down stays Triton, 2 % faster there:
benchmarks/results/2026-12-03-forward-warp-specialized), `megamoe.ops.experts.down` the ping-pong down at short K
behind ``MEGAMOE_PING_PONG_DOWN``, and GPU tests hold both to the Triton kernels' bits. Launch with a scratch
allocator (the descriptors), 4 warps.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from megamoe.kernels.activation import activation
from megamoe.kernels.gluon_gather import (GATHER_WARPS, REGS_GATHER, copy_rows_async, full_arrivals, land_on,
                                         row_starts)
from megamoe.kernels.gluon_ring import drain_steps, invalidate_ring, pass_steps, release_step, ring_barriers
from megamoe.kernels.quant import mxfp8_round_tile
from megamoe.kernels.tasks import tile_task

HALF_M = gl.constexpr(64)  # rows of one consumer warpgroup
REGS_PRODUCER = gl.constexpr(80)  # the producer warp's registers: at 40-64 the sm_90 build spills 16-72 bytes


@gluon.jit
def expect_a_halves(a_desc, row0, row_end, k, bar, a_smem, s, step_bytes: gl.constexpr, half_bytes: gl.constexpr,
                    SKIP_EMPTY_HALF: gl.constexpr):
    """A K step's ``expect`` (``step_bytes``: both A halves', ``half_bytes`` each, and the weights') and A's two
    64-row halves [row0 + 64 h, k] by TMA into slots 2s and 2s + 1. SKIP_EMPTY_HALF: where the tile has at most 64
    rows the bottom half is not loaded and its bytes not expected (no consumer multiplies it: each passes such a
    half's steps; the slot keeps older rows there, which no stored row reads)."""
    if SKIP_EMPTY_HALF:
        bottom = row_end - row0 > HALF_M
        mbarrier.expect(bar, step_bytes, pred=bottom)
        mbarrier.expect(bar, step_bytes - half_bytes, pred=row_end - row0 <= HALF_M)
        tma.async_copy_global_to_shared(a_desc, [row0, k], bar, a_smem.index(2 * s))
        tma.async_copy_global_to_shared(a_desc, [row0 + HALF_M, k], bar, a_smem.index(2 * s + 1), pred=bottom)
    else:
        mbarrier.expect(bar, step_bytes)
        tma.async_copy_global_to_shared(a_desc, [row0, k], bar, a_smem.index(2 * s))
        tma.async_copy_global_to_shared(a_desc, [row0 + HALF_M, k], bar, a_smem.index(2 * s + 1))


@gluon.jit
def forward_producer(a_ptr, w_ptr, rows, w_rows, stride_a, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                     tile_run_ptr, num_tiles_ptr, N, K, a_smem, w_smem, full, empty, GATE_UP: gl.constexpr,
                     NUM_PROGRAMS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                     STAGES: gl.constexpr, a_index_ptr, A_GATHER: gl.constexpr,
                     SKIP_EMPTY_HALF: gl.constexpr = False):
    """The K steps of this program's tasks, in the operands' dtype (bf16 here, e4m3 for the FP8-block kernel). Weight
    rows: gate/up's expert l holds gate rows l*2N .. and up rows l*2N + N ..; down's holds rows l*N .. A_GATHER (bf16):
    A row r is row ``a_index[r]`` of ``a`` (``megamoe.kernels.gluon_gather``; rows past a tile's region zero, their
    results masked as ever). SKIP_EMPTY_HALF: a tile's bottom A half not loaded where it has no rows
    (:func:`expect_a_halves`)."""
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK_K], dtype)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype)
    a_desc = tma.make_tensor_descriptor(a_ptr, [rows, K], [stride_a, 1], [HALF_M, BLOCK_K], a_layout)
    w_desc = tma.make_tensor_descriptor(w_ptr, [w_rows, K], [K, 1], [BLOCK_N, BLOCK_K], w_layout)
    W_SLICES: gl.constexpr = 2 if GATE_UP else 1
    A_TMA_ROWS: gl.constexpr = 0 if A_GATHER else 2 * HALF_M
    step_bytes: gl.constexpr = (A_TMA_ROWS + W_SLICES * BLOCK_N) * BLOCK_K * dtype.primitive_bitwidth // 8
    a_half_bytes: gl.constexpr = HALF_M * BLOCK_K * dtype.primitive_bitwidth // 8
    num_n = gl.cdiv(N, BLOCK_N)
    num_tasks = gl.load(num_tiles_ptr) * num_n
    g = 0  # the program's K steps: slot g % STAGES, phase (g // STAGES) & 1
    for task in range(gl.program_id(0), num_tasks, NUM_PROGRAMS):
        expert, row0, row_end, n = tile_task(task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                                             tile_run_ptr, GROUP_M)
        w_row = expert * W_SLICES * N + n * BLOCK_N
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
            w = w_smem.index(s)
            tma.async_copy_global_to_shared(w_desc, [w_row, k], full.index(s), w.slice(0, BLOCK_N))
            if GATE_UP:  # the up slice in the slot's second half: one wgmma computes both
                tma.async_copy_global_to_shared(w_desc, [w_row + N, k], full.index(s), w.slice(BLOCK_N, BLOCK_N))
            if A_GATHER:  # under the weights' TMA; each thread's landing one of the barrier's arrivals
                copy_rows_async(top, top_ok, k, K, a_smem.index(2 * s), BLOCK_K)
                copy_rows_async(bottom, bottom_ok, k, K, a_smem.index(2 * s + 1), BLOCK_K)
                land_on(full.index(s))
            g += 1


@gluon.jit
def store_half_tile(ptr, stride, values, row0, rows_ok, col0, cols_ok, layout: gl.constexpr):
    """Masked store of a [64, BLOCK_N] half tile in ``ptr``'s dtype, rows row0.. of which ``rows_ok``, columns col0..
    of which ``cols_ok``, through a layout of 16-byte row runs."""
    tile = gl.convert_layout(values.to(ptr.dtype.element_ty), layout)
    r = gl.arange(0, values.shape[0], layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, values.shape[1], layout=gl.SliceLayout(0, layout))
    base = ptr + row0.to(gl.int64) * stride + col0
    gl.store(base + (r[:, None] * stride + c[None, :]), tile, mask=(r < rows_ok)[:, None] & (c < cols_ok)[None, :])


@gluon.jit
def store_half_tile_at(ptr, stride, values, index_ptr, row0, rows_ok, col0, cols_ok, layout: gl.constexpr):
    """:func:`store_half_tile` with row r of the half tile (rows row0..) stored at ``ptr``'s row ``index[row0 + r]``
    (int32; rows whose index is < 0 not stored)."""
    tile = gl.convert_layout(values.to(ptr.dtype.element_ty), layout)
    r = gl.arange(0, values.shape[0], layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, values.shape[1], layout=gl.SliceLayout(0, layout))
    dest = gl.load(index_ptr + row0 + r, mask=r < rows_ok, other=-1).to(gl.int64)
    mask = (dest >= 0)[:, None] & (c < cols_ok)[None, :]
    gl.store(ptr + col0 + (dest[:, None] * stride + c[None, :]), tile, mask=mask)


@gluon.jit
def add_bias_columns(acc, b_ptr, offset, col0, N, SPLIT: gl.constexpr, BLOCK_N: gl.constexpr,
                     layout: gl.constexpr):
    """acc + bias elements ``b[offset + col0 + c]`` along acc's columns c, in FP32 (``expert_bias.add_bias``'s add in
    this accumulator's ``layout``); columns at or past N add 0. SPLIT: acc holds BLOCK_N gate columns, then BLOCK_N up
    columns, whose bias elements start N further."""
    c = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    within = c % BLOCK_N
    offs = col0 + within
    if SPLIT:
        offs = gl.where(c < BLOCK_N, offs, N + offs)
    b = gl.load(b_ptr + offset + offs, mask=within < N - col0, other=0.0).to(gl.float32)
    return acc + gl.expand_dims(b, 0)


@gluon.jit
def cooperative_consumer(out_ptr, act_ptr, b_ptr, stride_out, stride_act, tile_expert_ptr, tile_row0_ptr,
                         tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, N, K, limit, alpha, a_smem, w_smem, full, empty,
                         HALF: gl.constexpr, GATE_UP: gl.constexpr, ACT: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                         BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                         MMA_IN_FLIGHT: gl.constexpr, HAS_BIAS: gl.constexpr, A_GATHER: gl.constexpr,
                         MX_ROUND: gl.constexpr, SKIP_EMPTY_HALF: gl.constexpr, out_index_ptr=None,
                         W_KN: gl.constexpr = False, SCATTER: gl.constexpr = False):
    """Rows HALF * 64 .. HALF * 64 + 63 of every tile of this program (one warpgroup). gate/up: out is h (gate
    columns 0..N-1, up columns N..2N-1) and act_ptr act (MX_ROUND: rounded to the MXFP8 grid along N first); down
    (and dx, ``dx_warp_specialized``): out is y (SCATTER: row r at out's row ``out_index[r]``). HAS_BIAS: b_ptr's
    expert row is added to the accumulator first. W_KN: the weight slots are [BK, BLOCK_N] N-major (dx's, as
    stored), else [BLOCK_N, BK] K-major. SKIP_EMPTY_HALF: the bottom warpgroup passes the steps of a tile of at most
    64 rows (``gluon_ring.pass_steps``; none of its rows is stored)."""
    W_SLICES: gl.constexpr = 2 if GATE_UP else 1
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, W_SLICES * BLOCK_N, 16])
    num_n = gl.cdiv(N, BLOCK_N)
    num_tasks = gl.load(num_tiles_ptr) * num_n
    g = 0
    for task in range(gl.program_id(0), num_tasks, NUM_PROGRAMS):
        expert, row0, row_end, n = tile_task(task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                                             tile_run_ptr, GROUP_M)
        # SKIP_EMPTY_HALF: a zero-trip K loop and a guarded epilogue, not a branch around the task as in the other
        # consumers (that spilled 40 bytes of the epilogue's addresses here, beside the 128-column accumulator)
        mma_k = K
        if SKIP_EMPTY_HALF and HALF == 1:  # a tile of at most 64 rows: its steps passed, none multiplied
            passed = gl.cdiv(K, BLOCK_K) * (row_end - row0 <= HALF_M).to(gl.int32)
            g = pass_steps(full, empty, g, passed, STAGES)
            mma_k = K - passed * BLOCK_K
        acc = gl.zeros((HALF_M, W_SLICES * BLOCK_N), gl.float32, mma)  # gate/up: gate columns, then up columns
        for k in range(0, mma_k, BLOCK_K):
            s = g % STAGES
            mbarrier.wait(full.index(s), (g // STAGES) & 1)
            if A_GATHER:  # cp.async's generic-proxy writes before the wgmma's async-proxy reads
                fence_async_shared()
            a = a_smem.index(2 * s + HALF)
            if W_KN:
                w = w_smem.index(s)
            else:
                w = w_smem.index(s).permute((1, 0))
            acc = warpgroup_mma(a, w, acc, is_async=True)
            acc = release_step(acc, empty, s, k == 0, STAGES, MMA_IN_FLIGHT)
            g += 1
        acc = drain_steps(acc, empty, g, mma_k > 0, STAGES, MMA_IN_FLIGHT)
        if SKIP_EMPTY_HALF and HALF == 1:
            if mma_k > 0:  # a passed tile stores nothing
                _forward_epilogue(acc, out_ptr, act_ptr, b_ptr, out_index_ptr, stride_out, stride_act, expert,
                                  row0 + HALF_M, row_end, n, N, limit, alpha, GATE_UP, ACT, BLOCK_N, HAS_BIAS,
                                  MX_ROUND, SCATTER)
        else:
            _forward_epilogue(acc, out_ptr, act_ptr, b_ptr, out_index_ptr, stride_out, stride_act, expert,
                              row0 + HALF * HALF_M, row_end, n, N, limit, alpha, GATE_UP, ACT, BLOCK_N, HAS_BIAS,
                              MX_ROUND, SCATTER)


@gluon.jit
def _forward_epilogue(acc, out_ptr, act_ptr, b_ptr, out_index_ptr, stride_out, stride_act, expert, first, row_end, n,
                      N, limit, alpha, GATE_UP: gl.constexpr, ACT: gl.constexpr, BLOCK_N: gl.constexpr,
                      HAS_BIAS: gl.constexpr, MX_ROUND: gl.constexpr, SCATTER: gl.constexpr):
    """A cooperative consumer's stores of its rows first.. (those before row_end) at n-tile n: gate/up's h and act
    (MX_ROUND: act on the MXFP8 grid), down's y (SCATTER: row r at y's row ``out_index[r]``); HAS_BIAS: the expert's
    bias row added first."""
    W_SLICES: gl.constexpr = 2 if GATE_UP else 1
    mma: gl.constexpr = acc.type.layout
    runs: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [4, 1], [1, 0])
    rows_ok = row_end - first
    col0 = n * BLOCK_N
    if HAS_BIAS:
        acc = add_bias_columns(acc, b_ptr, expert * W_SLICES * N, col0, N, GATE_UP, BLOCK_N, mma)
    if GATE_UP:
        gate, up = gl.split(gl.permute(gl.reshape(acc, (HALF_M, 2, BLOCK_N)), (0, 2, 1)))
        store_half_tile(out_ptr, stride_out, gate, first, rows_ok, col0, N - col0, runs)
        store_half_tile(out_ptr, stride_out, up, first, rows_ok, N + col0, N - col0, runs)
        act = activation(gate, up, limit, alpha, ACT)
        if MX_ROUND:  # MXFP8 as BF16 operands (megamoe.ops.experts_mxfp8_bf16): 32-blocks along N
            act = mxfp8_round_tile(act, 1)
        store_half_tile(act_ptr, stride_act, act, first, rows_ok, col0, N - col0, runs)
    elif SCATTER:
        store_half_tile_at(out_ptr, stride_out, acc, out_index_ptr, first, rows_ok, col0, N - col0, runs)
    else:
        store_half_tile(out_ptr, stride_out, acc, first, rows_ok, col0, N - col0, runs)


@gluon.jit
def ping_pong_consumer(out_ptr, b_ptr, out_index_ptr, stride_out, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                       tile_run_ptr, num_tiles_ptr, N, K, a_smem, w_smem, full, empty, turn, WARPGROUP: gl.constexpr,
                       NUM_PROGRAMS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr, W_KN: gl.constexpr,
                       SCATTER: gl.constexpr, SKIP_EMPTY_HALF: gl.constexpr):
    """A plain GEMM's tiles in ping-pong (down; dx, ``dx_warp_specialized``): warpgroup WARPGROUP takes every other
    task of this program, from its WARPGROUP-th, all 128 rows (the ring's two 64-row A halves into two accumulators,
    each step's weight slot read by both wgmmas: [BLOCK_N, BK] K-major, or with W_KN [BK, BLOCK_N] N-major), one
    step's wgmmas left in flight, and stores them (HAS_BIAS: the expert's row of ``b`` `[L, N]` added first; SCATTER:
    row r at ``out``'s row ``out_index[r]``, none where it is < 0). Its slot releases count for both of the ring's
    arrivals.

    The K loops take turns: ``turn.index(w)`` is arrived on by the other warpgroup once its K loop has waited for its
    last slot, and warpgroup w waits for it before its next K loop. Without the turns a warpgroup would wait for a
    slot a whole task of steps ahead of the loads, where a ``full`` wait by phase parity passes on a stale phase
    (``gluon_ring``; 2026-12-04-forward-ping-pong: the GPU test hung). SKIP_EMPTY_HALF: a tile of at most 64 rows
    runs the top accumulator's wgmmas only (the producer did not load the bottom A half)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    runs: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [4, 1], [1, 0])
    num_n = gl.cdiv(N, BLOCK_N)
    num_tasks = gl.load(num_tiles_ptr) * num_n
    steps = gl.cdiv(K, BLOCK_K)  # a task's K steps
    g = WARPGROUP * steps  # as the producer counts
    turns = WARPGROUP - 1  # the other warpgroup's K loops waited for (warpgroup 0's first K loop waits for none)
    for task in range(gl.program_id(0) + WARPGROUP * NUM_PROGRAMS, num_tasks, 2 * NUM_PROGRAMS):
        expert, row0, row_end, n = tile_task(task, num_n, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                                             tile_run_ptr, GROUP_M)
        if turns >= 0:
            mbarrier.wait(turn.index(WARPGROUP), turns & 1)
        turns += 1
        top = gl.zeros((HALF_M, BLOCK_N), gl.float32, mma)
        bottom = gl.zeros((HALF_M, BLOCK_N), gl.float32, mma)
        if SKIP_EMPTY_HALF and row_end - row0 <= HALF_M:
            top, bottom, g = _ping_pong_k_loop(top, bottom, a_smem, w_smem, full, empty, turn, g, K, WARPGROUP,
                                               BLOCK_K, STAGES, W_KN, False)
        else:
            top, bottom, g = _ping_pong_k_loop(top, bottom, a_smem, w_smem, full, empty, turn, g, K, WARPGROUP,
                                               BLOCK_K, STAGES, W_KN, True)
        g += steps  # the other warpgroup's task
        col0 = n * BLOCK_N
        if HAS_BIAS:
            top = add_bias_columns(top, b_ptr, expert * N, col0, N, False, BLOCK_N, mma)
            bottom = add_bias_columns(bottom, b_ptr, expert * N, col0, N, False, BLOCK_N, mma)
        if SCATTER:
            store_half_tile_at(out_ptr, stride_out, top, out_index_ptr, row0, row_end - row0, col0, N - col0, runs)
            store_half_tile_at(out_ptr, stride_out, bottom, out_index_ptr, row0 + HALF_M, row_end - row0 - HALF_M,
                               col0, N - col0, runs)
        else:
            store_half_tile(out_ptr, stride_out, top, row0, row_end - row0, col0, N - col0, runs)
            store_half_tile(out_ptr, stride_out, bottom, row0 + HALF_M, row_end - row0 - HALF_M, col0, N - col0,
                            runs)


@gluon.jit
def _ping_pong_k_loop(top, bottom, a_smem, w_smem, full, empty, turn, g, K, WARPGROUP: gl.constexpr,
                      BLOCK_K: gl.constexpr, STAGES: gl.constexpr, W_KN: gl.constexpr, BOTH: gl.constexpr):
    """A ping-pong task's K loop from ring step ``g``: each step's wgmmas into ``top`` (A's top half) and, with BOTH,
    ``bottom``, one step's left in flight; the other warpgroup's turn once the last slot is waited for; each slot
    given back for both of the ring's arrivals. Returns (top, bottom, the next step)."""
    for k in range(0, K, BLOCK_K):
        s = g % STAGES
        mbarrier.wait(full.index(s), (g // STAGES) & 1)
        if W_KN:
            w = w_smem.index(s)
        else:
            w = w_smem.index(s).permute((1, 0))
        top = warpgroup_mma(a_smem.index(2 * s), w, top, is_async=True)
        if BOTH:
            bottom = warpgroup_mma(a_smem.index(2 * s + 1), w, bottom, is_async=True)
            top, bottom = warpgroup_mma_wait(num_outstanding=2, deps=(top, bottom))  # the previous step's are done
        else:
            top = warpgroup_mma_wait(num_outstanding=1, deps=(top,))
        if k > 0:
            mbarrier.arrive(empty.index((s + STAGES - 1) % STAGES), count=2)
        g += 1
    mbarrier.arrive(turn.index(1 - WARPGROUP), count=1)
    if BOTH:
        top, bottom = warpgroup_mma_wait(num_outstanding=0, deps=(top, bottom))
    else:
        top = warpgroup_mma_wait(num_outstanding=0, deps=(top,))
    if K > 0:
        mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), count=2)
    return top, bottom, g


@gluon.jit
def ping_pong_turns():
    """The two turn barriers of a ping-pong kernel (``ping_pong_consumer``), initialised: one arrival each."""
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for warpgroup in gl.static_range(2):
        mbarrier.init(turn.index(warpgroup), count=1)
    return turn


@gluon.jit
def invalidate_turns(turn):
    """The turn barriers invalidated at the kernel's end, after every partition has joined."""
    for warpgroup in gl.static_range(2):
        mbarrier.invalidate(turn.index(warpgroup))


@gluon.jit
def forward_ws_kernel(a_ptr, w_ptr, out_ptr, act_ptr, b_ptr, stride_a, stride_out, stride_act,
                      tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr,
                      rows, w_rows, N, K, limit, alpha, a_index_ptr,
                      GATE_UP: gl.constexpr, ACT: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                      MMA_IN_FLIGHT: gl.constexpr = False, HAS_BIAS: gl.constexpr = False,
                      A_GATHER: gl.constexpr = False, MX_ROUND: gl.constexpr = False,
                      PING_PONG: gl.constexpr = False, SKIP_EMPTY_HALF: gl.constexpr = False):
    """One persistent launch of 128 x BLOCK_N tiles over every (row tile, n-tile) task.

    gate/up (GATE_UP): A = x_rows `[rows, K=D]`, w = w_gate_up `[w_rows = L*2N, K]`, out = h `[rows, 2N]`, act
    `[rows, N]` (N = I); ``gate_up_kernel``'s BLOCK_N gate and BLOCK_N up columns per tile. down: A = act
    `[rows, K=I]`, w = w_down `[w_rows = L*N, K]`, out = y `[rows, N=D]`; act_ptr unused. bf16, rows contiguous.
    HAS_BIAS: ``b_ptr`` the experts' bias (gate/up's `[L, 2N]`, down's `[L, N]`, bf16) is added before the stores
    (else it is never read). A_GATHER: A row r is row ``a_index[r]`` (int32) of ``a`` `[S, K]` (one rank's gate/up
    reads its tokens in place of routed copies; else a_index is never read). MX_ROUND (gate/up): act rounded to
    the MXFP8 grid along N (32-blocks of each row; BLOCK_N a multiple of 32) before its store. PING_PONG (down, not
    A_GATHER): the warpgroups take whole tiles in turn (``ping_pong_consumer``). SKIP_EMPTY_HALF: a tile of at most
    64 rows runs one warpgroup's wgmmas (its bottom A half neither loaded nor multiplied; the same bits)."""
    gl.static_assert(not PING_PONG or not (GATE_UP or A_GATHER), "ping-pong runs down's tiles only")
    W_SLICES: gl.constexpr = 2 if GATE_UP else 1
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK_K], gl.bfloat16)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, HALF_M, BLOCK_K], a_layout)
    w_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, W_SLICES * BLOCK_N, BLOCK_K], w_layout)
    full, empty = ring_barriers(STAGES, full_arrivals(A_GATHER))
    if PING_PONG:
        turn = ping_pong_turns()
        gl.warp_specialize(
            [(ping_pong_consumer, (out_ptr, b_ptr, out_ptr, stride_out, tile_expert_ptr, tile_row0_ptr,
                                   tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, N, K, a_smem, w_smem, full, empty,
                                   turn, gl.constexpr(0), gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_N),
                                   gl.constexpr(BLOCK_K), gl.constexpr(GROUP_M), gl.constexpr(STAGES),
                                   gl.constexpr(HAS_BIAS), gl.constexpr(False), gl.constexpr(False),
                                   gl.constexpr(SKIP_EMPTY_HALF))),
             (ping_pong_consumer, (out_ptr, b_ptr, out_ptr, stride_out, tile_expert_ptr, tile_row0_ptr,
                                   tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, N, K, a_smem, w_smem, full, empty,
                                   turn, gl.constexpr(1), gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_N),
                                   gl.constexpr(BLOCK_K), gl.constexpr(GROUP_M), gl.constexpr(STAGES),
                                   gl.constexpr(HAS_BIAS), gl.constexpr(False), gl.constexpr(False),
                                   gl.constexpr(SKIP_EMPTY_HALF))),
             (forward_producer, (a_ptr, w_ptr, rows, w_rows, stride_a, tile_expert_ptr, tile_row0_ptr,
                                 tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, N, K, a_smem, w_smem, full, empty,
                                 gl.constexpr(False), gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_N),
                                 gl.constexpr(BLOCK_K), gl.constexpr(GROUP_M), gl.constexpr(STAGES), a_index_ptr,
                                 gl.constexpr(False), gl.constexpr(SKIP_EMPTY_HALF)))],
            [4, 1], [232, REGS_PRODUCER])
        invalidate_turns(turn)
    else:
        gl.warp_specialize(
            [(cooperative_consumer, (out_ptr, act_ptr, b_ptr, stride_out, stride_act, tile_expert_ptr,
                                     tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, N, K, limit, alpha,
                                     a_smem, w_smem, full, empty, gl.constexpr(0), gl.constexpr(GATE_UP),
                                     gl.constexpr(ACT), gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_N),
                                     gl.constexpr(BLOCK_K), gl.constexpr(GROUP_M), gl.constexpr(STAGES),
                                     gl.constexpr(MMA_IN_FLIGHT), gl.constexpr(HAS_BIAS), gl.constexpr(A_GATHER),
                                     gl.constexpr(MX_ROUND), gl.constexpr(SKIP_EMPTY_HALF))),
             (cooperative_consumer, (out_ptr, act_ptr, b_ptr, stride_out, stride_act, tile_expert_ptr,
                                     tile_row0_ptr, tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, N, K, limit, alpha,
                                     a_smem, w_smem, full, empty, gl.constexpr(1), gl.constexpr(GATE_UP),
                                     gl.constexpr(ACT), gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_N),
                                     gl.constexpr(BLOCK_K), gl.constexpr(GROUP_M), gl.constexpr(STAGES),
                                     gl.constexpr(MMA_IN_FLIGHT), gl.constexpr(HAS_BIAS), gl.constexpr(A_GATHER),
                                     gl.constexpr(MX_ROUND), gl.constexpr(SKIP_EMPTY_HALF))),
             (forward_producer, (a_ptr, w_ptr, rows, w_rows, stride_a, tile_expert_ptr, tile_row0_ptr,
                                 tile_row_end_ptr, tile_run_ptr, num_tiles_ptr, N, K, a_smem, w_smem, full, empty,
                                 gl.constexpr(GATE_UP), gl.constexpr(NUM_PROGRAMS), gl.constexpr(BLOCK_N),
                                 gl.constexpr(BLOCK_K), gl.constexpr(GROUP_M), gl.constexpr(STAGES), a_index_ptr,
                                 gl.constexpr(A_GATHER), gl.constexpr(SKIP_EMPTY_HALF)))],
            [4, GATHER_WARPS if A_GATHER else 1], [232, REGS_GATHER if A_GATHER else REGS_PRODUCER])
    invalidate_ring(full, empty, STAGES)
