"""The communication workspace: the symmetric buffers every rank exposes to its peers, and their shape."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe.checks import describe, is_int
from megamoe.config import HIDDEN_MULTIPLE, MoEConfig
from megamoe.parallel.symmetric import BufferSpec, SymmetricWorkspace
from megamoe.ops.quant import quantize_activations
from megamoe.parallel.world import EPWorld
from megamoe.precision import FORMATS, FP8_BLOCK
from megamoe.reference.formats import fp8_block_quantize, mxfp8_quantize
from megamoe.routing.schedule import PullSchedule, build_pull_schedule
from megamoe.routing.windows import ScheduleWindow

#: Row formats a workspace can hold x in: bf16, or E4M3 + scales (pulled as they are).
ROW_FORMATS = ("bf16", *FORMATS)

#: Waits and their flag rows in the ``flags`` buffer (index = wait id - 1).
WAITS = {1: "dispatch_ready", 2: "barrier"}
WAIT_DISPATCH, WAIT_BARRIER = 1, 2


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
        row_format: how x and d_out are pulled: ``bf16``, or pre-quantised ``mxfp8`` /
            ``fp8-block`` rows (E4M3 data + scales along D: half the NVLink bytes).
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
            if not is_int(value) or value < 1:
                raise ValueError(f"CommShape.{name} must be a positive int, got {value!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"CommShape.max_tokens must be a non-negative int, got {self.max_tokens!r}")
        if self.hidden % HIDDEN_MULTIPLE:
            raise ValueError(f"CommShape.hidden (D) must be a multiple of {HIDDEN_MULTIPLE}, got {self.hidden}")
        if self.row_format not in ROW_FORMATS:
            raise ValueError(f"CommShape.row_format must be one of {ROW_FORMATS}, got {self.row_format!r}")
        if self.row_format == "fp8-block" and self.hidden % FP8_BLOCK:
            raise ValueError(f"row_format 'fp8-block' needs D a multiple of {FP8_BLOCK}, got {self.hidden}")
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
            BufferSpec("routing", (R, N, k), i32),
            BufferSpec("router_weights", (N, k), torch.float32),
            BufferSpec("d_router", (N * k + 1,), torch.float32),
            BufferSpec("flags", (len(WAITS), R), i32),
            BufferSpec("pass_flags", (2, R), i32),
            BufferSpec("pass_epochs", (2,), i32),
            BufferSpec("counters", (1,), torch.int64),
            BufferSpec("error", (4,), i32),
        ]
        if self.row_format != "bf16":
            block, dtype = (32, torch.uint8) if self.row_format == "mxfp8" else (128, torch.float32)
            for name in ("x", "d_out"):
                specs += [BufferSpec(f"{name}_q", (N, D), torch.uint8), BufferSpec(f"{name}_scale", (N, D // block),
                                                                                   dtype)]
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
    if not is_int(tokens) or tokens < 0:
        raise ValueError(f"tokens must be a non-negative int, got {tokens!r}")
    if max_tokens is None:
        max_tokens = world.largest(tokens)  # NOTE: host sync
    if not is_int(max_tokens) or max_tokens < tokens:
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
class QuantRows:
    """Quantised rows: ``data`` float8_e4m3fn `[rows, D]`, ``scale`` uint8 E8M0 `[rows, D/32]`
    (mxfp8) or float32 `[rows, D/128]` (fp8-block), as ``megamoe.reference.formats`` defines them."""

    data: torch.Tensor
    scale: torch.Tensor
    format: str


class CommWorkspace:
    """The layer's symmetric buffers on one rank (every rank of the group holds the same).

    Buffers (N = ``shape.max_tokens``; rows past a rank's own token count are unused):

    ================ ====================== =========================================
    x                bf16 `[N, D]`          this rank's tokens, pulled by dispatch
    x_q, x_scale     uint8 `[N, D]`, scales  pre-quantised x (row_format mxfp8 / fp8-block)
    d_out_q, _scale  uint8 `[N, D]`, scales  pre-quantised d_out (the same)
    combine          bf16 `[N*k, D]`        slot ``i*k + j``: expert output of route j of token i (forward),
                                            its d_x (backward: reverse-dispatch pushes here too)
    d_out            bf16 `[N, D]`          upstream gradient, pulled by reverse-combine
    routing          int32 `[R, N, k]`      every rank's expert ids (-1 = no route)
    router_weights   fp32 `[N, k]`          this rank's router weights (the backward reads each route's)
    d_router         fp32 `[N*k + 1]`       slot ``i*k + j``: d(router weight) of route j of token i; the last
                                            slot takes the writes of rows that go elsewhere
    flags            int32 `[2, R]`         ``flags[w, r]``: last epoch rank r signalled for wait w
    pass_flags       int32 `[2, R]`         the megakernels' barriers across ranks (their epochs on the device:
    pass_epochs      int32 `[2]`            ``megamoe.kernels.sync``), apart from ``flags``' host-counted ones
    counters         int64 `[1]`            arrivals of push-dispatch programs (running total)
    error            int32 `[4]`            ``[wait id, rank, wanted epoch, seen]`` of a timed-out wait
    routed           bf16 `[capacity, D]`   push-dispatch target (``shape.push_dispatch``)
    push_dst_rank/row int32 `[N*k]`         push-dispatch tables (``build_push_schedule``)
    ================ ====================== =========================================

    Get one with :func:`comm_workspace` (kept on the world per shape: the layer's one workspace, which the
    megakernels and the standalone launches share) and release it with :meth:`free` (collective). Flags carry epochs that only
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

    def flag_ptrs(self, wait: int) -> tuple[torch.Tensor, torch.Tensor]:
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
        unquantized: tuple[str, ...] = (),
    ) -> None:
        """Copy this rank's ``x`` / ``d_out`` (bf16 `[n, D]`, n <= N) and ``router_weights`` (fp32 `[n, k]`)
        into its buffers; with a quantised row format each is also quantised into ``x_q``/``x_scale``
        (``d_out_q``/``d_out_scale``), once, at home, unless ``unquantized`` names it (nobody reads its E4M3 rows).
        Local only: peers see the rows after the next barrier (a launch with ``sync=True``)."""
        self.check_usable()
        N, D, k = self.shape.max_tokens, self.shape.hidden, self.shape.top_k
        for name, t in (("x", x), ("d_out", d_out)):
            if t is None:
                continue
            check_rows(t, name, D, self.world.device, max_rows=N)
            self.local(name)[: t.shape[0]].copy_(t)
            if self.shape.row_format != "bf16" and t.shape[0] and name not in unquantized:  # the forward's quantiser
                quantize_activations(t, self.shape.row_format,
                                     out=(self.local(f"{name}_q")[: t.shape[0]].view(torch.float8_e4m3fn),
                                          self.local(f"{name}_scale")[: t.shape[0]]))
        if router_weights is not None:
            w = router_weights
            if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != k or w.shape[0] > N:
                raise ValueError(f"router_weights must be [n <= {N}, k={k}], got {describe(w)}")
            if w.dtype != torch.float32 or w.device != self.world.device:
                raise ValueError(f"router_weights must be float32 on {self.world.device}, got {describe(w)}")
            self.local("router_weights")[: w.shape[0]].copy_(w)

    def gather_routing(self, top_experts: torch.Tensor) -> torch.Tensor:
        """All-gather the routing ids through the workspace (collective; syncs the device).

        Writes this rank's int `[n, k]` ids, -1 padded to N, into row ``rank``
        of every rank's ``routing`` buffer, then barriers. Returns the local
        int32 `[R, N, k]` buffer (valid until the next call).
        """
        self.check_usable()
        N, k, me = self.shape.max_tokens, self.shape.top_k, self.world.rank
        t = top_experts
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != k or t.shape[0] > N:
            raise ValueError(f"top_experts must be [n <= {N}, k={k}], got {describe(t)}")
        if t.dtype not in (torch.int32, torch.int64) or t.device != self.world.device:
            raise ValueError(f"top_experts must be int32/int64 on {self.world.device}, got {describe(t)}")
        padded = torch.full((N, k), -1, dtype=torch.int32, device=self.world.device)
        padded[: t.shape[0]] = t
        self.sync()  # nobody still reads the previous ids
        for r in range(self.world.size):
            self.peer("routing", r)[me].copy_(padded)
        self.sync()
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

    def check_usable(self) -> None:
        """RuntimeError once freed, or after a timed-out wait (its flags are out of step)."""
        if not self.sym.usable:
            raise RuntimeError("this communication workspace has been freed")
        if self._broken is not None:
            raise RuntimeError(f"workspace unusable after an earlier timeout: {self._broken}")

    def check_launch(self, schedule: PullSchedule | ScheduleWindow, num_sms: int) -> None:
        """ValueError unless ``schedule`` (a pull schedule, or one of the backward's windows of one) fits this
        workspace and ``num_sms`` is a positive int."""
        self.check_usable()
        check_num_sms(num_sms)
        if not isinstance(schedule, (PullSchedule, ScheduleWindow)):
            raise ValueError(f"schedule must be a PullSchedule or a ScheduleWindow, got {type(schedule).__name__}")
        shape = self.shape
        if schedule.num_ranks != shape.num_ranks or schedule.top_k != shape.top_k:
            raise ValueError(
                f"schedule is for R={schedule.num_ranks}, k={schedule.top_k}; the workspace for "
                f"R={shape.num_ranks}, k={shape.top_k}"
            )
        if schedule.max_tokens > shape.max_tokens:
            raise ValueError(f"schedule sized for N={schedule.max_tokens} > the workspace's N={shape.max_tokens}")
        if schedule.src_rank.device != self.world.device:
            raise ValueError(f"schedule is on {schedule.src_rank.device}, the workspace on {self.world.device}")

    def need_push(self) -> None:
        """ValueError unless the workspace holds the push-dispatch buffers."""
        if not self.shape.push_dispatch:
            raise ValueError("push dispatch needs a workspace built with CommShape(push_dispatch=True)")

    def device_sync(self) -> None:
        """This rank's queued work done (a no-op on the CPU)."""
        if self.world.is_cuda:
            torch.cuda.synchronize(self.world.device)

    def sync(self) -> None:
        """Host-side barrier: this rank's queued work done, then every rank here."""
        self.device_sync()
        self.world.barrier("a communication workspace's sync")

    @property
    def usable(self) -> bool:
        """False once freed."""
        return self.sym.usable

    def free(self) -> None:
        """Release the buffers (collective) and drop the workspace from its world."""
        self.world.resources.discard(self)
        self._ptrs.clear()
        self.sym.free()


def comm_workspace(world: EPWorld, shape: CommShape) -> CommWorkspace:
    """The workspace of ``shape`` kept on ``world`` (``world.resources``), allocated on first use
    (collective); ``ws.free()`` or ``world.close()`` releases it."""
    return world.resources.get(("comm", shape), lambda: CommWorkspace(world, shape))


def check_num_sms(num_sms: object) -> None:
    """ValueError unless ``num_sms`` (programs of a launch) is a positive int."""
    if not is_int(num_sms) or num_sms < 1:
        raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")


def check_rows(
    t: object, name: str, d: int, device: torch.device, *, max_rows: int | None = None, exact_rows: int | None = None
) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != d:
        raise ValueError(f"{name} must be a 2-D tensor [rows, D={d}], got {describe(t)}")
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


def quantize_rows_reference(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt == "mxfp8":
        return mxfp8_quantize(x, dim=-1)
    return fp8_block_quantize(x, block=(1, FP8_BLOCK))
