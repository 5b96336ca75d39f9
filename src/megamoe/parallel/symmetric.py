"""Symmetric memory: named buffers present on every rank with one layout.

A :class:`SymmetricWorkspace` is a set of named buffers that exist on every
rank of an :class:`~megamoe.parallel.world.EPWorld` with the same layout; a kernel
on any rank addresses any peer's copy through a device table of peer base
addresses (``peer_ptrs``), exactly as on GPUs:

- CUDA: torch symmetric memory (``symm_mem.empty`` + ``rendezvous``; no
  multicast). Peer buffers are mapped into this process by the driver.
- CPU: one process per rank (gloo). Each rank's workspace is a file in
  /dev/shm that every rank maps, so a peer's buffer is read and written
  directly, and Triton kernels under TRITON_INTERPRET=1 load and store
  through the same kind of raw peer addresses.

:func:`workspace` keeps one workspace per set of buffers on the world
(``world.resources``); ``world.close()`` frees them.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megamoe.parallel.world import EPWorld

#: Every buffer in a workspace starts on this boundary (TMA and 16-byte vector access).
BUFFER_ALIGN = 256


@dataclass(frozen=True)
class BufferSpec:
    """A named buffer of a workspace: the same shape and dtype on every rank."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _layout(specs: Sequence[BufferSpec]) -> tuple[dict[str, int], int]:
    offsets: dict[str, int] = {}
    cursor = 0
    for spec in specs:
        if spec.name in offsets:
            raise ValueError(f"buffer name {spec.name!r} appears twice in the workspace")
        if any((not isinstance(s, int)) or s < 0 for s in spec.shape):
            raise ValueError(f"buffer {spec.name!r} has a bad shape {spec.shape}")
        offsets[spec.name] = cursor
        cursor += -(-spec.nbytes // BUFFER_ALIGN) * BUFFER_ALIGN
    return offsets, max(cursor, BUFFER_ALIGN)


class SymmetricWorkspace:
    """Named buffers present on every rank of ``world`` with one layout.

    ``local(name)`` is this rank's buffer, ``peer(name, r)`` rank r's buffer
    as a tensor usable from this rank, ``peer_ptrs(name)`` an int64 ``[R]``
    device tensor of every rank's buffer address (in this process) for
    kernels. Buffers start zeroed. Collective: every rank constructs it with
    the same specs, and every rank calls :meth:`free`.
    """

    def __init__(self, world: EPWorld, specs: Sequence[BufferSpec]):
        self.world = world
        self.specs = {spec.name: spec for spec in specs}
        self._offsets, self.nbytes = _layout(specs)
        self._handle = None
        if world.is_cuda:
            self._bases = self._map_cuda()
        else:
            self._bases = self._map_shared_files()
        self._ptrs = torch.tensor([b.data_ptr() for b in self._bases], dtype=torch.int64, device=world.device)
        # views and address tables made once: a pass asks for them every time, and each costs host time
        # (a peer_ptrs sum is a kernel launch)
        self._views = {(name, r): self._view(name, r) for name in self.specs for r in range(world.size)}
        self._peer_ptrs = {name: self._ptrs + self._offsets[name] for name in self.specs}
        world.barrier("a symmetric workspace's allocation")

    def _map_cuda(self) -> list[torch.Tensor]:
        import torch.distributed._symmetric_memory as symm_mem

        local = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=self.world.device)
        local.zero_()
        self._handle = symm_mem.rendezvous(local, self.world.group)
        return [
            local if r == self.world.rank else self._handle.get_buffer(r, (self.nbytes,), torch.uint8)
            for r in range(self.world.size)
        ]

    def _map_shared_files(self) -> list[torch.Tensor]:
        token = self.world.all_gather_object(uuid.uuid4().hex)[0]
        paths = [f"/dev/shm/megamoe-{token}-{r}" for r in range(self.world.size)]
        # A fresh file reads as zeros; every rank maps every file, then each
        # owner unlinks its own: the mappings outlive the names, nothing leaks.
        local = torch.from_file(paths[self.world.rank], shared=True, size=self.nbytes, dtype=torch.uint8)
        self.world.barrier("a symmetric workspace's files made")
        bases = [local if r == self.world.rank else torch.from_file(p, shared=True, size=self.nbytes, dtype=torch.uint8)
                 for r, p in enumerate(paths)]
        self.world.barrier("a symmetric workspace's files mapped")
        os.unlink(paths[self.world.rank])
        return bases

    def _spec(self, name: str) -> BufferSpec:
        if self._bases is None:
            raise RuntimeError("this workspace has been freed")
        try:
            return self.specs[name]
        except KeyError:
            raise ValueError(f"no buffer {name!r} in the workspace; it holds {sorted(self.specs)}") from None

    def _view(self, name: str, rank: int) -> torch.Tensor:
        spec = self.specs[name]
        start = self._offsets[name]
        return self._bases[rank][start : start + spec.nbytes].view(spec.dtype).view(spec.shape)

    def peer(self, name: str, rank: int) -> torch.Tensor:
        """Rank ``rank``'s copy of buffer ``name``, addressable from this rank (the same view every call)."""
        self._spec(name)
        if not 0 <= rank < self.world.size:
            raise ValueError(f"rank must be in [0, {self.world.size}), got {rank}")
        return self._views[name, rank]

    def local(self, name: str) -> torch.Tensor:
        """This rank's copy of buffer ``name``."""
        return self.peer(name, self.world.rank)

    def peer_ptrs(self, name: str) -> torch.Tensor:
        """int64 ``[R]`` on the world's device: address of buffer ``name`` on each rank (one tensor, not to be
        written)."""
        self._spec(name)
        return self._peer_ptrs[name]

    @property
    def usable(self) -> bool:
        """False once freed."""
        return self._bases is not None

    def free(self) -> None:
        """Release the memory (collective: after every rank's last use)."""
        if self._bases is None:
            return
        self.world.barrier("a symmetric workspace's release")
        self._bases = None
        self._handle = None
        self._ptrs = None
        self._views, self._peer_ptrs = {}, {}


def workspace(world: EPWorld, specs: Sequence[BufferSpec]) -> SymmetricWorkspace:
    """The workspace of ``specs`` kept on ``world`` (``world.resources``), allocated on first use
    (collective); ``world.close()`` frees it."""
    specs = tuple(specs)
    return world.resources.get(("symmetric", specs), lambda: SymmetricWorkspace(world, specs))
