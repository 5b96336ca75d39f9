"""The expert weight-gradient launch (``out[l] = a[rows of l]ᵀ · b[rows of l]``), the BF16 backward's and the FP8
backwards' BF16 wgrads: the warp-specialised Gluon kernel on Hopper (its tiles, its deal of blocks to programs and
the plan for skewed loads) and the Triton ``wgrad_kernel`` elsewhere, the same bits.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton

from megamoe import runtime
from megamoe.kernels import expert_gemm_bwd, wgrad_warp_specialized
from megamoe.kernels.wgrad_blocks import HALF_M, SPLIT_N
from megamoe.kernels.wgrad_deal import wgrad_deal_kernel
from megamoe.ops import experts as expert_ops  # its switches, read at each call (tests set them)
from megamoe.ops.experts import gathered_rows, gathers_on_load
from megamoe.ops.launch import scratch_allocator
from megamoe.planner.tiles import WGRAD_MMA_IN_FLIGHT_STAGES, TileConfig, carry_tile, wgrad_ws_stages
from megamoe.runtime import compiled_gpu, interpreting


def warp_specialized_wgrad(device: torch.device, tile: TileConfig) -> bool:
    """True when :func:`wgrad` runs the warp-specialised Gluon kernel: compiled on Hopper, 128-row blocks (its two
    64-row consumer warpgroups)."""
    return compiled_gpu(device) and torch.cuda.get_device_capability(device)[0] == 9 and tile.block_m == 128


def gathering_wgrad_tile(tile: TileConfig) -> TileConfig:
    """A wgrad gathering rows by token (d_out for the down wgrad; x for gate/up's, gathered as A too) steps K 64
    rows at a time (at least): half the producer's index loads and cp.async rounds per row of a 32-row step. One
    H100, sonic-7b's down wgrad: 0.396 ms at BK 64 against 0.557 at the pass's 32 (the copy + wgrad 0.703;
    benchmarks/results/2026-12-06-h100-wgrad-gather). The rows are reduced in the same order, so the bits are the
    32-row step's."""
    return tile if tile.block_k >= 64 else replace(tile, block_k=64)


#: The Gluon wgrad stores each half block in four 64-column quarters through two 64 x 64 buffers a consumer
#: (``wgrad_blocks.store_half_split``), its ring deeper by the shared memory that frees (8 slots instead of 6 at
#: BK 32, 4 instead of 3 at BK 64). One H100, the backward's wgrads against whole-half stores, each in its own
#: process: qwen3-235b-a22b 4.60 against 4.89 ms, deepseek-v3 14.12 / 14.30 against 14.33 / 14.49 (zipf 18.46
#: against 18.62), qwen3-30b-a3b and sonic-120b ties, gpt-oss-120b 3.85-3.86 against 3.83 (the same bits, GPU-tested;
#: benchmarks/results/2026-12-07-wgrad-split-store, calls 14, 18, 19). ``MEGAMOE_WGRAD_SPLIT_STORE`` (0 or 1) sets it.
WGRAD_SPLIT_STORE = runtime.env_switch("MEGAMOE_WGRAD_SPLIT_STORE", True)


def wgrad_ws_constexprs(tile: TileConfig, programs: int, dynamic: bool = False, split: bool | None = None,
                        planned: bool = False) -> dict:
    """The Gluon wgrad's constexprs at ``tile``'s block: its ring as deep as shared memory allows
    (:func:`~megamoe.planner.tiles.wgrad_ws_stages`), one wgmma left in flight from
    :data:`~megamoe.planner.tiles.WGRAD_MMA_IN_FLIGHT_STAGES` on (the measurements are there). ``split``: the
    split store (None: :data:`WGRAD_SPLIT_STORE`) where the block is 256 wide; the dynamic deal stores whole halves.
    ``dynamic`` / ``planned``: the blocks dealt from a counter / by the plan (:data:`WGRAD_DYNAMIC`,
    :data:`WGRAD_PLAN_SKEW`), not both."""
    if dynamic and planned:
        raise ValueError("the Gluon wgrad deals its blocks from a counter or by a plan, not both")
    split = (WGRAD_SPLIT_STORE if split is None else split) and not dynamic and tile.block_n == 4 * SPLIT_N.value
    stages = wgrad_ws_stages(tile.block_n, tile.block_k, split)
    return dict(NUM_PROGRAMS=programs, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, STAGES=stages,
                MMA_IN_FLIGHT=stages >= WGRAD_MMA_IN_FLIGHT_STAGES, SPLIT_STORE=split, DYNAMIC=dynamic,
                PLANNED=planned)


#: The Gluon wgrad takes its blocks from a counter as programs come free, heavy experts first from one end and light
#: ones from the other (``wgrad_dynamic.dealt_block``), instead of each expert's blocks round robin. Under
#: zipf routing the static deal piles the hot expert's long blocks onto programs that hold their share of the rest,
#: and runs write-bound light experts and compute-bound heavy ones one after another (the wgrads 1.30x / 1.38x
#: uniform routing's at deepseek-v3 / qwen3-30b-a3b on one H100, benchmarks/results/2026-12-07-defaults-step). The
#: same bits (GPU-tested). Off: on one H100 it took qwen3-30b-a3b's zipf wgrads from 3.24 to 2.54 ms but cost every
#: block a fixed ~1.5 us (deepseek-v3's uniform wgrads 14.67 -> 18.56 ms; benchmarks/results/2026-12-06-dynamic-wgrad),
#: the producer's chained round trips between blocks; with them hidden under a block held ahead the cost fell to
#: +2.0 ms / +2 % but the zipf gain went (benchmarks/results/2026-12-06-deal-rebuilt, call 9); taken before a
#: block's last loads it kept the zipf gain (2.55 ms) but uniform loads paid more again (deepseek-v3 14.52 -> 17.51
#: ms, qwen3-30b-a3b +7 %; call 11). ``MEGAMOE_WGRAD_DYNAMIC`` (0 or 1) sets it.
WGRAD_DYNAMIC = runtime.env_switch("MEGAMOE_WGRAD_DYNAMIC", False)

#: The Gluon wgrad deals the counter's order (experts heaviest first) by a fixed plan (``wgrad_planned``) where the
#: heaviest expert a launch computes has at least this many times their mean rows, else round robin: on one H100 the
#: plan ran zipf wgrads 0.75-0.91x the static deal's and uniform ones 1.07-1.09x, tying near 3.4x the mean
#: (benchmarks/results/2026-12-07-wgrad-planned, calls 25-27; docs/performance.md). The deal kernel tests it on the
#: device; the launch not picked does nothing (the plan's exits before its partitions: its no-op had cost even loads'
#: wgrads 0.5-1.7 %, benchmarks/results/2026-12-07-two-ended-tiles); either deal gives the same bits.
#: ``MEGAMOE_WGRAD_PLAN_SKEW`` (>= 0; 0: the plan alone, ``inf``: the static deal alone); with
#: ``MEGAMOE_WGRAD_DYNAMIC`` the counter deals.
WGRAD_PLAN_SKEW = runtime.env_ratio("MEGAMOE_WGRAD_PLAN_SKEW", 5.0)
runtime.retired_knob("MEGAMOE_WGRAD_PLANNED", "MEGAMOE_WGRAD_PLAN_SKEW=0 deals by the plan always, inf never "
                                              "(the default, 5, where the routing is skewed)")

DEAL_CHUNK = 32  # experts wgrad_deal_kernel compares each expert with at a time


def wgrad_blocks_per_expert(out_m: int, out_n: int, block_n: int) -> int:
    """The Gluon wgrad's blocks of one expert's `[out_m, out_n]` gradient (two 64-row halves by ``block_n``)."""
    return -(-out_m // (2 * HALF_M.value)) * -(-out_n // block_n)


def wgrad_deal(counts: torch.Tensor, offsets: torch.Tensor, modes: torch.Tensor | None,
               per_expert: int, skew: float = 0.0) -> torch.Tensor:
    """The dynamic and the planned deals' int32 `[2 + 4 L]` (``wgrad_ws_kernel``'s ``deal``): the block counter (0;
    the plan leaves it unread), the blocks to deal (every expert's, or with a window's ``modes`` those of the
    experts it computes; none where the heaviest of those has fewer than ``skew`` times their mean rows: the plan
    then deals nothing and the static deal's launch everything, :data:`WGRAD_PLAN_SKEW`), then the experts by their
    rows, heaviest first (the ones the window skips last, never dealt; ties in expert order), each as
    ``(expert, row0, row_end, 0)`` (``wgrad_dynamic.DEAL_FIELDS``). One launch of ``wgrad_deal_kernel`` (int32
    counts, offsets and modes; device work only)."""
    experts = counts.numel()
    deal = torch.empty(2 + 4 * experts, dtype=torch.int32, device=counts.device)
    wgrad_deal_kernel[(1,)](counts, offsets, counts if modes is None else modes, deal, experts, per_expert, skew,
                            HAS_MODES=modes is not None, EXPERTS=triton.next_power_of_2(max(experts, 1)),
                            CHUNK=DEAL_CHUNK, num_warps=4)
    return deal


def wgrad(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor,
          tile: TileConfig, programs: int, warp_specialized: bool = True,
          carry: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
          a_index: torch.Tensor | None = None, b_index: torch.Tensor | None = None) -> None:
    """``out[l] = a[rows of l]ᵀ · b[rows of l]`` for every expert l (a `[R, M]`, b `[R, N]`, out `[L, M, N]`,
    contiguous bf16; int32 offsets and counts): the expert weight gradient, rows reduced in order. ``carry``:
    ``(modes, carry_in, carry_out)`` of a backward window (``megamoe.kernels.wgrad_carry``). ``a_index`` /
    ``b_index``: int32 `[>= R]`, a is `[S, M]` / b `[S, N]` and row r's is ``a[a_index[r]]`` / ``b[b_index[r]]``
    (R: the rows of the other operand, or of ``offsets``' regions).

    On Hopper the warp-specialised Gluon kernel (`megamoe.kernels.wgrad_warp_specialized`; the indexed operand's
    rows gathered by its producer, b's as its A with the blocks stored transposed; two launches, the plan's and the
    static deal's, one of them a no-op: :data:`WGRAD_PLAN_SKEW`), elsewhere, under the
    interpreter and with ``warp_specialized=False`` ``wgrad_kernel`` (the indexed rows copied first): the same
    sums in the same order, the same bits (a GPU test holds them to it)."""
    experts, out_m, out_n = out.shape
    if a_index is not None and b_index is not None:
        raise ValueError("wgrad gathers one operand's rows, not both")
    if not experts:  # no gradient to write (and the deals' first entry would lie past an empty deal)
        return
    window = carry if carry is not None else (counts, out, out)  # never read without CARRY
    gluon = warp_specialized and warp_specialized_wgrad(a.device, tile)
    if not gathers_on_load(gluon, expert_ops.GATHER_BACKWARD, a if a_index is not None else b):  # the rows copied first
        if a_index is not None:
            a, a_index = gathered_rows(a, a_index, b.shape[0]), None
        if b_index is not None:
            b, b_index = gathered_rows(b, b_index, a.shape[0]), None
    with scratch_allocator():
        if gluon:
            # b gathered (x): as A, the blocks stored transposed (each x row then read once per 256 of out_m, not
            # per 128; the gatherer fetches A's 64-wide halves)
            out_t = b_index is not None
            if out_t:
                a, b, a_index, out_m, out_n = b, a, b_index, out_n, out_m
            args = (a, b, out, offsets, counts, experts, out_m, out_n, *window, counts if a_index is None else a_index)
            flags = dict(CARRY=carry is not None, A_GATHER=a_index is not None, OUT_T=out_t, num_warps=4)
            deal = None
            if WGRAD_DYNAMIC or WGRAD_PLAN_SKEW != math.inf:
                deal = wgrad_deal(counts, offsets, None if carry is None else carry[0],
                                  wgrad_blocks_per_expert(out_m, out_n, tile.block_n),
                                  0.0 if WGRAD_DYNAMIC else WGRAD_PLAN_SKEW)
                dealt_consts = wgrad_ws_constexprs(tile, programs, WGRAD_DYNAMIC, planned=not WGRAD_DYNAMIC)
                wgrad_warp_specialized.wgrad_ws_kernel[(programs,)](*args, deal_ptr=deal, **dealt_consts, **flags)
            if not WGRAD_DYNAMIC and WGRAD_PLAN_SKEW != 0:  # the static deal, a no-op where the plan dealt
                wgrad_warp_specialized.wgrad_ws_kernel[(programs,)](
                    *args, skip_ptr=None if deal is None else deal[1:], **wgrad_ws_constexprs(tile, programs), **flags)
            return
        tile = tile if carry is None else carry_tile(tile)
        expert_gemm_bwd.wgrad_kernel[(programs,)](
            a, b, out, offsets, counts, experts, out_m, out_n, *window, DOT_FP32=interpreting(),
            NUM_PROGRAMS=programs, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            FLATTEN=tile.flatten, CARRY=carry is not None, num_warps=tile.num_warps, num_stages=tile.num_stages)
