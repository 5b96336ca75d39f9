"""The forward megakernel's launch arguments, in named groups, ordered in one place.

``megamoe.kernels.megakernel.megakernel`` takes ~80 runtime arguments. Each
group below is a frozen dataclass whose field names are the kernel's
parameter names, in the kernel's order; :func:`ordered` concatenates the
groups in :data:`GROUPS` order and is the only place that order lives (the
step index ``phase_minibatch`` follows them: the phased CPU mode changes it per
launch). :func:`check_order` holds the groups against the kernel's signature.
The copy-tile constexprs of the communication workers come from
:func:`copy_tile_consts`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from megamoe.kernels import megakernel as mk
from megamoe.ops.comm import CommTuning, copy_tile

#: The communication workers' copy tile: one row per warp of the kernel's 8 warps (E4M3 rows and the scales
#: get the same rows per tile; narrower rows give more of them). Benchmarks may swap it.
COMM_TUNING = CommTuning(tile_rows=8)


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
    """The pull schedule and its minibatch row tiles (device tensors)."""

    num_rows_ptr: object
    src_rank_ptr: object
    src_index_ptr: object
    tile_expert_ptr: object
    tile_row0_ptr: object
    tile_row_end_ptr: object
    tile_run_ptr: object
    minibatch_tiles_ptr: object


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
    """The routed experts over the ring: gate/up + SwiGLU into h and act, down into y."""

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
    """The GPU-local counters, the cross-rank barrier's flags and epoch, the error word, the trace."""

    rows_ready_ptr: object
    tile_done_ptr: object
    y_done_ptr: object
    shared_done_ptr: object
    comm_done_ptr: object
    flag_peer_ptrs: object
    flags_ptr: object
    epoch_ptr: object
    error_ptr: object
    trace_base_ptr: object


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
    budget: int
    keep_own: int


#: The groups in the kernel's argument order.
GROUPS = (ScheduleArgs, CommArgs, RoutedArgs, ScaleArgs, SharedArgs, SyncArgs, SizeArgs)
#: The last runtime argument, after the groups: the minibatch of a phased step (0 for the whole pass).
STEP_ARG = "phase_minibatch"


def ordered(*groups) -> tuple:
    """The runtime arguments of one launch: the fields of ``groups`` (one of each of :data:`GROUPS`, in that
    order), without the trailing step index."""
    if tuple(type(g) for g in groups) != GROUPS:
        raise ValueError(f"the megakernel takes {[g.__name__ for g in GROUPS]} in this order, got "
                         f"{[type(g).__name__ for g in groups]}")
    return tuple(getattr(g, f.name) for g in groups for f in fields(g))


def check_order() -> None:
    """RuntimeError unless the groups' fields are the kernel's runtime parameters, in its order."""
    names = [f.name for group in GROUPS for f in fields(group)] + [STEP_ARG]
    # the annotations of the Python function (the interpreter's wrapper has no parsed params)
    annotations = mk.megakernel.fn.__annotations__
    want = [name for name in mk.megakernel.arg_names if "constexpr" not in str(annotations.get(name, ""))]
    if names != want:
        raise RuntimeError(f"the megakernel's launch groups {names} do not match its parameters {want}")
