"""Synchronisation inside a persistent kernel: bounded counter waits, releases, async-proxy fences, trace stamps.

Programs of one grid meet through GPU-local int32 counters: a producer
publishes with :func:`release_add` (a CTA barrier, then one release
increment), a consumer spins in :func:`wait_counter` (acquire loads, GPU
scope) within a poll budget. A wait that runs out records
``[wait id, index, target, seen]`` in the error word (the first failure only)
and drops the program's budget to 0, so later waits fail at once and the grid
drains; the host names the wait from the id (``WAIT_*``). Reads by TMA after
an acquire need :func:`fence_async_proxy`. ``pass_barrier_kernel`` is the
barrier across ranks before a pass (its epoch on the device, so a captured
graph replays it unchanged).

TRACE builds stamp each program's row of an int64 ``[programs, TRACE_ROW]``
buffer with globaltimer times and wait totals, then log its tasks and waits
after them (:func:`trace_event`; profiling only, `megamoe trace` draws them).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from megamoe.kernels.comm import signal_and_wait

#: Wait ids of the error word (megamoe.megakernel.kernel names them).
WAIT_ROWS_READY = tl.constexpr(1)
WAIT_TILE_DONE = tl.constexpr(2)
WAIT_Y_DONE = tl.constexpr(3)
WAIT_SHARED_DONE = tl.constexpr(4)
WAIT_PASS_END = tl.constexpr(5)
WAIT_PASS_START = tl.constexpr(6)

#: TRACE: int64 [programs, TRACE_FIELDS] of globaltimer stamps and wait totals (profiling only).
TRACE_START = tl.constexpr(0)
TRACE_END = tl.constexpr(1)
TRACE_WAIT_NS = tl.constexpr(2)
TRACE_WAITS = tl.constexpr(3)
TRACE_SHARED_END = tl.constexpr(4)
TRACE_SM = tl.constexpr(5)  # the SM the program ran on
TRACE_WAIT_ROWS_NS = tl.constexpr(6)  # the part of TRACE_WAIT_NS spent on rows_ready
TRACE_WAIT_TILE_NS = tl.constexpr(7)  # ... and on tile_done (a down task waiting for its row tile's gate/up)
TRACE_EVENTS = tl.constexpr(8)  # events this program logged (more than TRACE_MAX_EVENTS: the rest dropped)
TRACE_FIELDS = tl.constexpr(9)
#: After the fields, up to TRACE_MAX_EVENTS events of 4 int64: start, end (globaltimer ns), kind, detail.
#: Kinds: a wait's WAIT_* id (detail: the counter's index) or a TRACE_KIND_* task.
#: 4096: the backward megakernel's compute workers log ~2,300 tasks each for kimi-k2's 192 x 341 rows (its weight
#: gradients alone ~2,050 blocks per program); 1024 dropped most of them (17 MB of trace for 132 programs).
TRACE_MAX_EVENTS = tl.constexpr(4096)
TRACE_EVENT_WORDS = tl.constexpr(4)
TRACE_ROW = tl.constexpr(9 + 4 * 4096)
TRACE_KIND_GATE_UP = tl.constexpr(16)  # detail: row tile << 16 | n-tile
TRACE_KIND_DOWN = tl.constexpr(17)  # detail: row tile << 16 | n-tile
TRACE_KIND_SHARED_GATE_UP = tl.constexpr(18)  # detail: token tile << 16 | n-tile
TRACE_KIND_SHARED_DOWN = tl.constexpr(19)  # detail: token tile << 16 | n-tile
TRACE_KIND_PULL = tl.constexpr(20)  # detail: minibatch
TRACE_KIND_PUSH = tl.constexpr(21)  # detail: minibatch
# the backward's (detail: row tile << 16 | n-tile; wgrad: its block; pull: minibatch); 22 was its replay's, gone
TRACE_KIND_DACT = tl.constexpr(23)
TRACE_KIND_DX = tl.constexpr(24)
TRACE_KIND_SHARED_DACT = tl.constexpr(25)
TRACE_KIND_SHARED_DX = tl.constexpr(26)
TRACE_KIND_WGRAD = tl.constexpr(27)
TRACE_KIND_BWD_PULL = tl.constexpr(28)


@triton.jit
def trace_clock(TRACE: tl.constexpr):
    """globaltimer ns in TRACE builds (0 otherwise: the interpreter cannot run the timer's inline asm)."""
    t = tl.full((), 0, tl.int64)
    if TRACE:
        t = globaltimer()
    return t


@triton.jit
def trace_event(trace_ptr, start, kind, detail, TRACE: tl.constexpr):
    """TRACE: log an event of this program from ``start`` to now (its slot taken by one atomic: the scalar
    atomic runs once per program and hands every thread the same slot)."""
    if TRACE:
        end = globaltimer()
        n = tl.atomic_add(trace_ptr + TRACE_EVENTS, 1, sem="relaxed")
        if n < TRACE_MAX_EVENTS:
            event = trace_ptr + TRACE_FIELDS + n * TRACE_EVENT_WORDS
            tl.store(event, start)
            tl.store(event + 1, end)
            tl.store(event + 2, tl.full((), kind, tl.int64))
            tl.store(event + 3, tl.zeros((), tl.int64) + detail)


@triton.jit
def fence_async_proxy(FENCE: tl.constexpr):
    """Order generic-proxy writes seen through an acquire before this thread's TMA (async-proxy) reads."""
    if FENCE:
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.b32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def wait_counter(ptr, target, budget, error_ptr, index, trace_ptr, WAIT_ID: tl.constexpr, WAIT: tl.constexpr,
                 TRACE: tl.constexpr):
    """Spin (acquire, GPU scope) until ``*ptr >= target``; returns the program's remaining poll budget.

    A timeout records ``[WAIT_ID, index, target, seen]`` (first failure only) and returns 0. TRACE adds
    the nanoseconds spent here to ``trace_ptr[TRACE_WAIT_NS]`` (and to its rows_ready or tile_done share) and
    counts the wait.
    """
    if WAIT:
        if TRACE:
            t0 = globaltimer()
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        polls = 0
        while (seen < target) & (polls < budget):
            seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
            polls += 1
        if seen < target:
            if tl.atomic_cas(error_ptr, 0, WAIT_ID) == 0:
                tl.store(error_ptr + 1, index)
                tl.store(error_ptr + 2, target)
                tl.store(error_ptr + 3, seen)
            budget = 0
        else:
            budget = budget - polls
        if TRACE:
            waited = globaltimer() - t0
            tl.atomic_add(trace_ptr + TRACE_WAIT_NS, waited, sem="relaxed")
            if WAIT_ID == WAIT_ROWS_READY:
                tl.atomic_add(trace_ptr + TRACE_WAIT_ROWS_NS, waited, sem="relaxed")
            if WAIT_ID == WAIT_TILE_DONE:
                tl.atomic_add(trace_ptr + TRACE_WAIT_TILE_NS, waited, sem="relaxed")
            tl.atomic_add(trace_ptr + TRACE_WAITS, 1, sem="relaxed")
            if polls > 0:  # a wait that spun: on the timeline
                trace_event(trace_ptr, t0, WAIT_ID, index, TRACE)
    return budget


@triton.jit
def release_add(ptr):
    """Publish this program's earlier stores: every thread's stores, then one release increment."""
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release", scope="gpu")


@triton.jit(do_not_specialize=["my_rank", "budget"])
def pass_barrier_kernel(flag_peer_ptrs, flags_ptr, epoch_ptr, my_rank, num_ranks, budget, error_ptr):
    """A barrier across ranks whose epoch lives on the device (a captured graph replays it unchanged)."""
    tl.debug_barrier()
    epoch = tl.atomic_add(epoch_ptr, 1, sem="relaxed", scope="gpu") + 1
    signal_and_wait(flag_peer_ptrs, flags_ptr, my_rank, num_ranks, epoch, budget, error_ptr, WAIT_PASS_START)
    tl.debug_barrier()
