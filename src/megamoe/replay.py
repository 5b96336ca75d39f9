"""Replay a pass's device work from a CUDA graph once its launch arguments repeat.

An eager megakernel pass queues ~10 launches (barrier, schedule, row tiles, the
kernel) whose host time the GPU waits on: 0.5-1.3 ms per pass on the H200
hosts, 10-15 % of a qwen3.5-397b pass (benchmarks/results/2026-11-30-uncut-tiles).
Their arguments are the layer's own buffers plus the caller's weights, so a
graph captured once replays every later pass with the same weights (same
addresses; their values may change in place, as an optimizer step does) and
the same token count. The caller keeps outside the graph what reads tensors
that are new every pass (staging x, the weighted sum).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

import torch


def layout_key(tensors: Iterable[torch.Tensor | None]) -> tuple:
    """What a captured kernel baked in about each tensor: address, shape, strides and dtype."""
    return tuple(None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in tensors)


class GraphReplay:
    """One CUDA graph of a pass, captured the second time in a row a key is seen and replayed while it repeats.

    A key seen once runs eagerly (it also warms up compilation, which capture cannot do), so arguments that
    change every call never pay for a capture; a new repeated key replaces the graph (one at a time: its
    memory pool holds the pass's temporaries). Inside someone else's capture the work runs eagerly, to be
    captured there.
    """

    def __init__(self) -> None:
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_key: Hashable = None
        self._result: object = None
        self._last_key: Hashable = None
        #: passes served by a replay (tests and benchmarks read it)
        self.replays = 0

    def __call__(self, key: Hashable, work: Callable[[], object]) -> object:
        if torch.cuda.is_current_stream_capturing():
            return work()
        if self._graph is not None and key == self._graph_key:
            self._graph.replay()
            self.replays += 1
            return self._result
        if key != self._last_key:
            self._last_key = key
            return work()
        self._graph = self._result = None  # the old graph's pool is freed before the new capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = work()
        self._graph, self._graph_key, self._result = graph, key, result
        graph.replay()
        self.replays += 1
        return result
