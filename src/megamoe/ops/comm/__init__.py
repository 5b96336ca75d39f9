"""The layer's NVLink communication: its workspace and the standalone pull / push launches.

One :class:`CommWorkspace` per shape (kept on the world) holds the
symmetric buffers every rank exposes to its peers; the launches move rows
between them with the Triton kernels of :mod:`megamoe.kernels.comm`:

    dispatch_pull         routed[t]  = x_{src_rank[t]}[src_index[t] // k]            (forward, pull)
    combine_push          combine_{src_rank[t]}[src_index[t]] = y[t]                  (forward, push)
    reverse_combine_pull  routed[t]  = d_out_{src_rank[t]}[src_index[t] // k]        (backward, pull)
    reverse_dispatch_push combine_{src_rank[t]}[src_index[t]] = dx[t]                 (backward, push)
    pull_route_scalars    w[t] = router_weights_{src_rank[t]}[src_index[t]]           (backward, pull)
    push_route_scalars    d_router_{src_rank[t]}[src_index[t]] = d_w[t]               (backward, push)
    push_dispatch         the push twin of dispatch_pull (the signalling experiment)
    device_barrier        an in-kernel barrier across ranks (flags, bounded wait)

``t`` runs over the rows of a :class:`~megamoe.routing.schedule.PullSchedule`; rows with
``src_rank == -1`` (alignment padding, rows past ``num_rows``) are skipped.
Slot ``i*k + j`` of a ``[N*k, D]`` slot buffer is route j of token i.

Synchronisation: a pull needs the peers' sources written before it
starts, a push must land before the home rank reads its slots. With
``sync=True`` (the default) each launch is bracketed by a device synchronise
and ``world.barrier()`` on both sides; pass ``sync=False`` to order launches
yourself (``device_barrier`` or ``world.barrier``). ``push_dispatch(signal=True)``
synchronises inside the kernel instead: a completion flag per peer, waited for
with a bounded budget.

Every in-kernel wait is bounded: a peer that never writes its flag makes the
launch raise RuntimeError naming the flag and the peer (after ``check``), and
the workspace refuses further use (its flags are out of step; free it).

Each entry point has a pure-PyTorch twin (``*_reference``; reverse-combine's is ``dispatch_reference`` over
the d_out rows, reverse-dispatch's ``combine_reference``): plain indexing over
the per-rank tensors, the oracle of the tests.

Files: ``workspace`` (the buffers and their shape), ``tile`` (the copy tile),
``launches`` (pull, push, barrier), ``push`` (push dispatch), ``reference``
(the twins).
"""

from megamoe.ops.comm.launches import (combine_push, device_barrier, dispatch_pull, pull_route_scalars,
                                      push_route_scalars, reverse_combine_pull, reverse_dispatch_push)
from megamoe.ops.comm.push import PushSchedule, build_push_schedule, push_dispatch
from megamoe.ops.comm.reference import combine_reference, dispatch_reference
from megamoe.ops.comm.tile import CommTuning, copy_tile
from megamoe.ops.comm.workspace import (ROW_FORMATS, WAITS, CommShape, CommWorkspace, QuantRows, comm_shape,
                                        comm_workspace, quantize_rows_reference)

__all__ = [
    "ROW_FORMATS", "WAITS", "CommShape", "CommTuning", "CommWorkspace", "PushSchedule", "QuantRows",
    "build_push_schedule", "combine_push", "combine_reference", "comm_shape", "comm_workspace", "copy_tile",
    "device_barrier", "dispatch_pull", "dispatch_reference", "pull_route_scalars", "push_dispatch",
    "push_route_scalars", "quantize_rows_reference", "reverse_combine_pull", "reverse_dispatch_push",
]
