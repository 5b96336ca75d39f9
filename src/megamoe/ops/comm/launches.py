"""The standalone pull / push launches of the layer's communication (see :mod:`megamoe.ops.comm`)."""

from __future__ import annotations

import torch

from megamoe.checks import describe, is_int
from megamoe.kernels import comm as comm_kernels
from megamoe.ops.comm.tile import CommTuning, copy_tile
from megamoe.ops.comm.workspace import (WAIT_BARRIER, WAIT_DISPATCH, CommWorkspace, QuantRows, check_rows)
from megamoe.ops.quant import soft_e4m3_default
from megamoe.precision import FORMATS, FP8_BLOCK, MX_BLOCK
from megamoe.routing.schedule import PullSchedule
from megamoe.runtime import resolve_wait_budget

#: Rows of a launch without a limit: the kernels' loop counters are int32.
NO_LIMIT = 2**31 - 1


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
    return _pull_rows(ws, schedule, "x", num_sms, out, quantize, rows, sync, tuning)


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
    """Backward reverse-combine, pull: ``routed[t] = d_out_r[i]`` for ``(r, i*k + j) = Phi[t]``.

    The upstream gradient of each route's token, unscaled: the expert backward applies the router weight
    (``d_h = w · SwiGLU'(h) ⊙ d_act``) and takes the router weight's own gradient from the unscaled rows, so a
    weight of exactly 0 still gets its true gradient. Arguments as :func:`dispatch_pull` (the rows come from
    every rank's staged ``d_out``; ``quantize`` quantises them on the fly; with a quantised ``row_format`` the
    E4M3 rows and scales ``stage`` made at home are pulled, half the bytes).
    """
    return _pull_rows(ws, schedule, "d_out", num_sms, out, quantize, rows, sync, tuning)


def _pull_rows(ws: CommWorkspace, schedule: PullSchedule, name: str, num_sms: int, out, quantize: str | None,
               rows: int | None, sync: bool, tuning: CommTuning | None) -> torch.Tensor | QuantRows:
    """Pull the staged rows ``name`` ("x" or "d_out") of every route: BF16 (quantised on the fly with
    ``quantize``), or the workspace's pre-quantised ``name_q`` / ``name_scale`` rows as they are."""
    ws.check_launch(schedule, num_sms)
    fmt = ws.shape.row_format
    if quantize is not None and quantize not in FORMATS:  # on-the-fly quantisation of pulled bf16 rows
        raise ValueError(f"quantize must be None or one of {FORMATS}, got {quantize!r}")
    if fmt != "bf16" and quantize not in (None, fmt):
        raise ValueError(f"the workspace holds {fmt} rows; quantize must be None or {fmt!r}, got {quantize!r}")
    quant = quantize if fmt == "bf16" else fmt
    limit = row_limit(rows)
    out = _routed_out(ws, schedule, out, quant)
    tuning = tuning or CommTuning()
    if sync:
        ws.sync()
    if fmt == "bf16":
        data, qscale = (out, None) if quant is None else (out.data.view(torch.uint8), out.scale)
        _launch_pull(ws, schedule, name, data, num_sms, limit, tuning, quant=quant, qscale=qscale)
    else:
        _launch_pull(ws, schedule, f"{name}_q", out.data.view(torch.uint8), num_sms, limit, tuning)
        _launch_pull(ws, schedule, f"{name}_scale", out.scale, num_sms, limit, tuning)
    if sync:
        ws.sync()
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
    """Backward reverse-dispatch, push: ``combine_{src_rank[t]}[src_index[t]] = dx_rows[t]``.

    As :func:`combine_push`: the combine slots hold the routes' d_x in the backward (the forward's outputs are
    summed by then); the home rank sums a token's k slots in fixed order. Returns this rank's slots.
    """
    _push_rows(ws, schedule, dx_rows, "combine", num_sms, sync, tuning)
    return ws.local("combine")



#: Routes per program of the route-scalar launches.
ROUTE_SCALARS_BLOCK = 1024


def pull_route_scalars(ws: CommWorkspace, schedule, name: str, out: torch.Tensor) -> torch.Tensor:
    """``out[t] = name_{src_rank[t]}[src_index[t]]``: one fp32 per route from its home rank's ``[N*k]`` buffer
    ``name`` (the backward's router weights), for the schedule's rows ``t < num_rows`` (0 on -1 rows; rows past
    ``num_rows`` untouched). ``schedule``: a PullSchedule or one of its windows. No host sync."""
    _route_scalars(ws, schedule, name, out, push=False)
    return out


def push_route_scalars(ws: CommWorkspace, schedule, values: torch.Tensor, name: str) -> None:
    """``name_{src_rank[t]}[src_index[t]] = values[t]``: one fp32 per route into its home rank's ``[N*k]`` slots
    ``name`` (the router-weight gradients); peers see them after the next barrier. No host sync."""
    _route_scalars(ws, schedule, name, values, push=True)


def _route_scalars(ws: CommWorkspace, schedule, name: str, rows: torch.Tensor, push: bool) -> None:
    ws.check_usable()
    home = ws.local(name).view(-1)
    if rows.dtype != torch.float32 or home.dtype != torch.float32 or rows.dim() != 1 or \
            rows.shape[0] < schedule.capacity or rows.device != ws.world.device:
        raise ValueError(f"route scalars must be float32 [>= {schedule.capacity}] on {ws.world.device}, "
                         f"got {describe(rows)} (home buffer {name!r}: {home.dtype})")
    blocks = max(1, -(-schedule.capacity // ROUTE_SCALARS_BLOCK))
    comm_kernels.route_scalars_kernel[(blocks,)](
        schedule.num_rows, schedule.src_rank, schedule.src_index, ws.peer_ptrs(name), home, rows,
        PUSH=push, BLOCK=ROUTE_SCALARS_BLOCK, num_warps=4)


def device_barrier(ws: CommWorkspace, *, wait_budget: int | None = None, check: bool = True) -> None:
    """A barrier across ranks inside a kernel (one program): no host sync unless ``check``.

    Each rank writes a new epoch into flag ``barrier`` of every rank and waits,
    at most ``wait_budget`` polls, for every rank's. Work queued after it on
    this rank's stream starts once every rank reached it. Every rank calls it
    the same number of times.
    """
    ws.check_usable()
    budget = resolve_wait_budget(wait_budget, barrier=True)
    ws._epochs[WAIT_BARRIER] += 1
    flag_ptrs, flags = ws.flag_ptrs(WAIT_BARRIER)

    comm_kernels.barrier_kernel[(1,)](
        flag_ptrs, flags, ws.world.rank, ws.world.size, ws._epochs[WAIT_BARRIER], budget, ws.local("error"),
        WAIT_ID=WAIT_BARRIER, num_warps=1,
    )
    if check:
        ws.device_sync()
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
) -> None:

    src = ws.local(src_name)
    width = src.shape[1]
    min_block = FP8_BLOCK if quant == "fp8-block" else MX_BLOCK if quant else 1
    chunks, cp, w, rows, align = copy_tile(width, src.element_size(), tuning, min_block=min_block)
    if quant:  # one row per tile, its chunks spread over the warps: a thread holding a whole row in fp32 spills
        rows = 1
    qscale = dst if qscale is None else qscale
    comm_kernels.pull_kernel[(num_sms,)](
        schedule.num_rows, limit, ws.claims, ws.peer_ptrs(src_name), src, src.stride(0), schedule.src_rank,
        schedule.src_index, dst, dst.stride(0), qscale, qscale.stride(0),
        TOP_K=ws.shape.top_k, CHUNKS=chunks, CP=cp, W=w, ROWS=rows, ALIGN=align,
        QUANT={None: 0, "mxfp8": 1, "fp8-block": 2}[quant], SOFT_E4M3=soft_e4m3_default(),
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

    ws.check_launch(schedule, num_sms)
    check_rows(rows, "rows", ws.shape.hidden, ws.world.device, exact_rows=schedule.capacity)
    tuning = tuning or CommTuning()
    dst = ws.local(dst_name)
    chunks, cp, w, rows_per_tile, align = copy_tile(ws.shape.hidden, dst.element_size(), tuning)
    if sync:
        ws.sync()
    flag_ptrs, flags = ws.flag_ptrs(WAIT_DISPATCH)  # unused without SIGNAL
    comm_kernels.push_kernel[(num_sms,)](
        schedule.num_rows, NO_LIMIT, ws.claims, rows, rows.stride(0), schedule.src_index,
        schedule.src_rank, schedule.src_index, ws.peer_ptrs(dst_name), dst, dst.stride(0),
        flag_ptrs, flags, ws.local("counters"), 0, 0, ws.world.rank, ws.world.size, 0, ws.local("error"),
        SRC_ROW_DIV=1, IDENTITY_SRC=True, CHUNKS=chunks, CP=cp, W=w, ROWS=rows_per_tile, ALIGN=align,
        SIGNAL=False, WAIT_ID=0, num_warps=tuning.num_warps,
    )
    if sync:
        ws.sync()


def _routed_out(
    ws: CommWorkspace, schedule: PullSchedule, out: object, quant: str | None
) -> torch.Tensor | QuantRows:
    cap, D, device = schedule.capacity, ws.shape.hidden, ws.world.device
    if quant is None:
        if out is None:
            return torch.zeros(cap, D, dtype=torch.bfloat16, device=device)
        check_rows(out, "out", D, device, exact_rows=cap)
        return out
    sblock = MX_BLOCK if quant == "mxfp8" else FP8_BLOCK
    sdtype = torch.uint8 if quant == "mxfp8" else torch.float32
    if quant == "fp8-block" and D % FP8_BLOCK:
        raise ValueError(f"quantize 'fp8-block' needs D a multiple of {FP8_BLOCK}, got {D}")
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
            raise ValueError(f"out.{name} must be {dtype} [{cap}, {width}] on {device}, got {describe(t)}")
        if t.stride(1) != 1:
            raise ValueError(f"out.{name} rows must be contiguous, got strides {t.stride()}")
    return out


def row_limit(rows: object) -> int:
    if rows is None:
        return NO_LIMIT
    if not is_int(rows) or rows < 0:
        raise ValueError(f"rows must be None or a non-negative int, got {rows!r}")
    return min(rows, NO_LIMIT)
