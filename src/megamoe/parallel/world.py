"""The expert-parallel world: ranks and their process group.

An :class:`EPWorld` is one rank's view of an expert-parallel group of R ranks
over ``torch.distributed`` (gloo on CPU ranks, NCCL on GPUs). It owns the
collective objects built on it for reuse (symmetric workspaces, layer
kernels: :class:`WorldResources`), freed together by :meth:`EPWorld.close`.
Symmetric memory itself is :mod:`megamoe.parallel.symmetric`.

:func:`launch` starts R local ranks (CPU processes, or one per visible GPU)
and :func:`init_world` joins a group started by torchrun.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.reduction
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: NVLink multicast can take shared GPUs down: it stays off wherever we start processes.
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class WorldResources:
    """Collective objects kept for reuse on one world, by key (what sizes them): symmetric workspaces, the
    kernels of a layer shape. Building one is collective, so every rank asks for the same keys in the same
    order. :meth:`free` (collective) releases every object that has a ``free`` method, newest first."""

    def __init__(self) -> None:
        self._items: dict[Hashable, tuple[object, Hashable]] = {}

    def get(self, key: Hashable, make: Callable[[], Any], version: Hashable = None) -> Any:
        """The object kept under ``key``, made by ``make()`` on first use; one kept with another ``version``
        is dropped first (its memory goes before the new one is made)."""
        kept = self._items.get(key)
        if kept is not None and kept[1] == version and getattr(kept[0], "usable", True):
            return kept[0]
        self._items.pop(key, None)
        obj = make()
        self._items[key] = (obj, version)
        return obj

    def discard(self, obj: object) -> None:
        """Forget ``obj`` (it was freed by its owner)."""
        for key in [key for key, (kept, _) in self._items.items() if kept is obj]:
            del self._items[key]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        """The kept objects, oldest first."""
        return iter([obj for obj, _ in self._items.values()])

    def check_errors(self) -> None:
        """Raise what a kept object recorded and has not raised yet (each one's ``check_errors``, oldest first:
        a kernel's timed-out wait or an unchecked pass's bad expert id). Reads the device: a host sync."""
        for obj, _ in list(self._items.values()):
            check = getattr(obj, "check_errors", None)
            if check is not None:
                check()

    def free(self) -> None:
        """Free every kept object (collective: after every rank's last use)."""
        while self._items:
            _, (obj, _) = self._items.popitem()
            free = getattr(obj, "free", None)
            if free is not None:
                free()


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
        resources: the collective objects kept on this world (:class:`WorldResources`).
    """

    rank: int
    size: int
    group: Any
    device: torch.device
    ranks_per_device: int = 1
    resources: WorldResources = field(default_factory=WorldResources, compare=False, repr=False)
    _barriers: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)  # store barriers passed

    def close(self) -> None:
        """Free what was built on this world (collective); the process group stays."""
        self.resources.free()

    def check_errors(self) -> None:
        """Raise an error the layers on this world recorded in passes run with ``check=False`` (ValueError for
        an expert id out of range, RuntimeError for a timed-out wait): a host sync, for the end of a step."""
        self.resources.check_errors()

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def barrier(self, what: str = "a barrier") -> None:
        """Every rank reaches this point. Without NCCL (CPU ranks, ranks sharing a GPU) it meets through the
        group's store, so a rank that never comes is named: RuntimeError after :func:`peer_timeout_s` seconds
        (``MEGAMOE_PEER_TIMEOUT_S``), naming ``what`` and the missing ranks, on every rank that waited."""
        if self.is_cuda and dist.get_backend(self.group) == "nccl":
            dist.barrier(group=self.group, device_ids=[self.device.index])
            return
        store = _store_of(self.group)
        if store is None:
            dist.barrier(group=self.group)
            return
        self._barriers[0] += 1
        epoch = self._barriers[0]
        keys = [f"megamoe/barrier/{epoch}/{r}" for r in range(self.size)]
        store.set(keys[self.rank], what)
        timeout = peer_timeout_s()
        try:
            store.wait(keys, timedelta(seconds=timeout))
        except Exception:  # the store's timeout error: name who is missing
            missing = [r for r in range(self.size) if not store.check([keys[r]])]
            raise RuntimeError(f"rank {self.rank}: waited {timeout:g} s at {what} for rank(s) {missing}, which never "
                               f"arrived (MEGAMOE_PEER_TIMEOUT_S sets the wait)") from None
        if epoch > 2:  # every rank has left barrier epoch - 2: its key is read by nobody now
            store.delete_key(f"megamoe/barrier/{epoch - 2}/{self.rank}")

    def largest(self, value: int) -> int:
        """The largest ``value`` over the group's ranks (collective: an all-reduce MAX, one host sync)."""
        if not (self.is_cuda and dist.get_backend(self.group) == "nccl"):
            self.barrier("the group's largest token count")  # a peer that never comes is named, not waited on
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` (one shape on every rank) concatenated along dim 0, in rank order (collective; any
        dtype: moved as bytes, which every backend takes — gloo has no bf16)."""
        t = t.detach().contiguous()
        if self.size == 1:
            return t.clone()
        raw = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
        parts = [torch.empty_like(raw) for _ in range(self.size)]
        dist.all_gather(parts, raw, group=self.group)
        return torch.cat(parts).view(t.dtype)

    def check_agree(self, what: str, values: dict[str, Any]) -> None:
        """ValueError on every rank unless every rank passes equal ``values``, naming each field the ranks
        disagree on with every rank's value (collective: one all-gather; nothing on one rank)."""
        if self.size == 1:
            return
        everyone = self.all_gather_object(values)
        keys = {key for v in everyone for key in v}
        differ = [key for key in values if key in keys and len({repr(v.get(key)) for v in everyone}) > 1]
        differ += sorted(key for key in keys - set(values))
        if differ:
            fields = "; ".join(f"{key}: " + ", ".join(f"rank {r} {v.get(key)!r}" for r, v in enumerate(everyone))
                               for key in differ)
            raise ValueError(f"{what}: the ranks disagree ({fields}); every rank must build it alike")


#: Seconds a rank waits at a store barrier for a peer before naming it (MEGAMOE_PEER_TIMEOUT_S overrides).
DEFAULT_PEER_TIMEOUT_S = 300.0


def peer_timeout_s() -> float:
    """The store barriers' wait: ``MEGAMOE_PEER_TIMEOUT_S`` (seconds > 0), else :data:`DEFAULT_PEER_TIMEOUT_S`."""
    text = os.environ.get("MEGAMOE_PEER_TIMEOUT_S")
    if text is None:
        return DEFAULT_PEER_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"MEGAMOE_PEER_TIMEOUT_S must be a positive number of seconds, got {text!r}")
    return value


def _store_of(group) -> Any:
    """The store the group met through (None where torch does not say)."""
    try:
        return dist.distributed_c10d._get_process_group_store(group)
    except (AttributeError, RuntimeError, ValueError):
        return None


def _device_for_rank(rank: int, device: str) -> torch.device:
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is visible")
    # More ranks than GPUs (correctness runs only) need overlapping symmetric memory.
    return torch.device("cuda", rank % torch.cuda.device_count())


def init_world(device: str | None = None, group: Any = None) -> EPWorld:
    """Join (or start) the default process group from torchrun-style env vars; the world over ``group``.

    ``device`` defaults to ``cuda`` when a GPU is visible, else ``cpu``. ``group`` (default: every rank) is the
    expert-parallel group when it is one dimension of a larger job, e.g. ``mesh["ep"].get_group()`` of a
    ``DeviceMesh`` whose other dimension is data parallel (:mod:`megamoe.adapters.fsdp`); it must hold this rank.

    The one change it makes to the process's environment: ``NCCL_NVLS_ENABLE=0``,
    ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1`` where they are unset (multicast objects
    can take shared GPUs down, and NCCL, torch's symmetric memory and NVSHMEM read these switches only from the
    environment, when they first initialise). Everything else it reads (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MEGAMOE_DIST_TIMEOUT_S``, ``MEGAMOE_INIT_FILE``) it leaves as it found it.
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
    if group is None:
        group = dist.group.WORLD
    rank_in_group = dist.get_rank(group)
    if rank_in_group < 0:
        raise ValueError(f"rank {dist.get_rank()} is not in the group given to init_world")
    return EPWorld(rank=rank_in_group, size=dist.get_world_size(group), group=group, device=dev,
                   ranks_per_device=per_device)


def _rank_main(rank: int, size: int, device: str, result_dir: str, call: bytes, environ: dict[str, str],
               stdio: None = None) -> None:
    """One rank: the launcher's environment first (a forked rank has its fork server's), then ``fn`` and its
    arguments unpickled (``call``: importing fn's module, and with it megamoe's switches, reads that environment).
    ``stdio``: a forked rank's :class:`_LaunchersStdio`, taken while its arguments were unpickled."""
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size),
                      MEGAMOE_INIT_FILE=os.path.join(result_dir, "rendezvous"))
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    path = os.path.join(result_dir, f"rank{rank}.pt")
    try:
        fn, args = pickle.loads(call)
        world = init_world(device)
        # every rank connected before any runs: one done at once would close on a peer still connecting
        world.barrier("launch's start")
        result = fn(world, *args)
    except BaseException as exc:
        # Written first, with the time: the launcher reports the rank that failed first, not the peers that
        # lost it. No collective clean-up after a failure: the peers are elsewhere (it would hang or fail
        # again and hide this error); the process exits.
        torch.save({"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(),
                    "time": time.time()}, path)
        raise
    try:
        world.close()
        dist.destroy_process_group()
    except BaseException as exc:
        torch.save({"ok": False, "error": f"{type(exc).__name__} in the clean-up after fn returned: {exc}",
                    "trace": traceback.format_exc(), "time": time.time()}, path)
        raise
    torch.save({"ok": True, "result": result}, path)
    # The result is on disk: leave without the interpreter's teardown, where a CPU rank was seen (once in ~5
    # CI runs) to abort with "terminate called without an active exception" (a native thread still joinable
    # when its owner is destroyed), which the launcher would report as a rank that died without reporting.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def _interpreter_for_ranks(device: str):
    """``TRITON_INTERPRET`` as the ranks spawned inside need it, the caller's own back on exit: CPU ranks run Triton
    under the interpreter, GPU ranks compiled. A rank reads it when it imports the kernels (``triton.jit`` picks
    the interpreter then), so it must be in the environment it is spawned with. Left set in the caller, a CPU
    launch made every later GPU launch of the same process interpret (its ranks died on device pointers)."""
    before = os.environ.get("TRITON_INTERPRET")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


#: What a CPU rank's fork server imports once, so that each rank forked from it starts without importing them
#: (~3 s of a rank's start on the CPU, torch ~1.5 and torch._dynamo ~1.4 of it: a test suite spawns hundreds of
#: ranks). None of them reads megamoe's switches: the ranks import megamoe's kernels themselves, after taking the
#: launcher's environment (``_rank_main``).
RANK_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "triton", "megamoe.parallel.world"]


class _LaunchersStdio:
    """Pickled into a forked rank's arguments: the launcher's stdout and stderr as they are at the launch, which the
    rank takes as its own (a spawned rank inherits them; a forked one has its fork server's, which belong to
    whoever launched first: a CLI's progress lines, a test's captured output would go there)."""

    def __reduce__(self):
        return _take_stdio, tuple(multiprocessing.reduction.DupFd(fd) for fd in (1, 2))


def _take_stdio(out, err) -> None:
    """In the forked rank, while its arguments are unpickled: the launcher's stdout and stderr onto fds 1 and 2."""
    for fd, dup in ((1, out), (2, err)):
        got = dup.detach()
        os.dup2(got, fd)
        os.close(got)


def _start_method(device: str, fn: Callable) -> str:
    """``forkserver`` (preloaded with :data:`RANK_PRELOAD`) for CPU ranks; ``spawn`` on a GPU (a rank forked from a
    process that touched CUDA would fail) and for a ``fn`` of the launching script's ``__main__`` (a forked rank
    imports the script before it takes the launcher's environment)."""
    if device != "cpu" or getattr(fn, "__module__", "__main__") == "__main__":
        return "spawn"
    multiprocessing.set_forkserver_preload(RANK_PRELOAD)
    return "forkserver"


def launch(fn: Callable[..., Any], nprocs: int | None = None, *args: Any, device: str = "cpu") -> list[Any]:
    """Run ``fn(world, *args)`` on ``nprocs`` local ranks; returns each rank's result, by rank.

    ``fn`` must be importable (a module-level function) and its result
    picklable. CPU: ``nprocs`` processes over gloo, forked from a server that
    imported torch and Triton once (:data:`RANK_PRELOAD`; a ``fn`` of the
    script's ``__main__`` spawns them); each rank takes the launcher's
    environment, stdout and stderr as they are at the call. CUDA: ``nprocs``
    spawned processes, by default the number of visible GPUs. A rank that raises makes ``launch`` raise
    RuntimeError with the error of the rank that failed first (its traceback),
    then one line for each rank that failed after it (most often the peers that
    lost it).
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
    with tempfile.TemporaryDirectory(prefix="megamoe-launch-") as result_dir:
        with _interpreter_for_ranks(device):
            method = _start_method(device, fn)
            sys.stdout.flush()  # the ranks write to the same files
            sys.stderr.flush()
            context = mp.start_processes(
                _rank_main, args=(nprocs, device, result_dir, pickle.dumps((fn, args)), dict(os.environ),
                                  _LaunchersStdio() if method == "forkserver" else None),
                nprocs=nprocs, join=False, start_method=method)
        died = None
        try:
            while not context.join():
                pass
        except mp.ProcessRaisedException:
            pass  # each failing rank wrote its error: reported below
        except mp.ProcessExitedException as exc:
            died = exc  # a rank that wrote its error may still die in teardown: its record comes first
        records = {}
        for rank in range(nprocs):
            path = os.path.join(result_dir, f"rank{rank}.pt")
            if os.path.exists(path):
                records[rank] = torch.load(path, weights_only=False)
        failed = sorted((record["time"], rank) for rank, record in records.items() if not record["ok"])
        if failed:
            first = failed[0][1]
            later = "".join(f"\nthen rank {r}: {records[r]['error'].splitlines()[0][:300]}" for _, r in failed[1:])
            raise RuntimeError(f"rank {first} failed first: {records[first]['error']}{later}\n"
                               f"{records[first]['trace']}")
        if died is not None:
            raise RuntimeError(f"a rank died without reporting: {died}")
        missing = [rank for rank in range(nprocs) if rank not in records]
        if missing:
            raise RuntimeError(f"ranks {missing} exited without a result")
        results = [records[rank]["result"] for rank in range(nprocs)]
        return results


