"""The sm_90 build check's cases of the megakernels (``megamoe.tools.sm90``): the groups ``megakernel`` (the forward
megakernel in each routed format and its weighted sum) and ``backward`` (the backward megakernel, the windows' row
gather and window table). The expert kernels' groups are in :mod:`megamoe.tools.sm90_cases`."""

from __future__ import annotations

import torch

from megamoe.tools.sm90_cases import ACT_BUILT, Case


#: The megakernel's launch on an H200 (kimi-k2 rows: D = 7168, k = 8), by format:
#: (FMT, BN_GU, BN_DN, BLOCK_K, activation element type, scale type).
_MEGA_TILES = {
    "bf16": (0, 128, 256, 64, "bf16", "fp32"),
    "mxfp8": (1, 64, 128, 64, "fp8e4nv", "u8"),
    "fp8-block": (2, 128, 128, 128, "fp8e4nv", "fp32"),
}


def megakernel_case(fmt: str, biases: bool = False) -> Case:
    """The forward megakernel for routed format ``fmt`` (FP8: the comm workers copy the owners' E4M3 rows and
    scales); ``biases``: with the routed experts' biases (else their pointers are None: the adds compile out)."""
    from megamoe.kernels import megakernel as mk
    from megamoe.planner.tiles import MAX_TILE_STAGES
    from megamoe.megakernel.launch_args import copy_tile_consts
    from megamoe.precision import SCALE_BLOCK

    code, bn_gu, bn_dn, bk, elem, scale = _MEGA_TILES[fmt]
    consts = dict(TOP_K=8, HAS_SHARED=True, ACT=0,
                  DOT_FP32=False, FENCE=True, BLOCK_M=128, BN_GU=bn_gu, BN_DN=bn_dn, BLOCK_K=bk, GROUP_GU=4,
                  GROUP_DN=8, PHASE=0, TRACE=False, FMT=code, SOFT_E4M3=False, SHARED_BN_GU=128, SHARED_BN_DN=256,
                  SHARED_BK=64)
    if not biases:
        consts.update(b_gate_up_ptr=None, b_down_ptr=None)
    quantized = code != 0
    block = SCALE_BLOCK[fmt]
    scale_bytes = 1 if fmt == "mxfp8" else 4
    consts.update(copy_tile_consts(7168, block, (7168 // block, scale_bytes) if quantized else None))
    descs = {"ring_desc": (elem, 128, bk), "w_gate_up_desc": (elem, bn_gu, bk), "act_desc": (elem, 128, bk),
             "w_down_desc": (elem, bn_dn, bk), "shared_x_desc": ("bf16", 128, 64),
             "shared_w_gate_up_desc": ("bf16", 128, 64), "shared_act_desc": ("bf16", 128, 64),
             "shared_w_down_desc": ("bf16", 256, 64)}
    signature = {}
    for name in mk.megakernel.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in descs:
            e, rows, cols = descs[name]
            signature[name] = f"tensordesc<{e}[{rows},{cols}]>"
        elif name in ("rows_peer_ptrs", "scales_peer_ptrs", "combine_peer_ptrs", "flag_peer_ptrs",
                      "trace_base_ptr"):
            signature[name] = "*i64"
        elif name in ("rows_ptr", "ring_ptr", "act_ptr"):
            signature[name] = "*u8" if quantized else "*bf16"
        elif name in ("ring_scale_ptr", "w_gate_up_scale_ptr", "act_scale_ptr", "w_down_scale_ptr"):
            signature[name] = f"*{scale}"
        elif name == "scales_ptr":
            signature[name] = f"*{scale}" if quantized else "*bf16"
        elif name in ("combine_ptr", "h_ptr", "y_ptr", "shared_h_ptr", "shared_act_ptr", "shared_y_ptr",
                      "b_gate_up_ptr", "b_down_ptr"):
            signature[name] = "*bf16"
        elif name.endswith("_ptr"):
            signature[name] = "*i32"
        else:
            signature[name] = "fp32" if name in ("limit", "alpha") else "i32"
    return Case(mk.megakernel, signature, consts, num_stages=MAX_TILE_STAGES)  # the deepest ring must fit


def backward_megakernel_case() -> Case:
    """The backward megakernel (BF16) as it launches on an H200 for kimi-k2 rows (D 7168, k 8), with a shared
    expert and the clamp, every role compiled (PHASE 0)."""
    from megamoe.kernels import megakernel_bwd as mkb
    from megamoe.megakernel.launch_args import copy_tile_consts
    from megamoe.planner.tiles import plan_tiles

    gpu = torch.device("cuda")
    da, dx, wg = (plan_tiles(kind, gpu) for kind in ("dact", "dx", "wgrad"))
    rows = copy_tile_consts(7168, 1, None)
    consts = dict(TOP_K=8, CHUNKS=rows["CHUNKS"], CP=rows["CP"], W=rows["W"], ROWS=rows["ROWS"], ALIGN=rows["ALIGN"],
                  HAS_SHARED=True, ACT=ACT_BUILT, DOT_FP32=False, FENCE=True, BLOCK_M=128, BN_DA=da.block_n,
                  BK_DA=da.block_k, BN_DX=dx.block_n, BK_DX=dx.block_k, BM_W=wg.block_m, BN_W=wg.block_n,
                  BK_W=wg.block_k, GROUP_M=da.group_m, PHASE=0, TRACE=False)
    descs = {"dy_desc": (128, da.block_k), "w_down_desc": (da.block_k, da.block_n), "d_h_desc": (128, dx.block_k),
             "w_gate_up_k_desc": (dx.block_k, dx.block_n), "shared_dy_desc": (128, da.block_k),
             "shared_w_down_desc": (da.block_k, da.block_n), "shared_d_h_desc": (128, dx.block_k),
             "shared_w_gate_up_k_desc": (dx.block_k, dx.block_n)}
    fp32 = {"row_w_ptr", "partial_ptr", "d_router_ptr", "ones_ptr", "shared_partial_ptr", "down_in_ptr", "down_out_ptr",
            "gate_up_in_ptr", "gate_up_out_ptr"}
    signature = {}
    for name in mkb.megakernel_bwd.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in descs:
            signature[name] = "tensordesc<bf16[{},{}]>".format(*descs[name])
        elif name.endswith("peer_ptrs") or name == "trace_base_ptr":
            signature[name] = "*i64"
        elif name in fp32:
            signature[name] = "*fp32"
        elif name in ("d_out_ptr", "x_ptr", "dy_ptr", "x_rows_ptr", "slots_ptr", "ring_h_ptr", "d_h_ptr",
                      "act_w_ptr", "dx_ptr", "d_w_down_ptr", "d_w_gate_up_ptr", "shared_h_ptr", "shared_d_h_ptr",
                      "shared_act_w_ptr", "shared_dx_ptr", "d_shared_down_ptr", "d_shared_gate_up_ptr"):
            signature[name] = "*bf16"
        elif name.endswith("_ptr"):
            signature[name] = "*i32"
        else:
            signature[name] = "fp32" if name in ("limit", "alpha") else "i32"
    return Case(mkb.megakernel_bwd, signature, consts, da.num_warps, da.num_stages)


def weighted_sum_case() -> Case:
    from megamoe.kernels.weighted_sum import weighted_sum_kernel
    from megamoe.ops.weighted_sum import WEIGHTED_SUM_TILE

    block_t, block_d, warps = WEIGHTED_SUM_TILE
    signature = {name: "*bf16" for name in ("y_ptr", "combine_ptr", "shared_y_ptr", "out_ptr")}
    signature.update(own_rows_ptr="*i32", top_experts_ptr="*i32", router_weights_ptr="*fp32")
    consts = dict(TOP_K=8, HAS_SHARED=True, BLOCK_T=block_t, BLOCK_D=block_d)
    signature.update({name: "constexpr" for name in consts})
    signature.update({name: "i32" for name in weighted_sum_kernel.arg_names if name not in signature})
    # one 16-byte load per thread and vector of each slot's rows (and of the shared output): two per slot, as
    # a masked pair, took twice the time (2026-11-30-qwen-pass)
    return Case(weighted_sum_kernel, signature, consts, warps,
                notes={"top_k": 8, "has_shared": True, "block_t": block_t, "block_d": block_d, "num_warps": warps})


def gather_rows_case() -> Case:
    """The backward windows' read of the forward ring's h (``megamoe.ops.gather_rows``): kimi-k2's 2I = 4096 bf16
    columns."""
    from megamoe.kernels.gather_rows import gather_rows_kernel
    from megamoe.ops.gather_rows import BLOCK_BYTES, BLOCK_ROWS

    consts = dict(BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_BYTES // 2)
    signature = dict(src_ptr="*bf16", stride_src="i32", index_ptr="*i64", dst_ptr="*bf16", stride_dst="i32",
                     num_rows_ptr="*i32", width="i32", **dict.fromkeys(consts, "constexpr"))
    return Case(gather_rows_kernel, signature, consts, 4)


def window_table_case() -> Case:
    """One backward window's table (``megamoe.routing.windows``, one launch per window): kimi-k2's 384 experts
    of a rank at EP 1."""
    from megamoe.kernels.window_table import window_table_kernel
    from megamoe.routing.windows import WINDOW_ALIGN, WINDOW_TABLE_BLOCK

    consts = dict(EXPERTS=512, BLOCK=WINDOW_TABLE_BLOCK, ALIGN=WINDOW_ALIGN)
    signature = {name: "*i32" for name in window_table_kernel.arg_names if name.endswith("_ptr")}
    signature.update(start_ptr="*i64", w_rows_ptr="*i64", **dict.fromkeys(consts, "constexpr"))
    signature.update({name: "i32" for name in window_table_kernel.arg_names if name not in signature})
    return Case(window_table_kernel, signature, consts, 4)


def wgrad_deal_case() -> Case:
    """The Gluon wgrad's deal (``megamoe.ops.expert_wgrad.wgrad_deal``, one launch a dealt wgrad): kimi-k2's 384
    experts of a rank at EP 1, a window's modes."""
    from megamoe.kernels.wgrad_deal import wgrad_deal_kernel
    from megamoe.ops.expert_wgrad import DEAL_CHUNK

    consts = dict(HAS_MODES=True, EXPERTS=512, CHUNK=DEAL_CHUNK)
    signature = {name: "*i32" for name in wgrad_deal_kernel.arg_names if name.endswith("_ptr")}
    signature.update(experts="i32", per_expert="i32", skew="fp32", **dict.fromkeys(consts, "constexpr"))
    return Case(wgrad_deal_kernel, signature, consts, 4)


def megakernel_cases() -> dict[str, Case]:
    return {"weighted_sum": weighted_sum_case(), **{fmt: megakernel_case(fmt) for fmt in _MEGA_TILES}}


def backward_cases() -> dict[str, Case]:
    return {"bf16": backward_megakernel_case(), "gather_rows": gather_rows_case(), "window_table": window_table_case(),
            "wgrad_deal": wgrad_deal_case()}
