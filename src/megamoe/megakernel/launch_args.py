"""The forward megakernel's launch arguments, in named groups, ordered in one place.

``megamoe.kernels.megakernel.megakernel`` takes ~80 runtime arguments. Each
group below is a frozen dataclass whose field names are the kernel's
parameter names, in the kernel's order; :func:`ordered` concatenates the
groups in :data:`GROUPS` order and is the only place that order lives (the
step index ``phase_minibatch`` follows them: the phased CPU mode changes it per
launch). :func:`check_order` holds the groups against the kernel's signature.
The copy-tile constexprs of the communication workers come from
:func:`copy_tile_consts`. The backward megakernel's groups
(:mod:`megamoe.megakernel.backward_args`) share :class:`RowTileArgs` and
:class:`PassEndArgs` and are ordered and checked by the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from megamoe.kernels import megakernel as mk
from megamoe.ops.comm import copy_tile
from megamoe.planner.tuning import COMM_TUNING, CommTuning


def copy_tile_consts(hidden: int, scale_block: int, scale_rows: tuple[int, int] | None,
                     tuning: CommTuning = COMM_TUNING) -> dict[str, int]:
    """The megakernel's copy-tile constexprs (``megamoe.ops.comm.copy_tile``): CHUNKS, CP, W, ROWS, ALIGN of the
    BF16 output rows it pushes, ``P_*`` of the rows it pulls (BF16, or E4M3 bytes) and ``S_*`` of their scales
    (``scale_rows`` = (width, bytes per element) of the FP8 scale rows; None for BF16 rows)."""
    names = ("CHUNKS", "CP", "W", "ROWS", "ALIGN")
    routed = copy_tile(hidden, 2, tuning, min_block=scale_block)
    pulled = routed if scale_rows is None else copy_tile(hidden, 1, tuning)
    scales = pulled if scale_rows is None else copy_tile(*scale_rows, tuning)
    return {prefix + name: value for prefix, tile in (("", routed), ("P_", pulled), ("S_", scales))
            for name, value in zip(names, tile)}


@dataclass(frozen=True)
class ScheduleArgs:
    """The pull schedule (device tensors)."""

    num_rows_ptr: object
    src_rank_ptr: object
    src_index_ptr: object


@dataclass(frozen=True)
class RowTileArgs:
    """The schedule's row tiles by minibatch (``megamoe.routing.row_tiles.RowTiles``): the forward's and the
    backward megakernel's alike."""

    tile_expert_ptr: object
    tile_row0_ptr: object
    tile_row_end_ptr: object
    tile_run_ptr: object
    minibatch_tiles_ptr: object

    @classmethod
    def of(cls, tiles) -> RowTileArgs:
        return cls(tiles.tile_expert, tiles.tile_row0, tiles.tile_row_end, tiles.tile_run, tiles.minibatch_tiles)


@dataclass(frozen=True)
class CommArgs:
    """The symmetric rows the owners staged (BF16 x, or E4M3 x and its scales), pulled into the ring's rows (and
    scales); the symmetric combine slots the outputs are pushed to."""

    rows_peer_ptrs: object
    rows_ptr: object
    stride_rows: int
    scales_peer_ptrs: object
    scales_ptr: object
    stride_scales: int
    ring_ptr: object
    stride_ring: int
    combine_peer_ptrs: object
    combine_ptr: object
    stride_combine: int


@dataclass(frozen=True)
class RoutedArgs:
    """The routed experts over the ring: gate/up + SwiGLU into h and act, down into y; their optional biases
    (``b_gate_up`` `[L, 2I]`, ``b_down`` `[L, D]`, bf16, or None: the adds compile out)."""

    ring_desc: object
    w_gate_up_desc: object
    h_ptr: object
    act_ptr: object
    stride_h: int
    stride_act: int
    act_desc: object
    w_down_desc: object
    y_ptr: object
    stride_y: int
    b_gate_up_ptr: object = None
    b_down_ptr: object = None


@dataclass(frozen=True)
class ScaleArgs:
    """FP8 scales of the ring rows, the gate/up and down weights and act (MXFP8: E8M0 1x32; FP8-block: fp32 1x128,
    weights 128x128); any tensor and stride 0 for BF16 (never read)."""

    ring_scale_ptr: object
    w_gate_up_scale_ptr: object
    act_scale_ptr: object
    w_down_scale_ptr: object
    stride_ring_scale: int
    stride_wgu_scale: int
    stride_act_scale: int
    stride_wdn_scale: int


@dataclass(frozen=True)
class SharedArgs:
    """The shared expert over this rank's tokens (any descriptors and stride 0 without one: never read)."""

    shared_x_desc: object
    shared_w_gate_up_desc: object
    shared_h_ptr: object
    shared_act_ptr: object
    stride_shared_h: int
    stride_shared_act: int
    shared_act_desc: object
    shared_w_down_desc: object
    shared_y_ptr: object
    stride_shared_y: int


@dataclass(frozen=True)
class SyncArgs:
    """The GPU-local counters the workers hand their tasks over by."""

    rows_ready_ptr: object
    tile_done_ptr: object
    y_done_ptr: object
    shared_done_ptr: object


@dataclass(frozen=True)
class PassEndArgs:
    """The end-of-pass barrier (the comm workers' done counter, the cross-rank flags and epoch), the error word,
    the trace: the forward's and the backward megakernel's alike."""

    comm_done_ptr: object
    flag_peer_ptrs: object
    flags_ptr: object
    epoch_ptr: object
    error_ptr: object
    trace_base_ptr: object

    @classmethod
    def of(cls, kernel, comm_done) -> PassEndArgs:
        """A MegaKernel's barrier flags of the pass end (set 1), its error word and trace (the error word stands in
        for a trace it has not)."""
        k = kernel
        return cls(comm_done, k.flag_ptrs[1], k.sym.local("pass_flags")[1], k.epochs[1:], k.error,
                   k.error if k.trace is None else k.trace)


@dataclass(frozen=True)
class SizeArgs:
    """Sizes and knobs of the pass."""

    tokens: int
    my_rank: int
    num_ranks: int
    comm_sms: int
    minibatch: int
    slots: int
    experts: int
    I: int  # noqa: E741 (the legend's name)
    D: int
    shared_I: int
    limit: float
    alpha: float
    budget: int


#: The groups in the kernel's argument order.
GROUPS = (ScheduleArgs, RowTileArgs, CommArgs, RoutedArgs, ScaleArgs, SharedArgs, SyncArgs, PassEndArgs, SizeArgs)
#: The last runtime argument, after the groups: the minibatch of a phased step (0 for the whole pass).
STEP_ARG = "phase_minibatch"


def ordered(*groups, kinds: tuple = GROUPS, what: str = "the megakernel") -> tuple:
    """The runtime arguments of one launch: the fields of ``groups`` (one of each of ``kinds``, :data:`GROUPS` for
    the forward, in that order), without the trailing step index."""
    if tuple(type(g) for g in groups) != kinds:
        raise ValueError(f"{what} takes {[g.__name__ for g in kinds]} in this order, got "
                         f"{[type(g).__name__ for g in groups]}")
    return tuple(getattr(g, f.name) for g in groups for f in fields(g))


def parameters(kernel, constexpr: bool) -> list[str]:
    """A jit kernel's runtime (or constexpr) parameter names, in its order."""
    # the annotations of the Python function (the interpreter's wrapper has no parsed params)
    annotations = kernel.fn.__annotations__
    return [name for name in kernel.arg_names if ("constexpr" in str(annotations.get(name, ""))) == constexpr]


def check_order(kernel=mk.megakernel, kinds: tuple = GROUPS, what: str = "the megakernel") -> None:
    """RuntimeError unless the fields of ``kinds`` and then :data:`STEP_ARG` are ``kernel``'s runtime parameters,
    in its order."""
    names = [f.name for group in kinds for f in fields(group)] + [STEP_ARG]
    want = parameters(kernel, constexpr=False)
    if names != want:
        raise RuntimeError(f"{what}'s launch groups {names} do not match its parameters {want}")
