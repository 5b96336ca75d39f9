"""BF16 expert FFNs over schedule-grouped rows: the launches and their torch twins.

The routed buffer holds rows grouped by local expert, as the pull schedule
lays them out: expert l owns rows ``[offsets[l], offsets[l] + counts[l])``.
:func:`expert_forward` runs gate/up + SwiGLU and down on every region with
persistent Triton kernels (`megamoe.kernels.expert_gemm`); the task list is
built on the device, so empty experts cost nothing and nothing syncs the
host. :func:`expert_forward_reference` is the plain-PyTorch twin; the
backward is :mod:`megamoe.ops.experts_bwd`. Tile shapes: :mod:`megamoe.planner.tiles`.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch

from megamoe import checks
from megamoe.config import SWIGLU, Activation
from megamoe.kernels import expert_gemm, forward_warp_specialized, gluon_ring
from megamoe.ops.launch import descriptor, launch_row_tasks, scratch_allocator
from megamoe.planner.tiles import TileConfig, mean_rows, ping_pong_tile
from megamoe.planner.tuning import DEFAULT_TUNING, Tuning
from megamoe.reference import activate, expert_ffn
from megamoe.routing.row_tiles import build_row_tiles
from megamoe import runtime
from megamoe.runtime import compiled_gpu


# Partial tiles read rows past an expert region (their results are masked at the store); under the
# interpreter numpy warns about whatever values those rows hold. The warning says nothing about results.
warnings.filterwarnings("ignore", message="(overflow|invalid value) encountered", category=RuntimeWarning,
                        module="triton.runtime.interpreter")


@dataclass
class ExpertForward:
    """What the forward expert compute leaves: `h [R, 2I]` (kept for the backward), `act [R, I]`, `y [R, D]`.

    Only rows inside expert regions are written.
    """

    h: torch.Tensor
    act: torch.Tensor
    y: torch.Tensor


@dataclass
class ExpertForwardQuantized:
    """Outputs of a forward on FP8 operands (FP8-block or MXFP8): `h [R, 2I]` bf16 (None when not
    stored), `act_q [R, I]` E4M3 with `act_scale` (the down GEMM's input, quantised along I: fp32
    `[R, I/128]` for FP8-block, E8M0 uint8 `[R, I/32]` for MXFP8), `y [R, D]` bf16. Only rows inside
    expert regions are written."""

    h: torch.Tensor | None
    act_q: torch.Tensor
    act_scale: torch.Tensor
    y: torch.Tensor

    @classmethod
    def given_or_empty(cls, out: ExpertForwardQuantized | None, rows: int, intermediate: int, hidden: int,
                       scale_block: int, scale_dtype: torch.dtype, device: torch.device,
                       store_h: bool) -> ExpertForwardQuantized:
        """``out``, or new uninitialised outputs for ``rows`` rows (h only with ``store_h``); ValueError when
        ``store_h`` and ``out`` has no h."""
        if out is None:
            out = cls(
                h=torch.empty(rows, 2 * intermediate, dtype=torch.bfloat16, device=device) if store_h else None,
                act_q=torch.empty(rows, intermediate, dtype=torch.float8_e4m3fn, device=device),
                act_scale=torch.empty(rows, intermediate // scale_block, dtype=scale_dtype, device=device),
                y=torch.empty(rows, hidden, dtype=torch.bfloat16, device=device),
            )
        if store_h and out.h is None:
            raise ValueError("store_h=True needs out.h")
        return out


def check_operands(x_rows, counts, offsets, w_gate_up, w_down) -> tuple[int, int, int]:
    """The expert operands' shapes, dtypes and devices checked (ValueError); returns (experts, I, D)."""
    if x_rows.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError("x_rows must be [R, D], w_gate_up [L, 2I, D] and w_down [L, D, I]")
    experts, two_i, d = w_gate_up.shape
    i = two_i // 2
    if x_rows.shape[1] != d or tuple(w_down.shape) != (experts, d, i) or two_i % 2:
        raise ValueError(
            f"shapes disagree: x_rows {tuple(x_rows.shape)}, w_gate_up {tuple(w_gate_up.shape)}, "
            f"w_down {tuple(w_down.shape)}"
        )
    if tuple(counts.shape) != (experts,) or tuple(offsets.shape) != (experts,):
        raise ValueError(f"counts and offsets must be [{experts}], got {tuple(counts.shape)}, {tuple(offsets.shape)}")
    for name, t in (("x_rows", x_rows), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be bfloat16, got {t.dtype}")
        if t.device != x_rows.device:
            raise ValueError(f"{name} is on {t.device}, x_rows on {x_rows.device}")
    if i % 8:
        raise ValueError(f"the intermediate size I must be a multiple of 8 (16-byte rows), got {i}")
    return experts, i, d


def expert_forward(
    x_rows: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    activation: Activation = SWIGLU,
    num_programs: int | None = None,
    out: ExpertForward | None = None,
    tuning: Tuning | None = None,
    minibatch: int | None = None,
    rows_per_expert: float | None = None,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    x_index: torch.Tensor | None = None,
    mx_act: bool = False,
) -> ExpertForward:
    """Gate/up + SwiGLU and down for every expert region of ``x_rows`` (BF16).

    Args:
        x_rows: bf16 `[R, D]` routed rows, grouped by local expert.
        counts: int `[L]` rows of each expert; offsets: int `[L]` region starts.
        w_gate_up: bf16 `[L, 2I, D]`; w_down: bf16 `[L, D, I]`; I a multiple of 8.
        num_programs: persistent grid size (default: the SM count).
        out: preallocated outputs to fill (rows outside regions are left alone).
        tuning: pins the gate/up and down tiles (:class:`~megamoe.planner.tuning.Tuning`; None: the planner's).
        minibatch: also cut tiles at multiples of this many rows (the megakernel's minibatches);
            the result is the same bits.
        rows_per_expert: the load's mean rows per expert, for the tile plan (default: the rows over the
            experts; a caller whose rows are a worst-case capacity gives the expected mean). The tiles do
            not change the bits.
        b_gate_up: bf16 `[L, 2I]`, b_down: bf16 `[L, D]`: optional expert biases, added to h before the activation
            (h includes it) and to y (``megamoe.kernels.expert_bias``).
        x_index: int32 `[R]`: ``x_rows`` is then `[S, D]` and row r's input is ``x_rows[x_index[r]]`` (each in
            ``[0, S)`` inside the regions): one rank's tokens read in place of routed copies (:func:`gate_up`).
        mx_act: act rounded to the MXFP8 grid along I in the gate/up epilogue (:func:`gate_up`; MXFP8 run as these
            kernels, ``megamoe.ops.experts_mxfp8_bf16``).
    """
    experts, i, d = check_operands(x_rows, counts, offsets, w_gate_up, w_down)
    checks.check_expert_biases(b_gate_up, b_down, w_gate_up, w_down, kernels=True)
    if x_index is not None:
        checks.check_row_index("x_index", x_index, 0, x_rows.device)
    rows = x_rows.shape[0] if x_index is None else x_index.shape[0]
    device = x_rows.device
    if out is None:
        out = ExpertForward(
            h=torch.empty(rows, 2 * i, dtype=torch.bfloat16, device=device),
            act=torch.empty(rows, i, dtype=torch.bfloat16, device=device),
            y=torch.empty(rows, d, dtype=torch.bfloat16, device=device),
        )
    gate_up(x_rows, counts, offsets, w_gate_up, out.h, out.act, activation=activation,
            num_programs=num_programs, tuning=tuning, minibatch=minibatch,
            rows_per_expert=rows_per_expert, bias=b_gate_up, x_index=x_index, mx_act=mx_act)
    down(out.act, counts, offsets, w_down, out.y, num_programs=num_programs, tuning=tuning,
         minibatch=minibatch, rows_per_expert=rows_per_expert, bias=b_down)
    return out


def gate_up(
    x_rows: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    w_gate_up: torch.Tensor,
    h: torch.Tensor,
    act: torch.Tensor,
    *,
    activation: Activation = SWIGLU,
    num_programs: int | None = None,
    tuning: Tuning | None = None,
    minibatch: int | None = None,
    rows_per_expert: float | None = None,
    warp_specialized: bool = True,
    bias: torch.Tensor | None = None,
    x_index: torch.Tensor | None = None,
    mx_act: bool = False,
) -> None:
    """h = x_rows · w_gate_upᵀ (+ ``bias`` bf16 `[L, 2I]`, optional) and act = SwiGLU(h) on every expert region
    (one persistent launch); the tiles are ``tuning``'s or planned for ``rows_per_expert`` (default: rows / experts).
    On Hopper 128-row tiles run in the warp-specialised Gluon kernel (:func:`forward_ws`), elsewhere
    ``gate_up_kernel``: the same bits. ``warp_specialized=False`` runs ``gate_up_kernel`` there too (A/B runs,
    tests). ``x_index`` (int32 `[R]`): row r's input is ``x_rows[x_index[r]]`` (the Gluon kernel's producer gathers
    it; elsewhere one gather copies the rows first: the same bits). ``mx_act``: act rounded to the MXFP8 grid along
    I (32-blocks, I a multiple of 32) before its store, in the epilogue (``mxfp8_round_tile``; the Triton tiles
    then take BLOCK_N a multiple of 64: two chunks of whole blocks)."""
    experts, two_i, d = w_gate_up.shape
    i = two_i // 2
    rows = h.shape[0]
    if mx_act and i % 32:
        raise ValueError(f"mx_act rounds act in 32-blocks along I: I must be a multiple of 32, got {i}")
    if rows == 0 or experts == 0:
        return
    cfg = (tuning or DEFAULT_TUNING).tile("gate_up", x_rows.device, mean_rows(rows, experts, rows_per_expert))
    if mx_act and cfg.block_n % 64:  # the epilogue's two column chunks hold whole 32-blocks
        cfg = dataclasses.replace(cfg, block_n=64 * -(-cfg.block_n // 64))
    programs = runtime.num_programs(x_rows.device, num_programs)
    gluon = warp_specialized and warp_specialized_forward(x_rows.device, cfg)
    if x_index is not None:
        checks.check_row_index("x_index", x_index, rows, x_rows.device)
        if not gathers_on_load(gluon, GATHER_FORWARD, x_rows):
            x_rows, x_index = gathered_rows(x_rows, x_index, rows), None
    if gluon:
        forward_ws(x_rows, w_gate_up, h, counts, offsets, cfg, programs, act=act, activation=activation,
                   minibatch=minibatch, bias=bias, a_index=x_index, mx_act=mx_act)
        return
    launch_row_tasks(
        expert_gemm.gate_up_kernel, cfg, programs,
        counts.to(torch.int32), offsets.to(torch.int32), rows,
        head=(descriptor(x_rows, [cfg.block_m, cfg.block_k]),
              descriptor(w_gate_up.view(experts * 2 * i, d), [cfg.block_n, cfg.block_k]),
              h, act, h.stride(0), act.stride(0)),
        tail=(i, d, activation.kernel_limit, activation.kernel_alpha),
        minibatch=minibatch,
        ACT=activation.kernel_id, b_ptr=bias, MX_ROUND=mx_act,
    )


def down(
    act: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    w_down: torch.Tensor,
    y: torch.Tensor,
    *,
    num_programs: int | None = None,
    tuning: Tuning | None = None,
    minibatch: int | None = None,
    rows_per_expert: float | None = None,
    bias: torch.Tensor | None = None,
    warp_specialized: bool = True,
) -> None:
    """y = act · w_downᵀ (+ ``bias`` bf16 `[L, D]`, optional) on every expert region (one persistent launch); the
    tiles are ``tuning``'s or planned for ``rows_per_expert`` (default: rows / experts). On Hopper 128-row tiles
    with K = I at most ``PING_PONG_MAX_K["down"]`` run in the Gluon ping-pong (:func:`forward_ws`, ``ping_pong``;
    where ``MEGAMOE_PING_PONG_DOWN`` is 1, else ``down_kernel``): the same bits."""
    experts, d, i = w_down.shape
    rows = act.shape[0]
    if rows == 0 or experts == 0:
        return
    cfg = (tuning or DEFAULT_TUNING).tile("down", act.device, mean_rows(rows, experts, rows_per_expert))
    programs = runtime.num_programs(act.device, num_programs)
    ping_pong = (ping_pong_tile("down", cfg, i) if PING_PONG_DOWN and warp_specialized
                 and warp_specialized_forward(act.device, cfg) else None)
    if ping_pong is not None:
        forward_ws(act, w_down, y, counts, offsets, ping_pong, programs, minibatch=minibatch, bias=bias,
                   ping_pong=True)
        return
    launch_row_tasks(
        expert_gemm.down_kernel, cfg, programs,
        counts.to(torch.int32), offsets.to(torch.int32), rows,
        head=(descriptor(act, [cfg.block_m, cfg.block_k]),
              descriptor(w_down.view(experts * d, i), [cfg.block_n, cfg.block_k]), y, y.stride(0)),
        tail=(d, i),
        minibatch=minibatch, b_ptr=bias,
    )


def warp_specialized_forward(device: torch.device, tile: TileConfig) -> bool:
    """True when :func:`gate_up` runs the warp-specialised Gluon kernel: compiled on Hopper, 128-row tiles (its two
    64-row consumer warpgroups)."""
    return compiled_gpu(device) and torch.cuda.get_device_capability(device)[0] == 9 and tile.block_m == 128


def forward_ws_constexprs(tile: TileConfig, programs: int, *, gate_up: bool, act: int,
                          stages: int | None = None, mma_in_flight: bool = True, ping_pong: bool = False) -> dict:
    """The Gluon forward's constexprs at ``tile`` (shared with the sm_90 build check, so it compiles what runs):
    the planner's stages unless ``stages`` (4 measured 2-6 % slower than 3; at least ``gluon_ring.MIN_STAGES``),
    one wgmma in flight
    (benchmarks/results/2026-12-03-forward-warp-specialized); ``ping_pong``: down's warpgroups take whole tiles in
    turn (``forward_warp_specialized.ping_pong_consumer``, one wgmma step always in flight); a tile of at most 64
    rows in one warpgroup where :data:`SKIP_EMPTY_HALF`."""
    if ping_pong and gate_up:
        raise ValueError("ping-pong runs down's tiles only")
    return dict(GATE_UP=gate_up, ACT=act, NUM_PROGRAMS=programs, BLOCK_N=tile.block_n,
                BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
                STAGES=max(gluon_ring.MIN_STAGES, stages or tile.num_stages),
                MMA_IN_FLIGHT=mma_in_flight, PING_PONG=ping_pong, SKIP_EMPTY_HALF=SKIP_EMPTY_HALF)


def forward_ws(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor,
               tile: TileConfig, programs: int, *, act: torch.Tensor | None = None, activation: Activation = SWIGLU,
               minibatch: int | None = None, stages: int | None = None, mma_in_flight: bool = True,
               bias: torch.Tensor | None = None, a_index: torch.Tensor | None = None, mx_act: bool = False,
               ping_pong: bool = False) -> None:
    """A forward expert GEMM in the warp-specialised Gluon kernel (Hopper; 128-row tiles of ``tile``'s BLOCK_N,
    BLOCK_K, GROUP_M and, unless ``stages``, ring depth): gate/up + SwiGLU when ``act`` is given (w `[L, 2I, D]`, out
    h `[R, 2I]`), else down (w `[L, D, I]`, out y `[R, D]`). One wgmma is left in flight per K step unless
    ``mma_in_flight`` is False. ``bias``: the experts' optional bf16 bias (gate/up's `[L, 2I]`, down's `[L, D]`).
    ``a_index`` (int32 `[R]`): A row r is ``a[a_index[r]]``, gathered by the producer. ``mx_act`` (gate/up): act
    rounded to the MXFP8 grid along I before its store. ``ping_pong`` (down, not ``a_index``): the two warpgroups
    take whole tiles in turn, one's stores under the other's wgmmas. The same tasks and bits as the Triton
    kernels."""
    if ping_pong and a_index is not None:
        raise ValueError("ping-pong down reads its A rows by TMA, not by a_index")
    gate_up = act is not None
    experts, w_n, k = w.shape
    n = w_n // 2 if gate_up else w_n
    rows = out.shape[0]
    if rows == 0 or experts == 0:
        return
    tiles = build_row_tiles(counts.to(torch.int32), offsets.to(torch.int32), rows, 128, minibatch=minibatch)
    act = act if gate_up else out
    with scratch_allocator():
        forward_warp_specialized.forward_ws_kernel[(programs,)](
            a, w, out, act, out if bias is None else bias, a.stride(0), out.stride(0), act.stride(0),
            tiles.tile_expert, tiles.tile_row0,
            tiles.tile_row_end, tiles.tile_run, tiles.num_tiles, rows, experts * w_n, n, k,
            activation.kernel_limit, activation.kernel_alpha, tiles.tile_expert if a_index is None else a_index,
            num_warps=4, HAS_BIAS=bias is not None, A_GATHER=a_index is not None,
            MX_ROUND=mx_act,
            **forward_ws_constexprs(tile, programs, gate_up=gate_up, act=activation.kernel_id, stages=stages,
                                    mma_in_flight=mma_in_flight, ping_pong=ping_pong))


def expert_forward_reference(
    x_rows: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    activation: Activation = SWIGLU,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    x_index: torch.Tensor | None = None,
) -> ExpertForward:
    """The torch twin of :func:`expert_forward` in FP32 (rows outside regions stay NaN)."""
    i, d = w_gate_up.shape[1] // 2, w_gate_up.shape[2]
    rows = x_rows.shape[0]
    nan = dict(dtype=torch.float32, device=x_rows.device)
    out = ExpertForward(torch.full((rows, 2 * i), float("nan"), **nan), torch.full((rows, i), float("nan"), **nan),
                        torch.full((rows, d), float("nan"), **nan))
    for l, (start, count) in enumerate(zip(offsets.tolist(), counts.tolist())):
        x = x_rows[start : start + count].float()
        b_gu = None if b_gate_up is None else b_gate_up[l].float()
        b_dn = None if b_down is None else b_down[l].float()
        h = x @ w_gate_up[l].float().T + (0.0 if b_gu is None else b_gu)
        out.h[start : start + count] = h
        out.act[start : start + count] = activate(h, activation)
        out.y[start : start + count] = expert_ffn(x, w_gate_up[l].float(), w_down[l].float(), activation, b_gu, b_dn)
    return out


#: One rank's Gluon tiles read their tokens' rows by index on load (``megamoe.kernels.gluon_gather``: cp.async in a
#: producer warpgroup, each thread's landing counted on the step's full barrier) where these are True, else the rows
#: are copied first (``gathered_rows``): the same bits either way. Measured per kernel on one H100
#: (benchmarks/results/2026-12-06-h100-step-gathers-wsum, a training step at EP 1): the forward's gate/up tiles gather
#: x for +0.02-0.03 ms and save the 0.16 ms (qwen3-30b-a3b, 8192 tokens) / 0.39 ms (sonic-7b, 24576) copy: on by
#: default. The backward's: the dact and the down wgrad read d_out by token, the gate/up wgrad x (gathered as its A,
#: the blocks stored transposed), so the composed backward pulls neither; the gathering wgrads step K 64 rows
#: (``expert_wgrad.gathering_wgrad_tile``). d_out: the backward 0.34 ms faster at sonic-7b (3.53 against 3.87 ms,
#: 24576 tokens), 0.17 ms at qwen3-30b-a3b (8192; one H100, benchmarks/results/2026-12-06-h100-wgrad-gather); x
#: then: the step 4.31 -> 4.15 ms at sonic-7b, 4.66 -> 4.49 at qwen3-30b-a3b (one H200,
#: benchmarks/results/2026-12-06-h200-keyed-pool-step). The same bits: on by default. ``MEGAMOE_GATHER_FORWARD`` /
#: ``MEGAMOE_GATHER_BACKWARD`` (0 or 1) set them for A/B runs.
GATHER_FORWARD = runtime.env_switch("MEGAMOE_GATHER_FORWARD", True)
GATHER_BACKWARD = runtime.env_switch("MEGAMOE_GATHER_BACKWARD", True)
#: Hopper's down and dx in the Gluon ping-pong where their K is short (``planner.tiles.ping_pong_tile``); off: the
#: Triton ``down_kernel`` / ``dx_kernel`` (the same bits). Off by default until their library paths have run on a
#: GPU in a training step (benchmarks/results/2026-12-07-ping-pong-down: the down kernel's bits and its A/B ran; the
#: step's A/B, call 53, has not).
PING_PONG_DOWN = runtime.env_switch("MEGAMOE_PING_PONG_DOWN", False)
PING_PONG_DX = runtime.env_switch("MEGAMOE_PING_PONG_DX", False)
#: Hopper's Gluon row tiles (gate/up, the dacts, the FP8 forward, the ping-pong down and dx) run a tile of at most 64
#: rows (an expert's tail: 42 of kimi-k2's ~170-row experts, 1 of deepseek-v3's ~257) in one warpgroup: the other
#: passes its steps without wgmmas and the producer loads no bottom A half (the same bits: those rows are never
#: stored). At 128-row tiles the MMAs run 1.50x kimi-k2's rows and 1.26x deepseek-v3's, 1.14x / 1.13x with it
#: (``bench/problem`` routing, 8192 tokens). Off by default until a GPU has run its bits and its A/B.
SKIP_EMPTY_HALF = runtime.env_switch("MEGAMOE_SKIP_EMPTY_HALF", False)
#: Hopper's dx at 128-row tiles that the ping-pong does not take (K = 2I past ``PING_PONG_MAX_K``, or the switch off)
#: in the cooperative Gluon kernel (``dx_warp_specialized``, 128 x 256 tiles, the producer's ring; with
#: :data:`SKIP_EMPTY_HALF` an expert's tail of at most 64 rows in one warpgroup), else the Triton ``dx_kernel`` (the
#: same bits). Off by default until a GPU has run its bits and its A/B.
GLUON_DX = runtime.env_switch("MEGAMOE_GLUON_DX", False)


def gathers_on_load(gluon: bool, switch: bool, *sources: torch.Tensor) -> bool:
    """Whether a Gluon launch (``gluon``: the warp-specialised kernel runs) reads ``sources``' rows by index itself:
    its pass's switch (``GATHER_FORWARD`` or ``GATHER_BACKWARD``) on, and their row strides and widths multiples
    of 16 elements, where Triton proves the 16-byte alignment its cp.async pieces need (elsewhere the build fails:
    D 200 / I 136 did on an H200)."""
    return gluon and switch and all(t.stride(0) % 16 == 0 and t.shape[1] % 16 == 0 for t in sources)


def gathered_rows(source: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """``source[index[r]]`` for r < ``rows``: what a gathering kernel reads, copied, where the kernel that runs
    reads rows in place (rows outside the regions read any row: their results are never kept)."""
    if source.shape[0] == 0:
        return source.new_zeros(rows, source.shape[1])
    return torch.index_select(source, 0, index[:rows].long().clamp(0, source.shape[0] - 1))

