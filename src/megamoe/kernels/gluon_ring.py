"""A warp-specialised ring of K steps, shared by the Gluon kernels: its barriers, and the consumers' side (after a
step's wgmma, wait for it, or with one left in flight for the previous step's, and give its slot back).

Step g lives in slot g % STAGES; its ``full`` wait is for phase parity (g // STAGES) & 1, which only tells the right
phase from the wrong one while the waiter is at most one ring round ahead of the loads: a consumer must not wait
for step g before step g - STAGES has landed (each consumer of today's kernels reads every step in order, so it
cannot). A consumer that skipped ahead by a whole task would pass a stale phase, read an empty slot and free it
early (2026-12-04-forward-ping-pong: the GPU test hung). The ``expect`` bytes must be the step's exact TMA bytes, or
the ``full`` phase never completes."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma_wait


#: The fewest ring slots a kernel may get: a consumer that holds one step while it waits for the next (a wgmma
#: group left in flight, FP8's paired K steps) deadlocks a single slot, a hang rather than an error. It stays here,
#: not in ``megamoe.planner.tiles``: it is this ring's correctness floor, set by its consumers' waits, not a
#: tuning choice.
MIN_STAGES = 2


@gluon.jit
def release_step(acc, empty, slot, first_step, STAGES: gl.constexpr, MMA_IN_FLIGHT: gl.constexpr):
    """After issuing a step's wgmma into ``acc`` from ring ``slot``: wait for it and free the slot, or (MMA_IN_FLIGHT)
    leave it in flight and free the previous step's slot, which is done once this one is the only wgmma outstanding (nothing to
    free at a block's ``first_step``). An arrive per consumer warpgroup frees a slot."""
    if MMA_IN_FLIGHT:
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        if not first_step:
            mbarrier.arrive(empty.index((slot + STAGES - 1) % STAGES), count=1)
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(slot), count=1)
    return acc


@gluon.jit
def drain_steps(acc, empty, g, any_step, STAGES: gl.constexpr, MMA_IN_FLIGHT: gl.constexpr):
    """At a block's end (``g`` one past its last step): with MMA_IN_FLIGHT wait for the last wgmma and free its slot
    (if the block had ``any_step``)."""
    if MMA_IN_FLIGHT:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if any_step:
            mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), count=1)
    return acc


@gluon.jit
def pass_steps(full, empty, g, steps, STAGES: gl.constexpr):
    """A consumer whose rows of a task are all past its tile's end (``SKIP_EMPTY_HALF``: the bottom 64 rows of a tile
    of at most 64): its ``steps`` steps from ring step ``g`` waited for and given back, no wgmma (the other warpgroup
    then has the tensor cores to itself); returns the next step. Each wait keeps this consumer within a ring round
    of the loads, so its arrivals count for the right round of each slot."""
    for _ in range(steps):
        s = g % STAGES
        mbarrier.wait(full.index(s), (g // STAGES) & 1)
        mbarrier.arrive(empty.index(s), count=1)
        g += 1
    return g


@gluon.jit
def ring_barriers(STAGES: gl.constexpr, FULL_ARRIVALS: gl.constexpr = 1):
    """A ring's ``full`` barriers (FULL_ARRIVALS: the expect's arrival with the step's TMA bytes, and a gathering
    producer's threads', ``gluon_gather.full_arrivals``) and ``empty`` ones (an arrive per consumer warpgroup,
    two)."""
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(STAGES):
        mbarrier.init(full.index(slot), count=FULL_ARRIVALS)
        mbarrier.init(empty.index(slot), count=2)
    return full, empty


@gluon.jit
def invalidate_ring(full, empty, STAGES: gl.constexpr):
    """The ring's barriers invalidated at the kernel's end, after every partition has joined."""
    for slot in gl.static_range(STAGES):
        mbarrier.invalidate(full.index(slot))
        mbarrier.invalidate(empty.index(slot))
