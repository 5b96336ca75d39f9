"""The layer's NVLink communication: its workspace and the standalone pull / push launches.

DESIGN.md §2, §3, §7. One :class:`CommWorkspace` per (group, shapes) holds the
symmetric buffers every rank exposes to its peers; the launches move rows
between them with the Triton kernels of :mod:`megamoe.kernels.comm`:

    dispatch_pull         routed[t]  = x_{src_rank[t]}[src_index[t] // k]            (forward, pull)
    combine_push          combine_{src_rank[t]}[src_index[t]] = y[t]                  (forward, push)
    reverse_combine_pull  routed[t]  = w_{src_rank[t]}[src_index[t]] * d_out_{src_rank[t]}[src_index[t] // k]
    reverse_dispatch_push d_x_{src_rank[t]}[src_index[t]] = dx[t]                     (backward, push)
    push_dispatch         the push twin of dispatch_pull (the signalling experiment)
    device_barrier        an in-kernel barrier across ranks (flags, bounded wait)

``t`` runs over the rows of a :class:`~megamoe.schedule.PullSchedule`; rows with
``src_rank == -1`` (alignment padding, rows past ``num_rows``) are skipped.
Slot ``i*k + j`` of a ``[N*k, D]`` slot buffer is route j of token i.

Synchronisation (§3): a pull needs the peers' sources written before it
starts, a push must land before the home rank reads its slots. With
``sync=True`` (the default) each launch is bracketed by a device synchronise
and ``world.barrier()`` on both sides; pass ``sync=False`` to order launches
yourself (``device_barrier`` or ``world.barrier``). ``push_dispatch(signal=True)``
synchronises inside the kernel instead: a completion flag per peer, waited for
with a bounded budget.

Every in-kernel wait is bounded: a peer that never writes its flag makes the
launch raise RuntimeError naming the flag and the peer (after ``check``), and
the workspace refuses further use (its flags are out of step; free it).

Each entry point has a pure-PyTorch twin (``*_reference``): plain indexing over
the per-rank tensors, the oracle of the tests.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from megamoe import formats
from megamoe.formats import FORMATS
from megamoe.config import HIDDEN_MULTIPLE, MoEConfig
from megamoe.schedule import PullSchedule, build_pull_schedule
from megamoe.world import EPWorld, BufferSpec, SymmetricWorkspace

#: Row formats a workspace can hold x in: bf16, or E4M3 + scales (pulled as they are).
ROW_FORMATS = ("bf16", *FORMATS)

#: Waits and their flag rows in the ``flags`` buffer (index = wait id - 1).
WAITS = {1: "dispatch_ready", 2: "barrier"}
_WAIT_DISPATCH, _WAIT_BARRIER = 1, 2

#: Default poll budgets of an in-kernel wait. A poll is one acquire load of a
#: local flag: about a microsecond compiled (2**24 polls: seconds), far slower
#: under the interpreter, where a peer process may also take seconds to arrive.
DEFAULT_WAIT_BUDGET = 1 << 24
DEFAULT_WAIT_BUDGET_INTERPRETED = 1 << 20

_NO_LIMIT = 2**31 - 1  # rows of a launch: int32 loop counters


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(t: object) -> str:
    return f"shape {tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__


# --------------------------------------------------------------------------- shapes and tuning


@dataclass(frozen=True)
class CommShape:
    """What sizes a communication workspace (every rank builds the same one).

    Attributes:
        num_ranks: R.
        max_tokens: N, the largest token count of any rank (ranks may hold fewer).
        hidden: D, a multiple of 64.
        top_k: k.
        experts_per_rank: L (sizes the push-dispatch ``routed`` buffer only).
        align: the schedule's region alignment (same).
        row_format: how x is pulled: ``bf16``, or pre-quantised ``mxfp8`` /
            ``fp8-block`` rows (E4M3 data + scales: half the NVLink bytes).
        push_dispatch: also allocate the push-dispatch experiment's buffers
            (a symmetric ``routed [capacity, D]`` and the push tables).
    """

    num_ranks: int
    max_tokens: int
    hidden: int
    top_k: int
    experts_per_rank: int = 1
    align: int = 1
    row_format: str = "bf16"
    push_dispatch: bool = False

    def __post_init__(self) -> None:
        for name in ("num_ranks", "hidden", "top_k", "experts_per_rank", "align"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"CommShape.{name} must be a positive int, got {value!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"CommShape.max_tokens must be a non-negative int, got {self.max_tokens!r}")
        if self.hidden % HIDDEN_MULTIPLE:
            raise ValueError(f"CommShape.hidden (D) must be a multiple of {HIDDEN_MULTIPLE}, got {self.hidden}")
        if self.row_format not in ROW_FORMATS:
            raise ValueError(f"CommShape.row_format must be one of {ROW_FORMATS}, got {self.row_format!r}")
        if self.row_format == "fp8-block" and self.hidden % formats.FP8_BLOCK:
            raise ValueError(f"row_format 'fp8-block' needs D a multiple of {formats.FP8_BLOCK}, got {self.hidden}")
        if not isinstance(self.push_dispatch, bool):
            raise ValueError(f"CommShape.push_dispatch must be a bool, got {self.push_dispatch!r}")

    @property
    def capacity(self) -> int:
        """Rows of a pull schedule over this shape: ``R*N*k + L*(align-1)``."""
        return self.num_ranks * self.max_tokens * self.top_k + self.experts_per_rank * (self.align - 1)

    def specs(self) -> tuple[BufferSpec, ...]:
        """The workspace's buffers (see :class:`CommWorkspace`)."""
        R, N, D, k = self.num_ranks, self.max_tokens, self.hidden, self.top_k
        bf16, i32 = torch.bfloat16, torch.int32
        specs = [
            BufferSpec("x", (N, D), bf16),
            BufferSpec("combine", (N * k, D), bf16),
            BufferSpec("d_out", (N, D), bf16),
            BufferSpec("d_x", (N * k, D), bf16),
            BufferSpec("routing", (R, N, k), i32),
            BufferSpec("router_weights", (N, k), torch.float32),
            BufferSpec("flags", (len(WAITS), R), i32),
            BufferSpec("counters", (1,), torch.int64),
            BufferSpec("error", (4,), i32),
        ]
        if self.row_format == "mxfp8":
            specs += [BufferSpec("x_q", (N, D), torch.uint8), BufferSpec("x_scale", (N, D // 32), torch.uint8)]
        elif self.row_format == "fp8-block":
            specs += [BufferSpec("x_q", (N, D), torch.uint8), BufferSpec("x_scale", (N, D // 128), torch.float32)]
        if self.push_dispatch:
            specs += [
                BufferSpec("routed", (self.capacity, D), bf16),
                BufferSpec("push_dst_rank", (N * k,), i32),
                BufferSpec("push_dst_row", (N * k,), i32),
            ]
        return tuple(specs)


def comm_shape(
    world: EPWorld,
    config: MoEConfig,
    tokens: int,
    *,
    max_tokens: int | None = None,
    align: int = 1,
    row_format: str = "bf16",
    push_dispatch: bool = False,
) -> CommShape:
    """The shape for ``config`` on ``world`` when this rank holds ``tokens`` tokens.

    ``max_tokens=None`` finds the group's largest token count with an
    all_reduce MAX (collective, one host sync); pass it to skip that.
    """
    if not _is_int(tokens) or tokens < 0:
        raise ValueError(f"tokens must be a non-negative int, got {tokens!r}")
    if max_tokens is None:
        max_tokens = world.largest(tokens)  # NOTE: host sync
    if not _is_int(max_tokens) or max_tokens < tokens:
        raise ValueError(f"max_tokens must be an int >= this rank's tokens ({tokens}), got {max_tokens!r}")
    return CommShape(
        num_ranks=world.size,
        max_tokens=max_tokens,
        hidden=config.hidden,
        top_k=config.top_k,
        experts_per_rank=config.experts_per_rank(world.size),
        align=align,
        row_format=row_format,
        push_dispatch=push_dispatch,
    )


@dataclass(frozen=True)
class CommTuning:
    """Tile shape of the communication kernels (see ``megamoe.kernels.comm``).

    Attributes:
        tile_rows: rows moved per tile (a 14 KB kimi-k2 row per warp at the
            default: 112 KB of loads in flight per program).
        num_warps: warps per program (ignored by the interpreter).

    With ``tile_rows == num_warps`` each warp holds one row, so a thread
    works out the row's source and destination once for all of its 16-byte
    vectors (fewer rows: warps share a row's chunks; more: each thread holds
    several rows, in more registers). The chunked tiles before (64 x 1024
    elements, 16 warps) redid that arithmetic for every vector: 2-3.6x
    slower per program (benchmarks/results/2026-11-30-row-tiles).
    """

    tile_rows: int = 8
    num_warps: int = 8

    def __post_init__(self) -> None:
        for name, lo, hi in (("tile_rows", 1, 64), ("num_warps", 1, 32)):
            value = getattr(self, name)
            if not _is_int(value) or not lo <= value <= hi or value & (value - 1):
                raise ValueError(f"CommTuning.{name} must be a power of two in [{lo}, {hi}], got {value!r}")

    def label(self) -> str:
        """A short name: ``8r 8w``."""
        return f"{self.tile_rows}r {self.num_warps}w"


@dataclass(frozen=True)
class QuantRows:
    """Quantised rows: ``data`` float8_e4m3fn `[rows, D]`, ``scale`` uint8 E8M0 `[rows, D/32]`
    (mxfp8) or float32 `[rows, D/128]` (fp8-block), as ``megamoe.formats`` defines them."""

    data: torch.Tensor
    scale: torch.Tensor
    format: str


@dataclass(frozen=True)
class PushSchedule:
    """The push twin of a pull schedule, held by the rank that owns the tokens.

    Entry ``e`` sends this rank's route ``route[e] = i*k + j`` (token row
    ``route[e] // k`` of ``x``) to row ``dst_row[e]`` of rank ``dst_rank[e]``'s
    ``routed`` buffer, where that rank's pull schedule has ``(src_rank,
    src_index) = (this rank, route[e])``. Entries are sorted by ``(dst_row,
    dst_rank)``, so the entries feeding rows ``< M`` of every receiver are a
    prefix (:meth:`below`). Padding entries are -1 in all three.

    Attributes:
        route, dst_rank, dst_row: int32 `[N*k]`.
        num_entries: 0-d int32 on device, entries in use.
        top_k: k.
    """

    route: torch.Tensor
    dst_rank: torch.Tensor
    dst_row: torch.Tensor
    num_entries: torch.Tensor
    top_k: int

    def below(self, rows: int) -> PushSchedule:
        """The entries that fill rows ``< rows`` of every receiver (a prefix; no host sync)."""
        if not _is_int(rows) or rows < 0:
            raise ValueError(f"rows must be a non-negative int, got {rows!r}")
        count = ((self.dst_row >= 0) & (self.dst_row < rows)).sum().to(torch.int32)
        return replace(self, num_entries=count)


# --------------------------------------------------------------------------- the workspace


class CommWorkspace:
    """The layer's symmetric buffers on one rank (every rank of the group holds the same).

    Buffers (N = ``shape.max_tokens``; rows past a rank's own token count are unused):

    ================ ====================== =========================================
    x                bf16 `[N, D]`          this rank's tokens, pulled by dispatch
    x_q, x_scale     uint8 `[N, D]`, scales  pre-quantised x (row_format mxfp8 / fp8-block)
    combine          bf16 `[N*k, D]`        slot ``i*k + j``: expert output of route j of token i
    d_out            bf16 `[N, D]`          upstream gradient, pulled by reverse-combine
    d_x              bf16 `[N*k, D]`        slot ``i*k + j``: d_x of route j of token i
    routing          int32 `[R, N, k]`      every rank's expert ids (-1 = no route)
    router_weights   fp32 `[N, k]`          this rank's router weights; reverse-combine reads
                                            the peer's weight at the route's slot, no gather
    flags            int32 `[2, R]`         ``flags[w, r]``: last epoch rank r signalled for wait w
    counters         int64 `[1]`            arrivals of push-dispatch programs (running total)
    error            int32 `[4]`            ``[wait id, rank, wanted epoch, seen]`` of a timed-out wait
    routed           bf16 `[capacity, D]`   push-dispatch target (``shape.push_dispatch``)
    push_dst_rank/row int32 `[N*k]`         push-dispatch tables (``build_push_schedule``)
    ================ ====================== =========================================

    Get one with :func:`comm_workspace` (cached per group and shape) and
    release it with :meth:`free` (collective). Flags carry epochs that only
    grow, so buffers are reused across calls without resets; every rank must
    make the same sequence of signalling calls.
    """

    def __init__(self, world: EPWorld, shape: CommShape):
        if shape.num_ranks != world.size:
            raise ValueError(f"CommShape.num_ranks is {shape.num_ranks} but the world has {world.size} ranks")
        self.world = world
        self.shape = shape
        self.sym = SymmetricWorkspace(world, shape.specs())
        self._ptrs: dict[str, torch.Tensor] = {}
        self._epochs = {wait: 0 for wait in WAITS}
        self._arrivals = 0
        # the copy kernels' tile claims: [next tile, programs out]; zero between launches (the last
        # program out of each launch zeroes it), so one workspace's copies run one at a time (one stream)
        self.claims = torch.zeros(2, dtype=torch.int32, device=world.device)
        self._broken: str | None = None

    # ---- buffers

    def local(self, name: str) -> torch.Tensor:
        """This rank's buffer ``name``."""
        return self.sym.local(name)

    def peer(self, name: str, rank: int) -> torch.Tensor:
        """Rank ``rank``'s buffer ``name``, addressable from here."""
        return self.sym.peer(name, rank)

    def peer_ptrs(self, name: str) -> torch.Tensor:
        """int64 `[R]` device table of buffer ``name``'s address on every rank (cached)."""
        ptrs = self._ptrs.get(name)
        if ptrs is None:
            ptrs = self._ptrs[name] = self.sym.peer_ptrs(name)
        return ptrs

    def _flag_ptrs(self, wait: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(peer table of flag row ``wait``, this rank's flag row)."""
        key = f"flags/{wait}"
        if key not in self._ptrs:
            self._ptrs[key] = self.sym.peer_ptrs("flags") + (wait - 1) * self.shape.num_ranks * 4
        return self._ptrs[key], self.local("flags")[wait - 1]

    # ---- inputs

    def stage(
        self,
        *,
        x: torch.Tensor | None = None,
        router_weights: torch.Tensor | None = None,
        d_out: torch.Tensor | None = None,
    ) -> None:
        """Copy this rank's ``x`` / ``d_out`` (bf16 `[n, D]`, n <= N) and ``router_weights`` (fp32 `[n, k]`)
        into its buffers; with a quantised row format x is also quantised into ``x_q``/``x_scale``.
        Local only: peers see the rows after the next barrier (a launch with ``sync=True``)."""
        self._check_usable()
        N, D, k = self.shape.max_tokens, self.shape.hidden, self.shape.top_k
        for name, t in (("x", x), ("d_out", d_out)):
            if t is None:
                continue
            _check_rows(t, name, D, self.world.device, max_rows=N)
            self.local(name)[: t.shape[0]].copy_(t)
            if name == "x" and self.shape.row_format != "bf16":
                data, scale = _quantize_reference(t, self.shape.row_format)
                self.local("x_q")[: t.shape[0]].copy_(data.view(torch.uint8))
                self.local("x_scale")[: t.shape[0]].copy_(scale)
        if router_weights is not None:
            w = router_weights
            if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != k or w.shape[0] > N:
                raise ValueError(f"router_weights must be [n <= {N}, k={k}], got {_describe(w)}")
            if w.dtype != torch.float32 or w.device != self.world.device:
                raise ValueError(f"router_weights must be float32 on {self.world.device}, got {_describe(w)}")
            self.local("router_weights")[: w.shape[0]].copy_(w)

    def gather_routing(self, top_experts: torch.Tensor) -> torch.Tensor:
        """All-gather the routing ids through the workspace (collective; syncs the device).

        Writes this rank's int `[n, k]` ids, -1 padded to N, into row ``rank``
        of every rank's ``routing`` buffer, then barriers. Returns the local
        int32 `[R, N, k]` buffer (valid until the next call).
        """
        self._check_usable()
        N, k, me = self.shape.max_tokens, self.shape.top_k, self.world.rank
        t = top_experts
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != k or t.shape[0] > N:
            raise ValueError(f"top_experts must be [n <= {N}, k={k}], got {_describe(t)}")
        if t.dtype not in (torch.int32, torch.int64) or t.device != self.world.device:
            raise ValueError(f"top_experts must be int32/int64 on {self.world.device}, got {_describe(t)}")
        padded = torch.full((N, k), -1, dtype=torch.int32, device=self.world.device)
        padded[: t.shape[0]] = t
        _sync(self)  # nobody still reads the previous ids
        for r in range(self.world.size):
            self.peer("routing", r)[me].copy_(padded)
        _sync(self)
        return self.local("routing")

    def pull_schedule(self, top_experts: torch.Tensor, *, align: int | None = None) -> PullSchedule:
        """``gather_routing`` + ``build_pull_schedule`` for this rank (collective)."""
        routing = self.gather_routing(top_experts)
        align = self.shape.align if align is None else align
        return build_pull_schedule(routing, self.world.rank, self.shape.experts_per_rank, align=align)

    # ---- errors and lifetime

    def check_errors(self) -> None:
        """Raise RuntimeError if an in-kernel wait timed out since the last check (syncs the host)."""
        if self._broken is not None:
            raise RuntimeError(self._broken)
        code, peer, target, seen = self.local("error").tolist()
        if code:
            what = WAITS.get(code, f"wait #{code}")
            self._broken = (
                f"rank {self.world.rank}: timed out waiting for flag {what!r} of rank {peer} "
                f"(wanted epoch >= {target}, saw {seen}); the workspace's flags are out of step now, free it"
            )
            raise RuntimeError(self._broken)

    def _check_usable(self) -> None:
        if self.sym._bases is None:  # SymmetricWorkspace.free() drops its mappings
            raise RuntimeError("this communication workspace has been freed")
        if self._broken is not None:
            raise RuntimeError(f"workspace unusable after an earlier timeout: {self._broken}")

    def free(self) -> None:
        """Release the buffers (collective) and drop the workspace from the cache."""
        for key, ws in list(_WORKSPACES.items()):
            if ws is self:
                del _WORKSPACES[key]
        self._ptrs.clear()
        self.sym.free()


_WORKSPACES: dict[tuple, CommWorkspace] = {}


def comm_workspace(world: EPWorld, shape: CommShape) -> CommWorkspace:
    """The cached workspace for (group, device, shape), allocated on first use (collective)."""
    key = (id(world.group), world.device, shape)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.sym._bases is None:
        ws = _WORKSPACES[key] = CommWorkspace(world, shape)
    return ws


def free_comm_workspaces() -> None:
    """Free every cached communication workspace of this process (collective)."""
    for ws in list(_WORKSPACES.values()):
        ws.free()


# --------------------------------------------------------------------------- launches


def dispatch_pull(
    ws: CommWorkspace,
    schedule: PullSchedule,
    *,
    num_sms: int,
    out: torch.Tensor | QuantRows | None = None,
    quantize: str | None = None,
    rows: int | None = None,
    sync: bool = True,
    tuning: CommTuning | None = None,
) -> torch.Tensor | QuantRows:
    """Forward dispatch, pull: ``routed[t] = x_{src_rank[t]}[src_index[t] // k]``.

    Args:
        ws: the workspace; every rank's ``x`` is staged (``ws.stage``).
        schedule: this rank's pull schedule over ``ws`` (``ws.pull_schedule``).
        num_sms: programs of the persistent grid (>= 1); they never wait for
            each other, so any count is safe (more than the GPU's SMs only queues).
        out: bf16 `[capacity, D]`, or :class:`QuantRows` when quantised;
            None allocates zeros. Padding rows (``src_rank == -1``) are never
            written: they stay zero in a fresh buffer, untouched in ``out``.
        quantize: None, ``mxfp8`` or ``fp8-block``: quantise pulled bf16 rows
            on the fly (1x32 / 1x128 blocks along D). With a quantised
            ``row_format`` the stored E4M3 rows and scales are pulled instead
            (half the bytes) and the result is :class:`QuantRows` either way.
        rows: pull only rows ``t < rows`` (a first minibatch); None: all.
        sync: barrier (device sync + ``world.barrier``) before and after.

    Returns ``out`` (a tensor, or QuantRows). Syncs the host only with ``sync``.
    """
    _check_launch(ws, schedule, num_sms)
    fmt = ws.shape.row_format
    if quantize is not None and quantize not in FORMATS:  # on-the-fly quantisation of pulled bf16 rows
        raise ValueError(f"quantize must be None or one of {FORMATS}, got {quantize!r}")
    if fmt != "bf16" and quantize not in (None, fmt):
        raise ValueError(f"the workspace holds {fmt} rows; quantize must be None or {fmt!r}, got {quantize!r}")
    quant = quantize if fmt == "bf16" else fmt
    limit = _row_limit(rows)
    out = _routed_out(ws, schedule, out, quant)
    tuning = tuning or CommTuning()
    if sync:
        _sync(ws)
    if fmt == "bf16":
        data, qscale = (out, None) if quant is None else (out.data.view(torch.uint8), out.scale)
        _launch_pull(ws, schedule, "x", data, num_sms, limit, tuning, quant=quant, qscale=qscale)
    else:
        _launch_pull(ws, schedule, "x_q", out.data.view(torch.uint8), num_sms, limit, tuning)
        _launch_pull(ws, schedule, "x_scale", out.scale, num_sms, limit, tuning)
    if sync:
        _sync(ws)
    return out


def reverse_combine_pull(
    ws: CommWorkspace,
    schedule: PullSchedule,
    *,
    num_sms: int,
    out: torch.Tensor | QuantRows | None = None,
    quantize: str | None = None,
    rows: int | None = None,
    sync: bool = True,
    tuning: CommTuning | None = None,
) -> torch.Tensor | QuantRows:
    """Backward reverse-combine, pull: ``routed[t] = bf16(w * d_out_r[i])`` for ``(r, i*k + j) = Phi[t]``.

    ``w = router_weights_r[i, j]`` is read from rank r's ``router_weights``
    buffer (fp32 product, rounded to nearest even bf16). Arguments as
    :func:`dispatch_pull` (``quantize`` quantises the scaled rows).
    """
    _check_launch(ws, schedule, num_sms)
    if quantize is not None and quantize not in FORMATS:  # on-the-fly quantisation of pulled bf16 rows
        raise ValueError(f"quantize must be None or one of {FORMATS}, got {quantize!r}")
    limit = _row_limit(rows)
    out = _routed_out(ws, schedule, out, quantize)
    tuning = tuning or CommTuning()
    if sync:
        _sync(ws)
    data, qscale = (out, None) if quantize is None else (out.data.view(torch.uint8), out.scale)
    _launch_pull(ws, schedule, "d_out", data, num_sms, limit, tuning, quant=quantize, qscale=qscale, scale=True)
    if sync:
        _sync(ws)
    return out


def combine_push(
    ws: CommWorkspace,
    schedule: PullSchedule,
    y_rows: torch.Tensor,
    *,
    num_sms: int,
    sync: bool = True,
    tuning: CommTuning | None = None,
) -> torch.Tensor:
    """Forward combine, push: ``combine_{src_rank[t]}[src_index[t]] = y_rows[t]``.

    ``y_rows`` is bf16 `[capacity, D]` in this rank's schedule order (expert
    outputs). Slots no route fills keep their contents. Returns this rank's
    ``combine`` slots `[N*k, D]`, complete once every rank's push is done
    (after the closing barrier with ``sync``).
    """
    _push_rows(ws, schedule, y_rows, "combine", num_sms, sync, tuning)
    return ws.local("combine")


def reverse_dispatch_push(
    ws: CommWorkspace,
    schedule: PullSchedule,
    dx_rows: torch.Tensor,
    *,
    num_sms: int,
    sync: bool = True,
    tuning: CommTuning | None = None,
) -> torch.Tensor:
    """Backward reverse-dispatch, push: ``d_x_{src_rank[t]}[src_index[t]] = dx_rows[t]``.

    As :func:`combine_push`, into the ``d_x`` slots; the home rank sums a
    token's k slots in fixed order. Returns this rank's ``d_x`` slots.
    """
    _push_rows(ws, schedule, dx_rows, "d_x", num_sms, sync, tuning)
    return ws.local("d_x")


def build_push_schedule(ws: CommWorkspace, schedule: PullSchedule) -> PushSchedule:
    """Every rank tells each source rank where its routes land (collective; syncs the host).

    Needs ``shape.push_dispatch``. For each of its rows t the receiver writes
    ``t`` and its rank into the source rank's ``push_dst_row`` /
    ``push_dst_rank`` at the route's slot ``src_index[t]``.
    """
    _check_launch(ws, schedule, 1)
    _need_push(ws)
    if schedule.capacity > ws.shape.capacity:
        raise ValueError(
            f"schedule capacity {schedule.capacity} exceeds the routed buffer's {ws.shape.capacity} "
            f"(build it with align <= CommShape.align = {ws.shape.align})"
        )
    me, R, k = ws.world.rank, ws.world.size, ws.shape.top_k
    _sync(ws)
    ws.local("push_dst_rank").fill_(-1)
    ws.local("push_dst_row").fill_(-1)
    _sync(ws)
    valid = schedule.src_rank >= 0
    rows = torch.arange(schedule.capacity, dtype=torch.int32, device=ws.world.device)[valid]
    src_rank, src_index = schedule.src_rank[valid], schedule.src_index[valid].long()
    for r in range(R):
        mine = src_rank == r
        ws.peer("push_dst_row", r)[src_index[mine]] = rows[mine]
        ws.peer("push_dst_rank", r)[src_index[mine]] = me
    _sync(ws)
    dst_rank, dst_row = ws.local("push_dst_rank").clone(), ws.local("push_dst_row").clone()
    used = dst_row >= 0
    key = torch.where(used, dst_row.long() * R + dst_rank.long(), torch.iinfo(torch.int64).max)
    order = torch.sort(key, stable=True).indices
    route = torch.where(used[order], order, -1).to(torch.int32)
    return PushSchedule(
        route=route,
        dst_rank=dst_rank[order],
        dst_row=dst_row[order],
        num_entries=used.sum().to(torch.int32),
        top_k=k,
    )


def push_dispatch(
    ws: CommWorkspace,
    push_schedule: PushSchedule,
    *,
    num_sms: int,
    signal: bool = False,
    sync: bool = True,
    wait_budget: int | None = None,
    check: bool = True,
    tuning: CommTuning | None = None,
) -> torch.Tensor:
    """Forward dispatch, push (the experiment's twin of :func:`dispatch_pull`).

    Stores this rank's bf16 x rows into the receivers' symmetric ``routed``
    buffers: ``routed_{dst_rank[e]}[dst_row[e]] = x[route[e] // k]``. Use
    ``push_schedule.below(M)`` to send the first minibatch only.

    With ``signal`` the kernel also makes the data usable by itself: the last
    program of each rank writes a release flag into every rank
    (``dispatch_ready``) and waits, at most ``wait_budget`` polls, for the flag
    of every rank; then this rank's ``routed`` is complete. ``check`` reads
    the error word afterwards (a host sync) and raises RuntimeError naming the
    late peer; with ``check=False`` call ``ws.check_errors()`` later. Every
    rank must make the same sequence of signalling calls. The receiver's
    ``routed`` must be free before anyone pushes (``sync`` or a barrier).

    Returns this rank's ``routed`` `[capacity, D]`.
    """
    _check_num_sms(num_sms)
    ws._check_usable()
    _need_push(ws)
    if not isinstance(push_schedule, PushSchedule):
        raise ValueError(f"push_schedule must be a PushSchedule, got {type(push_schedule).__name__}")
    nk = ws.shape.max_tokens * ws.shape.top_k
    for name in ("route", "dst_rank", "dst_row"):
        t = getattr(push_schedule, name)
        if t.shape != (nk,) or t.dtype != torch.int32 or t.device != ws.world.device:
            raise ValueError(f"PushSchedule.{name} must be int32 [{nk}] on {ws.world.device}, got {_describe(t)}")
    budget = _wait_budget(wait_budget)
    tuning = tuning or CommTuning()
    x, routed = ws.local("x"), ws.local("routed")
    chunks, cp, w, rows_per_tile, align = _tile(ws.shape.hidden, x.element_size(), tuning)
    flag_ptrs, flags = ws._flag_ptrs(_WAIT_DISPATCH)
    epoch = arrive_target = 0
    if signal:
        ws._epochs[_WAIT_DISPATCH] += 1
        epoch = ws._epochs[_WAIT_DISPATCH]
        ws._arrivals += num_sms
        arrive_target = ws._arrivals
    if sync:
        _sync(ws)
    from megamoe.kernels.comm import _push_kernel

    _push_kernel[(num_sms,)](
        push_schedule.num_entries, _NO_LIMIT, ws.claims, x, x.stride(0), push_schedule.route,
        push_schedule.dst_rank, push_schedule.dst_row, ws.peer_ptrs("routed"), routed, routed.stride(0),
        flag_ptrs, flags, ws.local("counters"), arrive_target, epoch, ws.world.rank, ws.world.size, budget,
        ws.local("error"),
        SRC_ROW_DIV=ws.shape.top_k, IDENTITY_SRC=False, CHUNKS=chunks, CP=cp, W=w, ROWS=rows_per_tile, ALIGN=align,
        SIGNAL=signal, WAIT_ID=_WAIT_DISPATCH, num_warps=tuning.num_warps,
    )
    if signal and check:
        _device_sync(ws)
        ws.check_errors()
    if sync:
        _sync(ws)
    return routed


def device_barrier(ws: CommWorkspace, *, wait_budget: int | None = None, check: bool = True) -> None:
    """A barrier across ranks inside a kernel (one program): no host sync unless ``check``.

    Each rank writes a new epoch into flag ``barrier`` of every rank and waits,
    at most ``wait_budget`` polls, for every rank's. Work queued after it on
    this rank's stream starts once every rank reached it. Every rank calls it
    the same number of times.
    """
    ws._check_usable()
    budget = _wait_budget(wait_budget)
    ws._epochs[_WAIT_BARRIER] += 1
    flag_ptrs, flags = ws._flag_ptrs(_WAIT_BARRIER)
    from megamoe.kernels.comm import _barrier_kernel

    _barrier_kernel[(1,)](
        flag_ptrs, flags, ws.world.rank, ws.world.size, ws._epochs[_WAIT_BARRIER], budget, ws.local("error"),
        WAIT_ID=_WAIT_BARRIER, num_warps=1,
    )
    if check:
        _device_sync(ws)
        ws.check_errors()


# --------------------------------------------------------------------------- launch helpers


def _launch_pull(
    ws: CommWorkspace,
    schedule: PullSchedule,
    src_name: str,
    dst: torch.Tensor,
    num_sms: int,
    limit: int,
    tuning: CommTuning,
    *,
    quant: str | None = None,
    qscale: torch.Tensor | None = None,
    scale: bool = False,
) -> None:
    from megamoe.kernels import quant as quant_kernels
    from megamoe.kernels.comm import _pull_kernel

    src = ws.local(src_name)
    width = src.shape[1]
    min_block = formats.FP8_BLOCK if quant == "fp8-block" else formats.MX_BLOCK if quant else 1
    chunks, cp, w, rows, align = _tile(width, src.element_size(), tuning, min_block=min_block)
    if quant:  # one row per tile, its chunks spread over the warps: a thread holding a whole row in fp32 spills
        rows = 1
    w_ptrs, w_anchor = (ws.peer_ptrs("router_weights"), ws.local("router_weights")) if scale else (
        ws.peer_ptrs(src_name), src)
    qscale = dst if qscale is None else qscale
    _pull_kernel[(num_sms,)](
        schedule.num_rows, limit, ws.claims, ws.peer_ptrs(src_name), src, src.stride(0), schedule.src_rank,
        schedule.src_index, dst, dst.stride(0), w_ptrs, w_anchor, qscale, qscale.stride(0),
        TOP_K=ws.shape.top_k, CHUNKS=chunks, CP=cp, W=w, ROWS=rows, ALIGN=align, SCALE=scale,
        QUANT={None: 0, "mxfp8": 1, "fp8-block": 2}[quant], SOFT_E4M3=quant_kernels.soft_e4m3_default(),
        num_warps=tuning.num_warps,
    )


def _push_rows(
    ws: CommWorkspace,
    schedule: PullSchedule,
    rows: torch.Tensor,
    dst_name: str,
    num_sms: int,
    sync: bool,
    tuning: CommTuning | None,
) -> None:
    from megamoe.kernels.comm import _push_kernel

    _check_launch(ws, schedule, num_sms)
    _check_rows(rows, "y_rows" if dst_name == "combine" else "dx_rows", ws.shape.hidden, ws.world.device,
                exact_rows=schedule.capacity)
    tuning = tuning or CommTuning()
    dst = ws.local(dst_name)
    chunks, cp, w, rows_per_tile, align = _tile(ws.shape.hidden, dst.element_size(), tuning)
    if sync:
        _sync(ws)
    flag_ptrs, flags = ws._flag_ptrs(_WAIT_DISPATCH)  # unused without SIGNAL
    _push_kernel[(num_sms,)](
        schedule.num_rows, _NO_LIMIT, ws.claims, rows, rows.stride(0), schedule.src_index,
        schedule.src_rank, schedule.src_index, ws.peer_ptrs(dst_name), dst, dst.stride(0),
        flag_ptrs, flags, ws.local("counters"), 0, 0, ws.world.rank, ws.world.size, 0, ws.local("error"),
        SRC_ROW_DIV=1, IDENTITY_SRC=True, CHUNKS=chunks, CP=cp, W=w, ROWS=rows_per_tile, ALIGN=align,
        SIGNAL=False, WAIT_ID=0, num_warps=tuning.num_warps,
    )
    if sync:
        _sync(ws)


def _tile(width: int, esize: int, tuning: CommTuning, *, min_block: int = 1) -> tuple[int, int, int, int, int]:
    """(CHUNKS, CP, W, ROWS, ALIGN) of the row tiles of rows of ``width`` elements of ``esize`` bytes.

    W: a warp's 16-byte vectors (512 bytes) or, for narrower rows, the largest
    power of two dividing the width; a row is CHUNKS = width / W pieces of W,
    CP the next power of two. ROWS grows as W shrinks below 512 bytes, so a
    tile of narrow rows (fp8 scales) keeps about as many vectors in flight.
    ALIGN: the element alignment every row start shares (16 bytes when the row allows).
    """
    wide = 512 // esize
    w = min(width & -width, wide)
    if w < min_block:
        raise ValueError(f"rows of {width} elements cannot be split into blocks of {min_block}")
    chunks = width // w
    rows = min(256, tuning.tile_rows * (wide // w))
    align = math.gcd(width, w, max(1, 16 // esize))
    return chunks, 1 << (chunks - 1).bit_length(), w, rows, align


def _routed_out(
    ws: CommWorkspace, schedule: PullSchedule, out: object, quant: str | None
) -> torch.Tensor | QuantRows:
    cap, D, device = schedule.capacity, ws.shape.hidden, ws.world.device
    if quant is None:
        if out is None:
            return torch.zeros(cap, D, dtype=torch.bfloat16, device=device)
        _check_rows(out, "out", D, device, exact_rows=cap)
        return out
    sblock = formats.MX_BLOCK if quant == "mxfp8" else formats.FP8_BLOCK
    sdtype = torch.uint8 if quant == "mxfp8" else torch.float32
    if quant == "fp8-block" and D % formats.FP8_BLOCK:
        raise ValueError(f"quantize 'fp8-block' needs D a multiple of {formats.FP8_BLOCK}, got {D}")
    if out is None:
        return QuantRows(
            data=torch.zeros(cap, D, dtype=torch.float8_e4m3fn, device=device),
            scale=torch.zeros(cap, D // sblock, dtype=sdtype, device=device),
            format=quant,
        )
    if not isinstance(out, QuantRows) or out.format != quant:
        raise ValueError(f"out must be QuantRows of format {quant!r}, got {type(out).__name__}")
    for name, t, width, dtype in (("data", out.data, D, torch.float8_e4m3fn), ("scale", out.scale, D // sblock, sdtype)):
        if not isinstance(t, torch.Tensor) or t.shape != (cap, width) or t.dtype != dtype or t.device != device:
            raise ValueError(f"out.{name} must be {dtype} [{cap}, {width}] on {device}, got {_describe(t)}")
        if t.stride(1) != 1:
            raise ValueError(f"out.{name} rows must be contiguous, got strides {t.stride()}")
    return out


def _check_rows(
    t: object, name: str, d: int, device: torch.device, *, max_rows: int | None = None, exact_rows: int | None = None
) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != d:
        raise ValueError(f"{name} must be a 2-D tensor [rows, D={d}], got {_describe(t)}")
    if exact_rows is not None and t.shape[0] != exact_rows:
        raise ValueError(f"{name} must have {exact_rows} rows (the schedule's capacity), got {t.shape[0]}")
    if max_rows is not None and t.shape[0] > max_rows:
        raise ValueError(f"{name} has {t.shape[0]} rows, more than the workspace's N={max_rows}")
    if t.dtype != torch.bfloat16:
        raise ValueError(f"{name} must be bfloat16, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the workspace on {device}")
    if t.shape[0] and t.stride(1) != 1:
        raise ValueError(f"{name} rows must be contiguous, got strides {t.stride()}")


def _check_num_sms(num_sms: object) -> None:
    if not _is_int(num_sms) or num_sms < 1:
        raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")


def _check_launch(ws: CommWorkspace, schedule: PullSchedule, num_sms: int) -> None:
    if not isinstance(ws, CommWorkspace):
        raise ValueError(f"ws must be a CommWorkspace, got {type(ws).__name__}")
    ws._check_usable()
    _check_num_sms(num_sms)
    if not isinstance(schedule, PullSchedule):
        raise ValueError(f"schedule must be a PullSchedule, got {type(schedule).__name__}")
    shape = ws.shape
    if schedule.num_ranks != shape.num_ranks or schedule.top_k != shape.top_k:
        raise ValueError(
            f"schedule is for R={schedule.num_ranks}, k={schedule.top_k}; the workspace for "
            f"R={shape.num_ranks}, k={shape.top_k}"
        )
    if schedule.max_tokens > shape.max_tokens:
        raise ValueError(f"schedule sized for N={schedule.max_tokens} > the workspace's N={shape.max_tokens}")
    if schedule.src_rank.device != ws.world.device:
        raise ValueError(f"schedule is on {schedule.src_rank.device}, the workspace on {ws.world.device}")


def _need_push(ws: CommWorkspace) -> None:
    if not ws.shape.push_dispatch:
        raise ValueError("push dispatch needs a workspace built with CommShape(push_dispatch=True)")


def _row_limit(rows: object) -> int:
    if rows is None:
        return _NO_LIMIT
    if not _is_int(rows) or rows < 0:
        raise ValueError(f"rows must be None or a non-negative int, got {rows!r}")
    return min(rows, _NO_LIMIT)


def _wait_budget(budget: object) -> int:
    if budget is None:
        return DEFAULT_WAIT_BUDGET_INTERPRETED if _interpreting() else DEFAULT_WAIT_BUDGET
    if not _is_int(budget) or not 1 <= budget < 2**31:
        raise ValueError(f"wait_budget must be an int in [1, 2**31), got {budget!r}")
    return budget


def _device_sync(ws: CommWorkspace) -> None:
    if ws.world.is_cuda:
        torch.cuda.synchronize(ws.world.device)


def _sync(ws: CommWorkspace) -> None:
    """Host-side barrier: this rank's queued work done, then every rank here."""
    _device_sync(ws)
    ws.world.barrier()


def _quantize_reference(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt == "mxfp8":
        return formats.mxfp8_quantize(x, dim=-1)
    return formats.fp8_block_quantize(x, block=(1, formats.FP8_BLOCK))


# --------------------------------------------------------------------------- pure-PyTorch twins


def dispatch_reference(x_ranks: Sequence[torch.Tensor], schedule: PullSchedule, *, rows: int | None = None) -> torch.Tensor:
    """``routed[t] = x_ranks[src_rank[t]][src_index[t] // k]`` for rows t (< ``rows``); other rows 0."""
    k, cap = schedule.top_k, schedule.capacity
    device = x_ranks[0].device
    src_rank, src_index = schedule.src_rank.to(device).long(), schedule.src_index.to(device).long()
    if rows is not None:
        src_rank = torch.where(torch.arange(cap, device=device) < rows, src_rank, -1)
    out = torch.zeros(cap, x_ranks[0].shape[1], dtype=x_ranks[0].dtype, device=device)
    for r, x in enumerate(x_ranks):
        mine = src_rank == r
        out[mine] = x[src_index[mine] // k]
    return out


def reverse_combine_reference(
    d_out_ranks: Sequence[torch.Tensor], weights_ranks: Sequence[torch.Tensor], schedule: PullSchedule
) -> torch.Tensor:
    """``routed[t] = bf16(fp32(d_out_r[i]) * w_r[i, j])`` for ``(r, i*k + j) = Phi[t]``; padding rows 0."""
    k, cap = schedule.top_k, schedule.capacity
    device = d_out_ranks[0].device
    src_rank, src_index = schedule.src_rank.to(device).long(), schedule.src_index.to(device).long()
    out = torch.zeros(cap, d_out_ranks[0].shape[1], dtype=torch.bfloat16, device=device)
    for r, (d_out, w) in enumerate(zip(d_out_ranks, weights_ranks)):
        mine = src_rank == r
        idx = src_index[mine]
        out[mine] = (d_out[idx // k].float() * w.reshape(-1)[idx][:, None]).to(torch.bfloat16)
    return out


def combine_reference(
    rows_ranks: Sequence[torch.Tensor], schedules: Sequence[PullSchedule], rank: int, slots: torch.Tensor
) -> torch.Tensor:
    """Rank ``rank``'s slots after every rank q pushed ``rows_ranks[q][t]`` to ``slots[src_index[t]]``
    for its rows t with ``src_rank[t] == rank``; ``slots`` (`[N*k, D]`) gives the untouched slots."""
    out = slots.clone()
    for rows, sched in zip(rows_ranks, schedules):
        src_rank, src_index = sched.src_rank.to(out.device).long(), sched.src_index.to(out.device).long()
        mine = src_rank == rank
        out[src_index[mine]] = rows.to(out.device)[mine]
    return out


#: The backward push moves rows exactly as the forward combine does.
reverse_dispatch_reference = combine_reference
