"""Replay a pass's device work from a CUDA graph once its launch arguments repeat.

An eager megakernel pass queues ~10 launches (barrier, schedule, row tiles, the
kernel) whose host time the GPU waits on: 0.5-1.3 ms per pass on the H200
hosts, 10-15 % of a qwen3.5-397b pass (benchmarks/results/2026-11-30-uncut-tiles).
Their arguments are the layer's own buffers plus the caller's weights, so a
graph captured once replays every later pass with the same weights (same
addresses; their values may change in place, as an optimizer step does) and
the same token count. The caller keeps outside the graph what reads tensors
that are new every pass (staging x, the weighted sum).

A model's MoE layers share one kernel per shape and call it in turn, each with
its own weights: one graph per layer, so the graphs are kept by key (least
recently used first out). The backward's graphs return nothing and leave nothing live: they share one memory
pool (``shared_pool``), so sixty layers' graphs hold one set of temporaries, not sixty.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

import torch

from megamoe import runtime

#: Graphs kept per kernel: a model's MoE layers of one shape (60 in kimi-k2), with room.
DEFAULT_MAX_GRAPHS = 128


#: The tensors a pass hands out that its graphs' keys name come from a private memory pool (``KeyedPool``); off,
#: from the shared allocator. On by default: one H200 at sonic-7b (24576 tokens), the bench's training step 4.3 ms
#: against 7.8-9.3 without it, whose steps recaptured their graphs (benchmarks/results/2026-12-06-h200-keyed-pool-step).
#: Its cost: between two steps the pool keeps the freed weight gradients' blocks for the next step's, so the
#: forward has that much less of the shared allocator (the peak, at the backward's end, is unchanged).
#: ``MEGAMOE_KEYED_POOL`` (0 or 1) sets it.
KEYED_POOL = runtime.env_switch("MEGAMOE_KEYED_POOL", True)


def layout_key(tensors: Iterable[torch.Tensor | None]) -> tuple:
    """What a captured kernel baked in about each tensor: address, shape, strides and dtype."""
    return tuple(None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in tensors)


class KeyedPool:
    """A private CUDA memory pool for the tensors a pass hands out that its graphs are keyed on: a training
    forward's h (the backward reads it) and a backward's weight gradients (the caller keeps them).

    From the shared allocator their addresses follow whatever else was allocated and freed between two steps, so
    the keys need not repeat: on one H100 at sonic-7b (24576 tokens) the bench's step captured its forward's graph
    every other step and never replayed its backward's (benchmarks/results/2026-12-06-h100-wgrad-gather). Here a
    freed h or gradient goes back to blocks only these tensors use, so the next step's, allocated in the same
    order, land where the last step's were: one key per layer (two while gradients accumulate: the first
    microbatch's stays as ``.grad``). The pool's cached blocks serve only these tensors, which a training loop
    allocates again every step. Kernels share one pool per device (:func:`device_pool`): a model's layer shapes, or a
    bench's BF16 and FP8 runners, reuse each other's freed blocks instead of each keeping its own (kimi-k2's
    weight gradients are 34 GB). No pool on the CPU, or while someone else's graph is being captured (its
    allocations belong to that graph's pool)."""

    def __init__(self, device: torch.device, enabled: bool | None = None) -> None:
        """``enabled``: None reads :data:`KEYED_POOL` (at the kernel's construction); False: no pool (its
        ``allocating`` is the shared allocator)."""
        self.device = device
        enabled = KEYED_POOL if enabled is None else enabled
        self.pool = torch.cuda.MemPool() if enabled and device.type == "cuda" else None

    def allocating(self) -> contextlib.AbstractContextManager:
        """A context in which this thread's CUDA allocations on the device come from the pool."""
        if self.pool is None or torch.cuda.is_current_stream_capturing():
            return contextlib.nullcontext()
        return torch.cuda.use_mem_pool(self.pool, self.device)


_DEVICE_POOLS: dict[torch.device, KeyedPool] = {}


def device_pool(device: torch.device, enabled: bool | None = None) -> KeyedPool:
    """The process's :class:`KeyedPool` of ``device`` (made at the first call that enables it), or a disabled one:
    ``enabled`` None reads :data:`KEYED_POOL`; the CPU has none."""
    enabled = KEYED_POOL if enabled is None else enabled
    if not enabled or device.type != "cuda":
        return KeyedPool(device, enabled=False)
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device not in _DEVICE_POOLS:
        _DEVICE_POOLS[device] = KeyedPool(device, enabled=True)
    return _DEVICE_POOLS[device]


class GraphReplay:
    """CUDA graphs of a pass's device work, one per key: captured the second time a key is seen, replayed after.

    A key seen once runs eagerly (which also compiles what capture cannot), so arguments that never repeat
    never pay for a capture. At most ``max_graphs`` graphs are kept (each holds the pass's temporaries in its
    memory pool, a few MB), and twice as many keys seen once; the least recently used go first. Inside
    someone else's capture the work runs eagerly, to be captured there.

    ``shared_pool``: every graph is captured into one memory pool, for work whose temporaries are all dead when it
    returns (it returns None): replays run one after another on the stream, so each may reuse the others' memory.
    """

    def __init__(self, max_graphs: int = DEFAULT_MAX_GRAPHS, *, shared_pool: bool = False) -> None:
        if not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs must be a positive int, got {max_graphs!r}")
        self.max_graphs = max_graphs
        self.shared_pool = shared_pool
        self._pool = None  # the shared pool's handle, made at the first capture
        self._graphs: OrderedDict[Hashable, tuple[torch.cuda.CUDAGraph, object]] = OrderedDict()
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        #: passes served by a replay, and graphs captured (tests and benchmarks read them)
        self.replays = 0
        self.captures = 0

    def __call__(self, key: Hashable, work: Callable[[], object]) -> object:
        if torch.cuda.is_current_stream_capturing():
            return work()
        if key in self._graphs:
            self._graphs.move_to_end(key)
            graph, result = self._graphs[key]
        elif key not in self._seen:
            self._seen[key] = None
            if len(self._seen) > 2 * self.max_graphs:
                self._seen.popitem(last=False)
            return work()
        else:
            del self._seen[key]
            if len(self._graphs) >= self.max_graphs:
                self._graphs.popitem(last=False)  # its pool is freed before the new capture
            graph = torch.cuda.CUDAGraph()
            if self.shared_pool and self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool):
                result = work()
            if self.shared_pool and result is not None:
                raise RuntimeError("a shared pool's graphs must return None: a later graph may reuse its memory")
            self._graphs[key] = graph, result
            self.captures += 1
        graph.replay()
        self.replays += 1
        return result


def graph_counts(world) -> dict:
    """The CUDA-graph replays and captures so far of every kernel ``world`` keeps (``world.resources``), summed:
    of the forward passes and of the composed backwards' windows. A steady training loop replays every pass and
    captures each layer's graphs once; captures that keep growing mean the keys (the tensors' addresses) do not
    repeat."""
    kept = [obj for obj in world.resources if isinstance(getattr(obj, "replay", None), GraphReplay)]
    counts = {"kernels": len(kept)}
    for prefix, name in (("", "replay"), ("backward_", "backward_replay")):
        graphs = [getattr(k, name) for k in kept if isinstance(getattr(k, name, None), GraphReplay)]
        counts[prefix + "replays"] = sum(g.replays for g in graphs)
        counts[prefix + "captures"] = sum(g.captures for g in graphs)
    return counts
