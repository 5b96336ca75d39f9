"""The backward megakernel's launch arguments, in named groups, ordered in one place.

The backward's twin of :mod:`megamoe.megakernel.launch_args`: each group below is a frozen dataclass whose field
names are ``megamoe.kernels.megakernel_bwd.megakernel_bwd``'s parameter names, in the kernel's order;
:func:`ordered` concatenates the runtime groups in :data:`GROUPS` order (the step index ``phase_minibatch``
follows them) and :class:`BackwardConsts` holds the constexprs but ``PHASE`` (per launch). :func:`check_order`
holds both against the kernel's signature.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from megamoe.kernels import megakernel_bwd as mkb
from megamoe.megakernel import launch_args

WHAT = "the backward megakernel"
#: The constexpr each launch picks (its step), outside :class:`BackwardConsts`.
PHASE_ARG = "PHASE"


@dataclass(frozen=True)
class WindowArgs:
    """The window's slice of the pull schedule and its experts' row ranges (device tensors; its row tiles are
    ``launch_args.RowTileArgs``)."""

    num_rows_ptr: object
    src_rank_ptr: object
    src_index_ptr: object
    offsets_ptr: object
    counts_ptr: object


@dataclass(frozen=True)
class RowsArgs:
    """The home ranks' staged d_out and x rows, pulled into the window's dy and x rows; the home ranks' symmetric
    d_x slots the dx rows are pushed to."""

    d_out_peer_ptrs: object
    d_out_ptr: object
    x_peer_ptrs: object
    x_ptr: object
    stride_rows: int
    dy_ptr: object
    x_rows_ptr: object
    stride_pass: int
    slots_peer_ptrs: object
    slots_ptr: object
    stride_slots: int


@dataclass(frozen=True)
class RoutedGradArgs:
    """The routed experts over the window's rows: dact (h at the window's rows), dx, the weight gradients."""

    dy_desc: object
    w_down_desc: object
    ring_h_ptr: object
    stride_ring_h: int
    row_w_ptr: object
    d_h_ptr: object
    act_w_ptr: object
    partial_ptr: object
    stride_d_h: int
    stride_act_w: int
    stride_partial: int
    d_h_desc: object
    w_gate_up_k_desc: object
    dx_ptr: object
    stride_dx: int
    d_router_ptr: object
    d_w_down_ptr: object
    d_w_gate_up_ptr: object


@dataclass(frozen=True)
class CarryArgs:
    """The weight gradients' FP32 carries across windows and each expert's mode (``megamoe.kernels.wgrad_carry``)."""

    modes_ptr: object
    down_in_ptr: object
    down_out_ptr: object
    gate_up_in_ptr: object
    gate_up_out_ptr: object


@dataclass(frozen=True)
class SharedGradArgs:
    """The shared expert over this rank's tokens (stand-ins and stride 0 without one, or past the first window:
    never read)."""

    shared_dy_desc: object
    shared_w_down_desc: object
    shared_h_ptr: object
    stride_shared_h: int
    ones_ptr: object
    shared_d_h_ptr: object
    shared_act_w_ptr: object
    shared_partial_ptr: object
    stride_shared_d_h: int
    stride_shared_act_w: int
    stride_shared_partial: int
    shared_d_h_desc: object
    shared_w_gate_up_k_desc: object
    shared_dx_ptr: object
    stride_shared_dx: int
    d_shared_down_ptr: object
    d_shared_gate_up_ptr: object


@dataclass(frozen=True)
class BackwardSyncArgs:
    """The GPU-local counters the workers hand their tasks over by (the pass end's: ``launch_args.PassEndArgs``)."""

    rows_ready_ptr: object
    dact_done_ptr: object
    dx_done_ptr: object
    shared_done_ptr: object
    dgrads_done_ptr: object


@dataclass(frozen=True)
class BackwardSizeArgs:
    """Sizes and knobs of the launch."""

    tokens: int
    my_rank: int
    num_ranks: int
    comm_sms: int
    minibatch: int
    experts: int
    I: int  # noqa: E741 (the legend's name)
    D: int
    shared_I: int
    limit: float
    alpha: float
    budget: int


@dataclass(frozen=True)
class BackwardConsts:
    """The constexprs of every launch of a window (``PHASE`` apart): the copy tile (``launch_args.copy_tile_consts``),
    the variant's switches and the tiles."""

    TOP_K: int
    CHUNKS: int
    CP: int
    W: int
    ROWS: int
    ALIGN: int
    HAS_SHARED: bool
    ACT: int
    DOT_FP32: bool
    FENCE: bool
    BLOCK_M: int
    BN_DA: int
    BK_DA: int
    BN_DX: int
    BK_DX: int
    BM_W: int
    BN_W: int
    BK_W: int
    GROUP_M: int
    TRACE: bool


#: The runtime groups in the kernel's argument order.
GROUPS = (WindowArgs, launch_args.RowTileArgs, RowsArgs, RoutedGradArgs, CarryArgs, SharedGradArgs, BackwardSyncArgs,
          launch_args.PassEndArgs, BackwardSizeArgs)


def ordered(*groups) -> tuple:
    """The runtime arguments of one launch: the fields of ``groups`` (one of each of :data:`GROUPS`, in that
    order), without the trailing step index."""
    return launch_args.ordered(*groups, kinds=GROUPS, what=WHAT)


def check_order() -> None:
    """RuntimeError unless the groups' fields are the kernel's runtime parameters and :class:`BackwardConsts`'s
    its constexprs but ``PHASE``, in its order."""
    launch_args.check_order(mkb.megakernel_bwd, GROUPS, WHAT)
    names = [f.name for f in fields(BackwardConsts)]
    want = [name for name in launch_args.parameters(mkb.megakernel_bwd, constexpr=True) if name != PHASE_ARG]
    if names != want:
        raise RuntimeError(f"{WHAT}'s constexprs {names} do not match its parameters {want}")
