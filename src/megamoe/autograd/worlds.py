"""Worlds by handle: torch.library ops take tensors and scalars only, so the layer's ops name their world by
an int.

A world is registered the first time a layer op runs on it and forgotten when it is garbage collected (weak
references: the registry keeps nothing alive). The handle is an int of this process only.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from megamoe.parallel.world import EPWorld

_WORLDS: weakref.WeakValueDictionary[int, EPWorld] = weakref.WeakValueDictionary()
_HANDLES: dict[int, int] = {}  # id(world) -> handle, while the world lives
_NEXT = itertools.count(1)


@torch.compiler.assume_constant_result  # torch.compile: a constant of the graph, looked up when it is traced
def handle_of(world: EPWorld) -> int:
    """The int that names ``world`` (this very object) in this process, registered on first use."""
    if not isinstance(world, EPWorld):
        raise ValueError(f"world must be an EPWorld (megamoe.init_world / megamoe.launch), got {type(world).__name__}")
    handle = _HANDLES.get(id(world))
    if handle is None or _WORLDS.get(handle) is not world:
        handle = _HANDLES[id(world)] = next(_NEXT)
        _WORLDS[handle] = world
        weakref.finalize(world, _HANDLES.pop, id(world), None)
    return handle


def world_of(handle: int) -> EPWorld:
    """The world registered as ``handle``; RuntimeError once it is gone."""
    world = _WORLDS.get(handle)
    if world is None:
        raise RuntimeError(f"world handle {handle} names no live EPWorld of this process")
    return world
