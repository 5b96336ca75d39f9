"""The expert-parallel world: ranks, their process group, and symmetric memory.

An :class:`EPWorld` is one rank's view of an expert-parallel group of R ranks
over ``torch.distributed``. A :class:`SymmetricWorkspace` is a set of named
buffers that exist on every rank with the same layout; a kernel on any rank
addresses any peer's copy through a device table of peer base addresses
(``peer_ptrs``), exactly as on GPUs:

- CUDA: torch symmetric memory (``symm_mem.empty`` + ``rendezvous``; no
  multicast). Peer buffers are mapped into this process by the driver.
- CPU: one process per rank (gloo). Each rank's workspace is a file in
  /dev/shm that every rank maps, so a peer's buffer is read and written
  directly, and Triton kernels under TRITON_INTERPRET=1 load and store
  through the same kind of raw peer addresses.

:func:`launch` starts R local ranks (CPU processes, or one per visible GPU)
and :func:`init_world` joins a group started by torchrun.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: Every buffer in a workspace starts on this boundary (TMA and 16-byte vector access).
BUFFER_ALIGN = 256

#: NVLink multicast can take shared GPUs down: it stays off wherever we start processes.
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class EPWorld:
    """One rank of an expert-parallel group.

    Attributes:
        rank: this rank's index in ``group``, in [0, size).
        size: R, ranks in the group.
        group: the ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA;
            gloo when ranks share a GPU, which NCCL refuses).
        device: where this rank's tensors live (``cpu`` or ``cuda:i``).
        ranks_per_device: how many ranks of this host share one GPU (1 unless more
            ranks than GPUs were started: correctness runs only). A persistent
            kernel takes at most its share of the SMs, or the ranks' grids could
            not all be resident at once.
    """

    rank: int
    size: int
    group: Any
    device: torch.device
    ranks_per_device: int = 1

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def barrier(self) -> None:
        if self.is_cuda and dist.get_backend(self.group) == "nccl":
            dist.barrier(group=self.group, device_ids=[self.device.index])
        else:
            dist.barrier(group=self.group)

    def largest(self, value: int) -> int:
        """The largest ``value`` over the group's ranks (collective: an all-reduce MAX, one host sync)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def _device_for_rank(rank: int, device: str) -> torch.device:
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is visible")
    # More ranks than GPUs (correctness runs only) need overlapping symmetric memory.
    return torch.device("cuda", rank % torch.cuda.device_count())


def init_world(device: str | None = None) -> EPWorld:
    """Join (or start) the default process group from torchrun-style env vars.

    ``device`` defaults to ``cuda`` when a GPU is visible, else ``cpu``.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    for key, value in _NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    rank = int(os.environ.get("RANK", "0"))
    size = int(os.environ.get("WORLD_SIZE", "1"))
    dev = _device_for_rank(int(os.environ.get("LOCAL_RANK", rank)), device)
    per_device = 1
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        per_device = -(-int(os.environ.get("LOCAL_WORLD_SIZE", size)) // torch.cuda.device_count())
    if not dist.is_initialized():
        nccl = dev.type == "cuda" and per_device == 1  # NCCL refuses two ranks on one GPU
        backend = "nccl" if nccl else "gloo"
        kwargs = {"device_id": dev} if nccl else {}
        timeout = timedelta(seconds=float(os.environ.get("MEGAMOE_DIST_TIMEOUT_S", "600")))
        # launch() hands its ranks a rendezvous file: no TCP port to race for with other jobs on the host
        init_file = os.environ.get("MEGAMOE_INIT_FILE")
        init_method = f"file://{init_file}" if init_file else "env://"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout,
                                **kwargs)
    return EPWorld(rank=dist.get_rank(), size=dist.get_world_size(), group=dist.group.WORLD, device=dev,
                   ranks_per_device=per_device)


def _rank_main(rank: int, size: int, device: str, result_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size),
                      MEGAMOE_INIT_FILE=os.path.join(result_dir, "rendezvous"))
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    path = os.path.join(result_dir, f"rank{rank}.pt")
    try:
        world = init_world(device)
        try:
            result = fn(world, *args)
        finally:
            free_workspaces()
            dist.destroy_process_group()
        torch.save({"ok": True, "result": result}, path)
    except BaseException as exc:  # report it to the launcher instead of dying silently
        torch.save({"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}, path)
        raise
    # The result is on disk: leave without the interpreter's teardown, where a CPU rank was seen (once in ~5
    # CI runs) to abort with "terminate called without an active exception" (a native thread still joinable
    # when its owner is destroyed), which the launcher would report as a rank that died without reporting.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(fn: Callable[..., Any], nprocs: int | None = None, *args: Any, device: str = "cpu") -> list[Any]:
    """Run ``fn(world, *args)`` on ``nprocs`` local ranks; returns each rank's result, by rank.

    ``fn`` must be importable (a module-level function) and its result
    picklable. CPU: ``nprocs`` processes over gloo. CUDA: ``nprocs`` defaults
    to the number of visible GPUs. A rank that raises makes ``launch`` raise
    RuntimeError with that rank's error.
    """
    if nprocs is None:
        nprocs = torch.cuda.device_count() if device == "cuda" else 1
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    _device_for_rank(0, device)
    if device == "cuda" and nprocs > torch.cuda.device_count():
        os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    for key, value in _NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    if device == "cpu":  # CPU ranks run Triton kernels under the interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    with tempfile.TemporaryDirectory(prefix="megamoe-launch-") as result_dir:
        context = mp.start_processes(
            _rank_main, args=(nprocs, device, result_dir, fn, args), nprocs=nprocs, join=False, start_method="spawn"
        )
        try:
            while not context.join():
                pass
        except mp.ProcessRaisedException:
            pass  # each rank wrote its error; report the first below
        except mp.ProcessExitedException as exc:
            raise RuntimeError(f"a rank died without reporting: {exc}") from None
        records = {}
        for rank in range(nprocs):
            path = os.path.join(result_dir, f"rank{rank}.pt")
            if os.path.exists(path):
                records[rank] = torch.load(path, weights_only=False)
        for rank, record in sorted(records.items()):
            if not record["ok"]:
                raise RuntimeError(f"rank {rank} failed: {record['error']}\n{record['trace']}")
        missing = [rank for rank in range(nprocs) if rank not in records]
        if missing:
            raise RuntimeError(f"ranks {missing} exited without a result")
        results = [records[rank]["result"] for rank in range(nprocs)]
        return results


# --------------------------------------------------------------------------- symmetric memory


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
        world.barrier()

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
        self.world.barrier()
        bases = [local if r == self.world.rank else torch.from_file(p, shared=True, size=self.nbytes, dtype=torch.uint8)
                 for r, p in enumerate(paths)]
        self.world.barrier()
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

    def free(self) -> None:
        """Release the memory (collective: after every rank's last use)."""
        if self._bases is None:
            return
        self.world.barrier()
        self._bases = None
        self._handle = None
        self._ptrs = None
        self._views, self._peer_ptrs = {}, {}


_WORKSPACES: dict[tuple, SymmetricWorkspace] = {}


def workspace(world: EPWorld, specs: Sequence[BufferSpec]) -> SymmetricWorkspace:
    """The cached workspace for (group, specs), allocated on first use (collective)."""
    key = (id(world.group), world.device, tuple(specs))
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = SymmetricWorkspace(world, specs)
    return ws


def free_workspaces() -> None:
    """Free every cached workspace of this process (collective)."""
    while _WORKSPACES:
        _, ws = _WORKSPACES.popitem()
        ws.free()
