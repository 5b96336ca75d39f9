"""The megakernel's knobs (:class:`KernelConfig`), the layer shape they serve (:class:`LayerShape`), and the
one check that a config suits a shape, a precision and a device (:func:`check_kernel_config`): the planner,
the kernel and the tests all call it.
"""

from __future__ import annotations

from dataclasses import dataclass

from megamoe.config import HIDDEN_MULTIPLE, MoEConfig
from megamoe.precision import SCALE_BLOCK, check_precision
from megamoe.routing.windows import WINDOW_ALIGN


@dataclass(frozen=True)
class LayerShape:
    """What sizes a megakernel's buffers (every rank of the group builds the same).

    Attributes:
        num_ranks: R. max_tokens: N, the largest token count of any rank. hidden: D. intermediate: I.
        experts_per_rank: L. top_k: k. shared_intermediate: the shared experts' Is summed (0: none).
    """

    num_ranks: int
    max_tokens: int
    hidden: int
    intermediate: int
    experts_per_rank: int
    top_k: int
    shared_intermediate: int

    @classmethod
    def of(cls, cfg: MoEConfig, ranks: int, max_tokens: int) -> LayerShape:
        """The shape of ``cfg``'s layer on ``ranks`` ranks holding at most ``max_tokens`` tokens each."""
        return cls(ranks, max_tokens, cfg.hidden, cfg.intermediate, cfg.experts_per_rank(ranks), cfg.top_k,
                   sum(cfg.shared))

    @property
    def capacity(self) -> int:
        """Routed rows of the worst case: every route of every rank to this rank (R * N * k)."""
        return self.num_ranks * max(self.max_tokens, 1) * self.top_k

    @property
    def rows_per_expert(self) -> float:
        """Routed rows per local expert under balanced routing (N * k / L): what the tile plans and the backward's
        weight-gradient recipe are picked for."""
        return self.max_tokens * self.top_k / max(self.experts_per_rank, 1)

    def config(self) -> MoEConfig:
        """The layer as a :class:`MoEConfig` (one shared expert of the summed size)."""
        return MoEConfig(hidden=self.hidden, intermediate=self.intermediate,
                         num_experts=self.experts_per_rank * self.num_ranks, top_k=self.top_k,
                         shared=(self.shared_intermediate,) if self.shared_intermediate else ())


@dataclass(frozen=True)
class KernelConfig:
    """Knobs of the persistent kernel (validated against ``num_sms`` on construction).

    Attributes:
        num_sms: programs in the grid (one per SM, co-resident).
        comm_sms: programs 0..comm_sms-1 communicate; the rest compute.
        minibatch: rows handed to the experts per round (a multiple of tile_m).
        ring_rows: rows of the ring token buffer (a multiple of minibatch).
        tile_m, tile_n: output tile of the expert GEMMs.
        backward_comm_sms: the backward megakernel's communication programs (None: comm_sms).
        backward_minibatch: the backward megakernel's rows per round (None: minibatch): a multiple of tile_m.
        backward_ring_rows: rows of the backward's ring, a multiple of 128 (None: :func:`default_backward_ring`
            of ring_rows): both backwards stream the routed rows through it a window at a time
            (``megamoe.routing.windows``), so their memory does not grow with the EP size.
        overlap: the forward as one persistent launch whose communication and compute workers overlap (True),
            or (False, the `unfused` ablation) the same steps one launch after another, ordered on the device,
            each compute step on every SM.
    """

    num_sms: int
    comm_sms: int
    minibatch: int
    ring_rows: int
    tile_m: int = 128
    tile_n: int = 256
    backward_comm_sms: int | None = None
    backward_minibatch: int | None = None
    overlap: bool = True
    backward_ring_rows: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_sms", "comm_sms", "minibatch", "ring_rows", "tile_m", "tile_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KernelConfig.{name} must be a positive int, got {value!r}")
        if self.comm_sms >= self.num_sms:
            raise ValueError(f"comm_sms ({self.comm_sms}) must leave compute SMs: it must be < num_sms ({self.num_sms})")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"KernelConfig.overlap must be a bool, got {self.overlap!r}")
        bwd = self.backward_comm_sms
        if bwd is not None and (not isinstance(bwd, int) or isinstance(bwd, bool) or not 1 <= bwd < self.num_sms):
            raise ValueError(f"KernelConfig.backward_comm_sms must be None or an int in [1, num_sms={self.num_sms}), "
                             f"got {bwd!r}")
        bmb = self.backward_minibatch
        if bmb is not None and (not isinstance(bmb, int) or isinstance(bmb, bool) or bmb < 1 or bmb % self.tile_m):
            raise ValueError(f"KernelConfig.backward_minibatch must be None or a multiple of tile_m ({self.tile_m}), "
                             f"got {bmb!r}")
        ring = self.backward_ring_rows
        if ring is not None and (not isinstance(ring, int) or isinstance(ring, bool) or ring < WINDOW_ALIGN
                                 or ring % WINDOW_ALIGN or ring % self.tile_m):
            raise ValueError(f"KernelConfig.backward_ring_rows must be None or a positive multiple of {WINDOW_ALIGN} "
                             f"and of tile_m ({self.tile_m}), got {ring!r}")
        if self.minibatch % self.tile_m:
            raise ValueError(f"minibatch ({self.minibatch}) must be a multiple of tile_m ({self.tile_m})")
        if self.minibatch > self.ring_rows:
            raise ValueError(f"minibatch ({self.minibatch}) is larger than the ring ({self.ring_rows} rows)")
        if self.ring_rows % self.minibatch:
            raise ValueError(f"ring_rows ({self.ring_rows}) must be a multiple of minibatch ({self.minibatch})")

    @property
    def compute_sms(self) -> int:
        return self.num_sms - self.comm_sms

    @property
    def bwd_comm_sms(self) -> int:
        """The backward's communication programs."""
        return self.comm_sms if self.backward_comm_sms is None else self.backward_comm_sms

    @property
    def bwd_minibatch(self) -> int:
        """The backward's rows per round."""
        return self.minibatch if self.backward_minibatch is None else self.backward_minibatch

    @property
    def bwd_ring_rows(self) -> int:
        """The backward's ring rows (its windows hold up to this + 128)."""
        return default_backward_ring(self.ring_rows) if self.backward_ring_rows is None else self.backward_ring_rows


def default_backward_ring(ring_rows: int) -> int:
    """The backward ring for a forward ring of ``ring_rows``: its windows (``ring + 128`` rows) fit the forward's
    ring, so a backward whose rows the forward's ring held reads them in place (one window, no copy)."""
    return max(WINDOW_ALIGN, (ring_rows - WINDOW_ALIGN) // WINDOW_ALIGN * WINDOW_ALIGN)


def check_kernel_config(config: KernelConfig, shape: LayerShape, precision: str, *, tile_m: int,
                        available_sms: int | None = None, where: str = "this GPU") -> None:
    """ValueError unless ``config`` can run ``shape`` in ``precision``: its row tile is the routed expert tiles'
    (``tile_m`` rows, which the caller's device and precision give), its grid fits the ``available_sms`` (the
    programs wait for each other, so all must be resident at once; None: not checked, as on the interpreter),
    and the shape suits the precision's blocks and the kernels' 16-byte rows."""
    if not isinstance(config, KernelConfig):
        raise ValueError(f"config must be a KernelConfig, got {type(config).__name__}")
    check_precision(precision)
    block = SCALE_BLOCK[precision]
    if shape.hidden % block or shape.intermediate % block:
        raise ValueError(f"{precision} needs D and I multiples of {block}, got D={shape.hidden}, "
                         f"I={shape.intermediate}")
    if config.tile_m != tile_m:
        raise ValueError(f"KernelConfig.tile_m ({config.tile_m}) must be the expert tiles' rows ({tile_m} on {where})")
    if available_sms is not None and config.num_sms > available_sms:
        raise ValueError(f"KernelConfig.num_sms ({config.num_sms}) exceeds the {available_sms} SMs of {where}: the "
                         f"programs wait for each other and must all be resident at once")
    if shape.hidden % HIDDEN_MULTIPLE or shape.intermediate % 8 or shape.shared_intermediate % 8:
        raise ValueError(f"D must be a multiple of {HIDDEN_MULTIPLE}, I and the shared I multiples of 8")
