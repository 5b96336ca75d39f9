"""The launches the sm_90 build check compiles (``megamoe.tools.sm90``): one :class:`Case` per kernel and tile.

Groups:

- ``gemm``: the BF16 expert kernels (forward gate/up + SwiGLU, down; backward dact + SwiGLU', dx, wgrad, and
  the wgrad's warp-specialised Gluon kernel) at the planner's GPU tiles; the wgrads (here, in ``fp8`` and in
  ``mxfp8``) also with the backward window's carry (CARRY);
- ``fp8``: the FP8-block forward kernels at theirs;
- ``mxfp8``: the MXFP8 forward kernels (dequantise-on-load) and backward kernels, and the BF16 gate/ups (Triton
  and Gluon) with act rounded to the MXFP8 grid in the epilogue (MX_ROUND: MXFP8 run as the BF16 kernels);
- ``quant``: the quantiser at every tile the GPU test and the defaults use, hardware and software E4M3
  rounding (built from the launch's own arguments on meta tensors), and its rounding to the MXFP8 grid (ROUND);
- ``megakernel`` (:mod:`megamoe.tools.sm90_megakernel_cases`): the forward megakernel in each routed format
  (kimi-k2 rows) and its weighted sum;
- ``backward``: the backward megakernel (BF16), every role; the backward windows' row gather.

Over 450 lines: one table of launches, a function per group, each case beside its neighbours' tiles.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from megamoe.precision import FORMATS

#: The SM count the persistent grids are compiled for (H200).
SMS = 132
_TILES = {"tile_expert_ptr": "*i32", "tile_row0_ptr": "*i32", "tile_row_end_ptr": "*i32", "tile_run_ptr": "*i32",
          "num_tiles_ptr": "*i32"}
#: ``forward_warp_specialized.forward_ws_kernel``'s runtime arguments (gate/up, down, ping-pong down alike).
_FORWARD_WS = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "act_ptr": "*bf16", "b_ptr": "*bf16",
               "stride_a": "i32", "stride_out": "i32", "stride_act": "i32", **_TILES, "rows": "i32", "w_rows": "i32",
               "N": "i32", "K": "i32", "limit": "fp32", "alpha": "fp32", "a_index_ptr": "*i32"}
#: The wgrads' window carry (``megamoe.kernels.wgrad_carry``): its runtime arguments, compiled with CARRY on and off.
_CARRY = {"modes_ptr": "*i32", "carry_in_ptr": "*fp32", "carry_out_ptr": "*fp32", "CARRY": "constexpr"}


@dataclass(frozen=True)
class Case:
    """One launch to compile: kernel, argument types, constexprs, launch options (``attrs`` None: the
    16-divisibility hints of a launch with our sizes; else the JIT's own specialisation)."""

    kernel: object
    signature: dict
    constexprs: dict
    num_warps: int = 8
    num_stages: int = 3
    attrs: dict | None = None
    stack_pointer: bool = False  # add the quantiser's stack-pointer facts
    notes: dict = field(default_factory=dict)


def bound_launch(kernel, args: tuple, kwargs: dict, num_warps: int) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, attrs)`` that the JIT derives from a launch's own arguments (meta tensors
    will do): for kernels whose launches have odd strides, where the hints of :func:`compile_sm90` would
    not be what runs."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    _, signature, constexprs, attrs = kernel._pack_args(backend, {"num_warps": num_warps}, bound, specialization,
                                                        options)
    constexprs = {kernel.arg_names[path[0]]: value for path, value in constexprs.items()}  # by name, as the cases
    return signature, constexprs, attrs


#: The activation the cases build: gpt-oss's (the clamps and alpha: the most operations of the kinds).
ACT_BUILT = 2


def _row_task_consts(kernel, tile, **more) -> tuple[dict, dict]:
    """(signature entries, values) of the tile constexprs a row-task kernel declares, for TileConfig ``tile``."""
    values = dict(DOT_FP32=False, NUM_PROGRAMS=SMS, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                  BLOCK_K=tile.block_k, GROUP_M=tile.group_m, FLATTEN=tile.flatten, **more)
    values = {name: value for name, value in values.items() if name in kernel.arg_names}
    return {name: "constexpr" for name in values}, values


def _skipping_empty_halves(cases: dict, *names: str) -> dict[str, Case]:
    """``names``' Gluon row tiles with a tile of at most 64 rows in one warpgroup (``SKIP_EMPTY_HALF``, the
    ``megamoe.ops.experts`` switch: its own producer predicates and consumer branch)."""
    return {f"{name} (empty halves skipped)": dataclasses.replace(
        cases[name], constexprs={**cases[name].constexprs, "SKIP_EMPTY_HALF": True}) for name in names}


def gemm_cases() -> dict[str, Case]:
    from megamoe.kernels import dact_warp_specialized, expert_gemm, expert_gemm_bwd, forward_warp_specialized
    from megamoe.kernels import dx_warp_specialized, wgrad_warp_specialized
    from megamoe.ops.experts import forward_ws_constexprs
    from megamoe.ops.expert_wgrad import gathering_wgrad_tile, wgrad_ws_constexprs
    from megamoe.ops.experts_bwd import dact_ws_constexprs, dx_ws_constexprs
    from megamoe.planner.tiles import FEW_ROWS_PER_EXPERT, PING_PONG_MAX_K, carry_tile, ping_pong_tile, plan_tiles

    gpu = torch.device("cuda")
    cases = {}
    t = plan_tiles("gate_up", gpu)
    kinds, values = _row_task_consts(expert_gemm.gate_up_kernel, t, ACT=ACT_BUILT)
    cases["gate_up_kernel"] = Case(expert_gemm.gate_up_kernel, {
        "x_desc": f"tensordesc<bf16[{t.block_m},{t.block_k}]>", "w_desc": f"tensordesc<bf16[{t.block_n},{t.block_k}]>",
        "h_ptr": "*bf16", "act_ptr": "*bf16", "stride_h": "i32", "stride_act": "i32", **_TILES, **kinds,
        "I": "i32", "K": "i32", "limit": "fp32", "alpha": "fp32"}, values, t.num_warps, t.num_stages)
    # what gate_up runs on Hopper at the same tile: the warp-specialised Gluon kernel
    # (one rank's gate/up reads its tokens by index: A_GATHER)
    for name, gather in (("forward_ws_kernel (gate/up)", False), ("forward_ws_kernel (gate/up, x rows by token)", True)):
        consts = {**forward_ws_constexprs(t, SMS, gate_up=True, act=ACT_BUILT), "A_GATHER": gather}
        cases[name] = Case(forward_warp_specialized.forward_ws_kernel,
                           _FORWARD_WS | dict.fromkeys(consts, "constexpr"), consts, num_warps=4)
    # down in ping-pong (fine-grained experts' short K): the warpgroups take whole 128 x 128 tiles in turn
    pp = ping_pong_tile("down", plan_tiles("down", gpu), PING_PONG_MAX_K["down"])
    consts = forward_ws_constexprs(pp, SMS, gate_up=False, act=ACT_BUILT, ping_pong=True)
    cases["forward_ws_kernel (down, ping-pong)"] = Case(forward_warp_specialized.forward_ws_kernel,
                                                        _FORWARD_WS | dict.fromkeys(consts, "constexpr"), consts,
                                                        num_warps=4)
    t = plan_tiles("down", gpu)
    kinds, values = _row_task_consts(expert_gemm.down_kernel, t)
    cases["down_kernel"] = Case(expert_gemm.down_kernel, {
        "act_desc": f"tensordesc<bf16[{t.block_m},{t.block_k}]>", "w_desc": f"tensordesc<bf16[{t.block_n},{t.block_k}]>",
        "y_ptr": "*bf16", "stride_y": "i32", **_TILES, **kinds, "D": "i32", "K": "i32"}, values, t.num_warps,
        t.num_stages)
    t = plan_tiles("dact", gpu)
    kinds, values = _row_task_consts(expert_gemm_bwd.dact_swiglu_bwd_kernel, t, ACT=ACT_BUILT)
    cases["dact_swiglu_bwd_kernel"] = Case(expert_gemm_bwd.dact_swiglu_bwd_kernel, {
        "dy_desc": f"tensordesc<bf16[{t.block_m},{t.block_k}]>",
        "w_down_desc": f"tensordesc<bf16[{t.block_k},{t.block_n}]>", "h_ptr": "*bf16", "row_w_ptr": "*fp32",
        "d_h_ptr": "*bf16", "act_w_ptr": "*bf16", "d_w_partial_ptr": "*fp32", "stride_h": "i32",
        "stride_d_h": "i32", "stride_act_w": "i32", "stride_partial": "i32", **_TILES, **kinds, "D": "i32", "I": "i32",
        "limit": "fp32", "alpha": "fp32"}, values, t.num_warps, t.num_stages)
    # the Gluon dact that Hopper runs at the same tile
    # (mxfp8 as BF16 operands: d_h also rounded to the MXFP8 grid in the epilogue, one rank's d_out by token)
    for name, gather, grid in (("dact_ws_kernel", False, False), ("dact_ws_kernel (d_out rows by token)", True, False),
                               ("dact_ws_kernel (d_out by token, d_h on the MXFP8 grid)", True, True)):
        consts = {**dact_ws_constexprs(t, SMS, act=ACT_BUILT), "A_GATHER": gather, "D_H_GRID": grid}
        cases[name] = Case(dact_warp_specialized.dact_ws_kernel, {
            "dy_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16", "row_w_ptr": "*fp32", "d_h_ptr": "*bf16",
            "act_w_ptr": "*bf16", "d_w_partial_ptr": "*fp32", "stride_dy": "i32", "stride_h": "i32",
            "stride_d_h": "i32", "stride_act_w": "i32", "stride_partial": "i32", **_TILES, "rows": "i32",
            "w_rows": "i32", "D": "i32", "I": "i32", "limit": "fp32", "alpha": "fp32", "dy_index_ptr": "*i32",
            "d_h_grid_ptr": "*bf16", **dict.fromkeys(consts, "constexpr")}, consts, num_warps=4)
    # one rank stores each row's d_x straight into its route's slot (SCATTER): no push
    for name, t, scatter in (("dx_kernel", plan_tiles("dx", gpu), False),
                             ("dx_kernel (few rows per expert)", plan_tiles("dx", gpu, FEW_ROWS_PER_EXPERT), False),
                             ("dx_kernel (into the slots)", plan_tiles("dx", gpu), True)):
        kinds, values = _row_task_consts(expert_gemm_bwd.dx_kernel, t, SCATTER=scatter)
        cases[name] = Case(expert_gemm_bwd.dx_kernel, {
            "d_h_desc": f"tensordesc<bf16[{t.block_m},{t.block_k}]>",
            "w_gate_up_desc": f"tensordesc<bf16[{t.block_k},{t.block_n}]>", "d_x_ptr": "*bf16", "stride_d_x": "i32",
            "d_x_index_ptr": "*i32", **_TILES, **kinds, "D": "i32", "I": "i32"}, values, t.num_warps,
            t.num_stages)
    # what Hopper runs for dx at short K (2I <= PING_PONG_MAX_K["dx"]): the Gluon ping-pong, rows or slots
    pp = ping_pong_tile("dx", plan_tiles("dx", gpu), PING_PONG_MAX_K["dx"])
    # and, behind MEGAMOE_GLUON_DX, its cooperative form at the planner's 128-row tile
    dx_tile = plan_tiles("dx", gpu)
    for name, scatter, tile, ping in (("dx_ws_kernel (ping-pong)", False, pp, True),
                                      ("dx_ws_kernel (ping-pong, into the slots)", True, pp, True),
                                      ("dx_ws_kernel (cooperative)", False, dx_tile, False),
                                      ("dx_ws_kernel (cooperative, into the slots)", True, dx_tile, False)):
        consts = {**dx_ws_constexprs(tile, SMS, ping_pong=ping), "SCATTER": scatter}
        cases[name] = Case(dx_warp_specialized.dx_ws_kernel, {
            "d_h_ptr": "*bf16", "w_ptr": "*bf16", "d_x_ptr": "*bf16", "d_x_index_ptr": "*i32", "stride_d_h": "i32",
            "stride_d_x": "i32", **_TILES, "rows": "i32", "w_rows": "i32", "K": "i32", "N": "i32",
            **dict.fromkeys(consts, "constexpr")}, consts, num_warps=4)
    # each wgrad without and with the backward window's carry (the accumulator from and to FP32 blocks)
    wide, few = plan_tiles("wgrad", gpu), plan_tiles("wgrad", gpu, FEW_ROWS_PER_EXPERT)
    for name, t, carry in (("wgrad_kernel", wide, False), ("wgrad_kernel (few rows per expert)", few, False),
                           ("wgrad_kernel (carry)", wide, True),
                           ("wgrad_kernel (few rows per expert, carry)", few, True)):
        triton_tile = carry_tile(t) if carry else t  # what wgrad launches with a carry
        kinds, values = _row_task_consts(expert_gemm_bwd.wgrad_kernel, triton_tile, CARRY=carry)
        cases[name] = Case(expert_gemm_bwd.wgrad_kernel, {
            "a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "offsets_ptr": "*i32", "counts_ptr": "*i32",
            "num_experts": "i32", "OUT_M": "i32", "OUT_N": "i32", **_CARRY, **kinds}, values, triton_tile.num_warps,
            triton_tile.num_stages)
        # what expert_backward runs on Hopper at the same tile: the warp-specialised Gluon kernel; one rank's wgrads
        # read d_out (the down wgrad's A) and x (gate/up's, gathered as A: the blocks stored transposed) rows by
        # token, at the gathering tile
        gathers = (("", False, False), (" (d_out rows by token)", True, False), (" (x rows by token)", True, True))
        # (and, plain and gathering x, the other deals and stores: from a counter, ``WGRAD_DYNAMIC``; by the plan,
        # ``WGRAD_PLAN_SKEW``; each half stored whole, as before ``WGRAD_SPLIT_STORE``, its ring two slots shallower);
        # the static deal as it runs beside the plan's launch, reading whether the plan took its blocks (skip_ptr)
        variants = (("dynamic", dict(dynamic=True)), ("planned", dict(planned=True)),
                    ("whole halves", dict(split=False)))
        launches = [(suffix, a_gather, out_t, {}) for suffix, a_gather, out_t in gathers]
        launches += [(f" (x rows by token, {kind})" if a_gather else f" ({kind})", a_gather, out_t, choice)
                     for kind, choice in variants for _, a_gather, out_t in (gathers[0], gathers[2])]
        for suffix, a_gather, out_t, choice in launches if carry and t is wide else launches[:1]:
            t_ws = gathering_wgrad_tile(t) if a_gather else t
            static_deal = not (choice.get("dynamic") or choice.get("planned"))
            cases[name.replace("wgrad_kernel", "wgrad_ws_kernel") + suffix] = Case(wgrad_warp_specialized.wgrad_ws_kernel, {
                "a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "offsets_ptr": "*i32", "counts_ptr": "*i32",
                "num_experts": "i32", "OUT_M": "i32", "OUT_N": "i32", **_CARRY, "a_index_ptr": "*i32",
                "NUM_PROGRAMS": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
                "STAGES": "constexpr", "MMA_IN_FLIGHT": "constexpr", "A_GATHER": "constexpr", "OUT_T": "constexpr",
                "deal_ptr": "*i32", "DYNAMIC": "constexpr", "SPLIT_STORE": "constexpr", "PLANNED": "constexpr",
                "skip_ptr": "*i32" if static_deal else "constexpr"},
                {**wgrad_ws_constexprs(t_ws, SMS, **choice), "CARRY": carry, "A_GATHER": a_gather,
                 "OUT_T": out_t, **({} if static_deal else {"skip_ptr": None})}, num_warps=4)
    return {**cases, **_skipping_empty_halves(cases, "forward_ws_kernel (gate/up)",
                                              "forward_ws_kernel (gate/up, x rows by token)",
                                              "forward_ws_kernel (down, ping-pong)", "dact_ws_kernel",
                                              "dact_ws_kernel (d_out rows by token)", "dx_ws_kernel (ping-pong)",
                                              "dx_ws_kernel (cooperative)")}


def fp8_cases() -> dict[str, Case]:
    from megamoe.kernels import expert_gemm_fp8 as k, forward_fp8_warp_specialized as ws
    from megamoe.ops.experts_fp8 import forward_fp8_ws_constexprs
    from megamoe.planner.tiles import FEW_ROWS_PER_EXPERT, plan_tiles_fp8

    gpu = torch.device("cuda")
    cases = {}
    for name, t in (("gate_up_fp8_kernel", plan_tiles_fp8("gate_up", gpu)),
                    ("gate_up_fp8_kernel (few rows per expert)", plan_tiles_fp8("gate_up", gpu, FEW_ROWS_PER_EXPERT))):
        kinds, values = _row_task_consts(k.gate_up_fp8_kernel, t, ACT=ACT_BUILT, STORE_H=True, SOFT_E4M3=False)
        cases[name] = Case(k.gate_up_fp8_kernel, {
            "x_desc": f"tensordesc<fp8e4nv[{t.block_m},128]>", "w_desc": f"tensordesc<fp8e4nv[{t.block_n},128]>",
            "x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "h_ptr": "*bf16", "act_q_ptr": "*u8",
            "act_scale_ptr": "*fp32", "stride_xs": "i32", "stride_ws_n": "i32", "stride_h": "i32",
            "stride_act": "i32", "stride_as": "i32", **_TILES, **kinds, "I": "i32", "K": "i32", "limit": "fp32",
            "alpha": "fp32"},
            values, t.num_warps, t.num_stages)
    t = plan_tiles_fp8("down", gpu)
    kinds, values = _row_task_consts(k.down_fp8_kernel, t)
    down = Case(k.down_fp8_kernel, {
        "act_desc": f"tensordesc<fp8e4nv[{t.block_m},128]>", "w_desc": f"tensordesc<fp8e4nv[{t.block_n},128]>",
        "act_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "y_ptr": "*bf16", "stride_as": "i32",
        "stride_ws_n": "i32", "stride_y": "i32", **_TILES, **kinds, "D": "i32", "K": "i32"},
        values, t.num_warps, t.num_stages)
    cases["down_fp8_kernel"] = down
    # the FP8 backward's dx into its rows' slots (one rank)
    cases["down_fp8_kernel (rows into slots)"] = dataclasses.replace(
        down, signature={**down.signature, "y_index_ptr": "*i32"})
    # what gate_up_fp8 / down_fp8 run on Hopper at the same tiles: the warp-specialised Gluon kernel
    for kind, gate_up in (("gate/up", True), ("down", False)):
        t = plan_tiles_fp8("gate_up" if gate_up else "down", gpu)
        consts = forward_fp8_ws_constexprs(t, SMS, gate_up=gate_up, act=ACT_BUILT)
        consts["SOFT_E4M3"] = False
        cases[f"forward_fp8_ws_kernel ({kind})"] = Case(ws.forward_fp8_ws_kernel, {
            "a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32",
            "out_ptr": "*bf16", "act_q_ptr": "*u8" if gate_up else "*bf16", "act_scale_ptr": "*fp32" if gate_up
            else "*bf16", "b_ptr": "*bf16", "stride_a": "i32", "stride_as_in": "i32", "stride_ws_n": "i32", "stride_out": "i32",
            "stride_act": "i32", "stride_as": "i32", **_TILES, "rows": "i32", "w_rows": "i32", "N": "i32",
            "K": "i32", "limit": "fp32", "alpha": "fp32", "out_index_ptr": "*bf16",
            **dict.fromkeys(consts, "constexpr")}, consts, num_warps=4)
    ws_down = cases["forward_fp8_ws_kernel (down)"]
    cases["forward_fp8_ws_kernel (down, rows into slots)"] = dataclasses.replace(
        ws_down, signature={**ws_down.signature, "out_index_ptr": "*i32", "SCATTER": "constexpr"},
        constexprs={**ws_down.constexprs, "SCATTER": True})
    cases.update(fp8_backward_cases())
    return {**cases, **_skipping_empty_halves(cases, "forward_fp8_ws_kernel (gate/up)", "forward_fp8_ws_kernel (down)",
                                              "dact_fp8_ws_kernel")}


def fp8_backward_cases() -> dict[str, Case]:
    from megamoe.kernels import dact_warp_specialized as dact_ws, expert_gemm_fp8_bwd as k
    from megamoe.kernels import wgrad_fp8_warp_specialized as ws
    from megamoe.ops.experts_bwd import dact_ws_constexprs
    from megamoe.ops.experts_fp8_bwd import wgrad_fp8_ws_constexprs
    from megamoe.planner.tiles import plan_tiles_fp8_bwd

    gpu = torch.device("cuda")
    t = plan_tiles_fp8_bwd("dact", gpu)
    kinds, values = _row_task_consts(k.dact_fp8_kernel, t, ACT=ACT_BUILT)
    dact = Case(k.dact_fp8_kernel, {
        "dy_desc": f"tensordesc<fp8e4nv[{t.block_m},128]>", "w_t_desc": f"tensordesc<fp8e4nv[{t.block_n},128]>",
        "dy_scale_ptr": "*fp32", "w_t_scale_ptr": "*fp32", "h_ptr": "*bf16", "row_w_ptr": "*fp32",
        "d_h_ptr": "*bf16", "act_w_ptr": "*bf16", "d_w_partial_ptr": "*fp32", "stride_dys": "i32",
        "stride_ws_n": "i32", "stride_h": "i32", "stride_d_h": "i32", "stride_act_w": "i32",
        "stride_partial": "i32", **_TILES, **kinds, "D": "i32", "I": "i32", "limit": "fp32", "alpha": "fp32"},
        values, t.num_warps, t.num_stages)
    t = plan_tiles_fp8_bwd("wgrad", gpu)
    cases = {"dact_fp8_kernel": dact}
    for name, carry in (("wgrad_fp8_kernel", False), ("wgrad_fp8_kernel (carry)", True)):  # the window's carry
        kinds, values = _row_task_consts(k.wgrad_fp8_kernel, t, CARRY=carry)
        cases[name] = Case(k.wgrad_fp8_kernel, {
            "a_desc": f"tensordesc<fp8e4nv[{t.block_m},128]>", "b_desc": f"tensordesc<fp8e4nv[{t.block_n},128]>",
            "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32", "out_ptr": "*bf16", "block0_ptr": "*i32",
            "counts_ptr": "*i32", "num_experts": "i32", "OUT_M": "i32", "OUT_N": "i32", "stride_as": "i32",
            "stride_bs": "i32", **_CARRY, **kinds}, values, t.num_warps, t.num_stages)
    # what expert_backward_fp8_block runs on Hopper at the same blocks: the warp-specialised Gluon wgrad
    # (and its A/B knob: the scales by TMA into the ring's slots), and the Gluon dact at the dact's tile
    consts = dact_ws_constexprs(plan_tiles_fp8_bwd("dact", gpu), SMS, act=ACT_BUILT)
    cases["dact_fp8_ws_kernel"] = Case(dact_ws.dact_fp8_ws_kernel, {
        "dy_ptr": "*fp8e4nv", "w_t_ptr": "*fp8e4nv", "dy_scale_ptr": "*fp32", "w_t_scale_ptr": "*fp32",
        "h_ptr": "*bf16", "row_w_ptr": "*fp32", "d_h_ptr": "*bf16", "act_w_ptr": "*bf16", "d_w_partial_ptr": "*fp32",
        "stride_dy": "i32", "stride_dys": "i32", "stride_ws_n": "i32", "stride_h": "i32", "stride_d_h": "i32",
        "stride_act_w": "i32", "stride_partial": "i32", **_TILES, "rows": "i32", "w_rows": "i32", "D": "i32",
        "I": "i32", "limit": "fp32", "alpha": "fp32", **dict.fromkeys(consts, "constexpr")}, consts, num_warps=4)
    for name, consts in (("wgrad_fp8_ws_kernel", wgrad_fp8_ws_constexprs(SMS)),
                         ("wgrad_fp8_ws_kernel (4 stages)", wgrad_fp8_ws_constexprs(SMS, stages=4)),
                         ("wgrad_fp8_ws_kernel (carry)", {**wgrad_fp8_ws_constexprs(SMS), "CARRY": True})):
        cases[name] = Case(ws.wgrad_fp8_ws_kernel, {
            "a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32",
            "out_ptr": "*bf16", "block0_ptr": "*i32", "counts_ptr": "*i32", "num_experts": "i32", "OUT_M": "i32",
            "OUT_N": "i32", "K_PAD": "i32", "stride_as": "i32", "stride_bs": "i32", **_CARRY,
            **dict.fromkeys(consts, "constexpr")}, {"CARRY": False, **consts}, num_warps=4)
    return cases


def mxfp8_cases() -> dict[str, Case]:
    from megamoe.kernels import expert_gemm_mxfp8 as k
    from megamoe.planner.tiles import plan_tiles_mxfp8

    cases = {}
    for kind in ("gate_up", "down"):
        t = plan_tiles_mxfp8(kind, torch.device("cuda"), compiled=True)
        a = f"tensordesc<fp8e4nv[{t.block_m},{t.block_k}]>"
        w = f"tensordesc<fp8e4nv[{t.block_n},{t.block_k}]>"
        if kind == "gate_up":
            kernel = k.gate_up_mxfp8_kernel
            kinds, values = _row_task_consts(kernel, t, ACT=ACT_BUILT, STORE_H=True, SOFT_E4M3=False)
            signature = {"x_desc": a, "w_desc": w, "x_scale_ptr": "*u8", "w_scale_ptr": "*u8",
                         "h_ptr": "*bf16", "act_q_ptr": "*u8", "act_scale_ptr": "*u8", "stride_xs": "i32",
                         "stride_ws": "i32", "stride_h": "i32", "stride_act": "i32", "stride_as": "i32",
                         **_TILES, **kinds, "I": "i32", "W_ROWS": "i32", "K": "i32", "limit": "fp32",
                         "alpha": "fp32"}
        else:
            kernel = k.down_mxfp8_kernel
            kinds, values = _row_task_consts(kernel, t)
            signature = {"act_desc": a, "w_desc": w, "act_scale_ptr": "*u8", "w_scale_ptr": "*u8",
                         "y_ptr": "*bf16", "stride_as": "i32", "stride_ws": "i32", "stride_y": "i32",
                         **_TILES, **kinds, "D": "i32", "W_ROWS": "i32", "K": "i32"}
        cases[f"{kind}_dequant"] = Case(kernel, signature, values, t.num_warps, t.num_stages)
    return {**cases, **mxfp8_backward_cases(), **mxfp8_as_bf16_cases()}


def mxfp8_as_bf16_cases() -> dict[str, Case]:
    """MXFP8 run as the BF16 expert kernels (``megamoe.ops.experts_mxfp8_bf16``): the gate/up with act rounded to the
    MX grid in its epilogue (MX_ROUND), Triton and the Gluon kernel Hopper runs (one rank: x rows by token), at the
    BF16 planner's GPU tile; the rest are the BF16 kernels as built in ``gemm``."""
    from megamoe.kernels import expert_gemm, forward_warp_specialized
    from megamoe.ops.experts import forward_ws_constexprs
    from megamoe.planner.tiles import plan_tiles

    t = plan_tiles("gate_up", torch.device("cuda"))
    kinds, values = _row_task_consts(expert_gemm.gate_up_kernel, t, ACT=ACT_BUILT, MX_ROUND=True)
    cases = {"gate_up_kernel (act on the MX grid)": Case(expert_gemm.gate_up_kernel, {
        "x_desc": f"tensordesc<bf16[{t.block_m},{t.block_k}]>", "w_desc": f"tensordesc<bf16[{t.block_n},{t.block_k}]>",
        "h_ptr": "*bf16", "act_ptr": "*bf16", "stride_h": "i32", "stride_act": "i32", **_TILES, **kinds,
        "I": "i32", "K": "i32", "limit": "fp32", "alpha": "fp32"}, values, t.num_warps, t.num_stages)}
    for name, gather in (("forward_ws_kernel (gate/up, act on the MX grid)", False),
                         ("forward_ws_kernel (gate/up, x rows by token, act on the MX grid)", True)):
        consts = {**forward_ws_constexprs(t, SMS, gate_up=True, act=ACT_BUILT), "A_GATHER": gather, "MX_ROUND": True}
        cases[name] = Case(forward_warp_specialized.forward_ws_kernel,
                           _FORWARD_WS | dict.fromkeys(consts, "constexpr"), consts, num_warps=4)
    return cases


def mxfp8_backward_cases() -> dict[str, Case]:
    from megamoe.kernels import expert_gemm_mxfp8_bwd as k
    from megamoe.planner.tiles import plan_tiles_fp8_bwd

    gpu = torch.device("cuda")
    t = plan_tiles_fp8_bwd("dact", gpu, "mxfp8", compiled=True)
    kinds, values = _row_task_consts(k.dact_mxfp8_kernel, t, ACT=ACT_BUILT)
    dact = Case(k.dact_mxfp8_kernel, {
        "dy_desc": f"tensordesc<fp8e4nv[{t.block_m},{t.block_k}]>",
        "w_t_desc": f"tensordesc<fp8e4nv[{t.block_n},{t.block_k}]>", "dy_scale_ptr": "*u8", "w_t_scale_ptr": "*u8",
        "h_ptr": "*bf16", "row_w_ptr": "*fp32", "d_h_ptr": "*bf16", "act_w_ptr": "*bf16", "d_w_partial_ptr": "*fp32",
        "stride_dys": "i32", "stride_ws": "i32", "stride_h": "i32", "stride_d_h": "i32", "stride_act_w": "i32",
        "stride_partial": "i32", **_TILES, **kinds, "D": "i32", "I": "i32", "W_ROWS": "i32", "limit": "fp32",
        "alpha": "fp32"},
        values, t.num_warps, t.num_stages)
    t = plan_tiles_fp8_bwd("wgrad", gpu, "mxfp8", compiled=True)
    cases = {"dact_dequant": dact}
    for name, carry in (("wgrad_dequant", False), ("wgrad_dequant (carry)", True)):  # the window's carry
        kinds, values = _row_task_consts(k.wgrad_mxfp8_kernel, t, CARRY=carry)
        cases[name] = Case(k.wgrad_mxfp8_kernel, {
            "a_desc": f"tensordesc<fp8e4nv[{t.block_m},{t.block_k}]>",
            "b_desc": f"tensordesc<fp8e4nv[{t.block_n},{t.block_k}]>", "a_scale_ptr": "*u8", "b_scale_ptr": "*u8",
            "out_ptr": "*bf16", "span0_ptr": "*i32", "counts_ptr": "*i32", "num_experts": "i32", "OUT_M": "i32",
            "OUT_N": "i32", "K": "i32", "stride_as": "i32", "stride_bs": "i32", **_CARRY, **kinds}, values,
            t.num_warps, t.num_stages)
    return cases


def quant_cases() -> dict[str, Case]:
    """The launches of tests/test_formats.py::test_compiled_kernels_match_torch_on_gpu (its explicit tile and
    every default tile), with the hardware and with the software E4M3 rounding, from the launch's own
    arguments. (benchmarks/quant_bench.py checks its sweep tiles on the GPU.)"""
    from megamoe.kernels.quant import quantize_kernel
    from megamoe.ops.quant import QuantConfig, block_of, default_config, planned_launch

    launches = []
    for fmt in FORMATS:
        for axis in (1, 0):
            for transpose in (False, True):
                d = default_config(block_of(fmt, axis))
                gpu_test_tile = (128, 128 if axis == 0 and fmt == "fp8-block" else 256, 8)
                for bm, bk, nw in sorted({(d.block_m, d.block_k, d.num_warps), gpu_test_tile}):
                    for soft in (False, True):
                        launches.append(dict(shape=(4096, 7168), fmt=fmt, axis=axis, transpose=transpose,
                                             config=QuantConfig(bm, bk, nw, soft_e4m3=soft)))
    for fmt, axis in (("mxfp8", -1), ("mxfp8", -2), ("fp8-block", -1)):
        for soft in (False, True):
            d = default_config(block_of(fmt, axis + 2, weights=True))
            launches.append(dict(shape=(4, 1024, 2048), fmt=fmt, axis=axis, weights=True,
                                 config=QuantConfig(d.block_m, d.block_k, d.num_warps, soft_e4m3=soft)))
    for fmt in FORMATS:  # the FP8 backward's token-axis operands (ops.experts_fp8_bwd.quantize_tokens), BF16
        for src_fmt in (None, fmt):  # rows or E4M3 ones (the ring's x, the pulled d_out)
            launches.append(dict(shape=(65536, 2048), fmt=fmt, axis=0, transpose=True, rows=65536 + 128 * 192,
                                 scale_transpose=fmt == "mxfp8", config=default_config(block_of(fmt, 0)),
                                 src_fmt=src_fmt))
    cases = {}
    for launch in launches:
        args, kwargs, warps = planned_launch(**launch)
        signature, constexprs, attrs = bound_launch(quantize_kernel, args, kwargs, warps)
        c = launch["config"]
        name = (f"{'w' if launch.get('weights') else 'act'} {launch['fmt']} axis={launch['axis']}"
                f"{' ->T' if launch.get('transpose') else ''}{' gather' if launch.get('rows') else ''}"
                f"{' from ' + launch['src_fmt'] if launch.get('src_fmt') else ''}"
                f" tile {c.block_m}x{c.block_k} w{c.num_warps}"
                f"{' soft' if c.soft_e4m3 else ''}")
        cases[name] = Case(quantize_kernel, signature, constexprs, warps, 1, attrs, stack_pointer=True)
    # MXFP8 as BF16 operands (mx_round_weights / mx_round_activations: ROUND, bf16 out): the pack's weights along
    # either axis, rows along D (E4M3 rows dequantised, or BF16 rounded), the wgrads' token blocks (gathered)
    rounded = [dict(shape=(4, 1024, 2048), fmt="mxfp8", axis=axis, weights=True) for axis in (-1, -2)]
    rounded += [dict(shape=(4096, 7168), fmt="mxfp8", axis=1, src_fmt=src) for src in (None, "mxfp8")]
    rounded += [dict(shape=(65536, 2048), fmt="mxfp8", axis=0, rows=65536 + 128 * 192, src_fmt=src)
                for src in (None, "mxfp8")]
    for launch in rounded:
        ax = launch["axis"] + (2 if launch.get("weights") else 0)
        launch["config"] = default_config(block_of("mxfp8", ax, weights=bool(launch.get("weights"))))
        args, kwargs, warps = planned_launch(**launch, rounded=True)
        signature, constexprs, attrs = bound_launch(quantize_kernel, args, kwargs, warps)
        c = launch["config"]
        name = (f"{'w' if launch.get('weights') else 'act'} mxfp8 rounded axis={launch['axis']}"
                f"{' gather' if launch.get('rows') else ''}{' from mxfp8' if launch.get('src_fmt') else ''}"
                f" tile {c.block_m}x{c.block_k} w{c.num_warps}")
        cases[name] = Case(quantize_kernel, signature, constexprs, warps, 1, attrs, stack_pointer=True)
    return cases
