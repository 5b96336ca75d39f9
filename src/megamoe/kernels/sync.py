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

TRACE builds stamp each program's row of an int64 ``[programs, TRACE_FIELDS]``
buffer with globaltimer times and wait totals (profiling only).
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
TRACE_FIELDS = tl.constexpr(8)


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
