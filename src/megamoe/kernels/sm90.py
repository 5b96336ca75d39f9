"""Compile the GEMM kernels for Hopper (sm_90) without a GPU and summarise the code.

`python -m megamoe.kernels.sm90` prints, per kernel, whether the PTX uses
wgmma tensor-core instructions and TMA bulk copies, and its shared memory;
`python -m megamoe.kernels.sm90 megakernel` does the same for the forward
megakernel in each routed format (plus its async-proxy fences). Tests run
them in a subprocess (the interpreter must be off to compile).
"""

from __future__ import annotations

import json
import os
import re

_COMMON = {"tile_expert_ptr": "*i32", "tile_row0_ptr": "*i32", "tile_row_end_ptr": "*i32", "num_tiles_ptr": "*i32",
           "DOT_FP32": "constexpr", "NUM_PROGRAMS": "constexpr", "BLOCK_M": "constexpr",
           "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "GROUP_M": "constexpr", "FLATTEN": "constexpr"}


def _cases():
    from megamoe.kernels import expert_gemm, expert_gemm_bwd

    rows_tiles = _COMMON
    return {
        "gate_up_kernel": (
            expert_gemm.gate_up_kernel,
            {"x_desc": "tensordesc<bf16[128,64]>", "w_desc": "tensordesc<bf16[128,64]>", "h_ptr": "*bf16",
             "act_ptr": "*bf16", "stride_h": "i32", "stride_act": "i32", **_COMMON, "I": "i32", "K": "i32",
             "limit": "fp32", "HAS_LIMIT": "constexpr"},
            {"HAS_LIMIT": True, "BLOCK_N": 128},
        ),
        "down_kernel": (
            expert_gemm.down_kernel,
            {"act_desc": "tensordesc<bf16[128,64]>", "w_desc": "tensordesc<bf16[256,64]>", "y_ptr": "*bf16",
             "stride_y": "i32", **_COMMON, "D": "i32", "K": "i32"},
            {"BLOCK_N": 256},
        ),
        "dact_swiglu_bwd_kernel": (
            expert_gemm_bwd.dact_swiglu_bwd_kernel,
            {"dy_desc": "tensordesc<bf16[128,64]>", "w_down_desc": "tensordesc<bf16[64,128]>", "h_ptr": "*bf16",
             "row_w_ptr": "*fp32", "d_h_ptr": "*bf16", "act_w_ptr": "*bf16", "d_w_partial_ptr": "*fp32",
             "stride_h": "i32", "stride_d_h": "i32", "stride_act_w": "i32", "stride_partial": "i32", **rows_tiles,
             "D": "i32", "I": "i32", "limit": "fp32", "HAS_LIMIT": "constexpr"},
            {"HAS_LIMIT": True, "BLOCK_N": 128},
        ),
        "dx_kernel": (
            expert_gemm_bwd.dx_kernel,
            {"d_h_desc": "tensordesc<bf16[128,64]>", "w_gate_up_desc": "tensordesc<bf16[64,256]>", "d_x_ptr": "*bf16",
             "stride_d_x": "i32", **rows_tiles, "D": "i32", "I": "i32"},
            {"BLOCK_N": 256},
        ),
        "wgrad_kernel": (
            expert_gemm_bwd.wgrad_kernel,
            {"a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "offsets_ptr": "*i32", "counts_ptr": "*i32",
             "num_experts": "i32", "OUT_M": "i32", "OUT_N": "i32", "DOT_FP32": "constexpr",
             "NUM_PROGRAMS": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
             "FLATTEN": "constexpr"},
            {"BLOCK_N": 256},
        ),
    }


def compile_sm90(kernel, signature: dict, constexprs: dict, num_warps: int = 8, num_stages: int = 3):
    """The compiled kernel for sm_90 (the interpreter must be off).

    Specialised as a launch of ours is: every pointer 16-byte aligned and every i32 a multiple of 16 (the
    kernels' sizes and strides are), except the arguments the kernel does not specialise. Without that
    every global store compiles to 2-byte accesses."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: signature[name] for name in kernel.arg_names}
    consts = {"DOT_FP32": False, "NUM_PROGRAMS": 132, "BLOCK_M": 128, "BLOCK_K": 64, "GROUP_M": 8, "FLATTEN": False,
              **constexprs}
    consts = {name: value for name, value in consts.items() if name in signature}
    plain = {kernel.arg_names[p.num] for p in kernel.params if p.do_not_specialize}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(signature.items())
             if name not in plain and name not in consts and (kind.startswith("*") or kind == "i32")}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def summary() -> dict:
    """{kernel: {wgmma, wgmma_bf16, wgmma_fp8, tma, shared_bytes}} for every GEMM kernel."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET to compile for sm_90")
    out = {}
    for name, (kernel, signature, consts) in _cases().items():
        compiled = compile_sm90(kernel, signature, consts)
        ptx = compiled.asm["ptx"]
        out[name] = {
            "wgmma": ptx.count("wgmma.mma_async"),
            "wgmma_bf16": "wgmma.mma_async" in ptx and ".bf16.bf16" in ptx,
            "wgmma_fp8": ".e4m3.e4m3" in ptx,
            "tma": "cp.async.bulk.tensor" in ptx,
            "shared_bytes": compiled.metadata.shared,
        }
    return out


#: The megakernel's launch as megamoe.megakernel makes it on an H200 (kimi-k2 rows: D = 7168, k = 8).
_MEGA_TILES = {  # format: (FMT, BN_GU, BN_DN, BLOCK_K, activation element type, scale type)
    "bf16": (0, 128, 256, 64, "bf16", "fp32"),
    "mxfp8": (1, 64, 128, 64, "fp8e4nv", "u8"),
    "fp8-block": (2, 128, 128, 128, "fp8e4nv", "fp32"),
}


def megakernel_case(fmt: str) -> tuple[dict, dict]:
    """(signature, constexprs) of the forward megakernel for routed format ``fmt`` (FP8: the comm workers copy
    the owners' E4M3 rows and scales)."""
    from megamoe.kernels import megakernel as mk
    from megamoe.megakernel import FORMATS, copy_tile_consts

    code, bn_gu, bn_dn, bk, elem, scale = _MEGA_TILES[fmt]
    consts = dict(TOP_K=8, HAS_SHARED=True, HAS_LIMIT=False,
                  DOT_FP32=False, FENCE=True, BLOCK_M=128, BN_GU=bn_gu, BN_DN=bn_dn, BLOCK_K=bk, GROUP_GU=4,
                  GROUP_DN=8, PHASE=0, TRACE=False, FMT=code, SOFT_E4M3=False, SHARED_BN_GU=128, SHARED_BN_DN=256,
                  SHARED_BK=64)
    _, scale_block, scale_dtype = FORMATS[fmt]
    quantized = code != 0
    scale_bytes = 1 if scale_dtype is None else scale_dtype.itemsize
    consts.update(copy_tile_consts(7168, scale_block, (7168 // scale_block, scale_bytes) if quantized else None))
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
        elif name in ("combine_ptr", "h_ptr", "y_ptr", "shared_h_ptr", "shared_act_ptr", "shared_y_ptr"):
            signature[name] = "*bf16"
        elif name.endswith("_ptr"):
            signature[name] = "*i32"
        else:
            signature[name] = "fp32" if name == "limit" else "i32"
    return signature, consts


def megakernel_summary() -> dict:
    """{format: {wgmma, wgmma_bf16, wgmma_fp8, tma, fence_proxy_async, stores_b16, stores_v4, loads_b16,
    loads_v4}} of the megakernel's sm_90 build, and {"weighted_sum": {loads_v4, its launch}}."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET to compile for sm_90")
    from megamoe.kernels import megakernel as mk

    from megamoe.megakernel import WEIGHTED_SUM_TILE

    out = {}
    block_t, block_d, warps = WEIGHTED_SUM_TILE
    signature = {name: "*bf16" for name in ("y_ptr", "combine_ptr", "shared_y_ptr", "out_ptr")}
    signature.update(own_rows_ptr="*i32", top_experts_ptr="*i32", router_weights_ptr="*fp32")
    consts = dict(TOP_K=8, HAS_SHARED=True, BLOCK_T=block_t, BLOCK_D=block_d)
    signature.update({name: "constexpr" for name in consts})
    signature.update({name: "i32" for name in mk.weighted_sum_kernel.arg_names if name not in signature})
    ptx = compile_sm90(mk.weighted_sum_kernel, signature, consts, num_warps=warps).asm["ptx"]
    # one 16-byte load per thread and vector of each slot's rows (and of the shared output): two per slot, as
    # a masked pair, took twice the time (2026-11-30-qwen-pass)
    out["weighted_sum"] = {"loads_v4": ptx.count("ld.global.v4"), "top_k": 8, "has_shared": True,
                           "block_t": block_t, "block_d": block_d, "num_warps": warps}
    for fmt in _MEGA_TILES:
        signature, consts = megakernel_case(fmt)
        ptx = compile_sm90(mk.megakernel, signature, consts).asm["ptx"]
        out[fmt] = {
            "wgmma": ptx.count("wgmma.mma_async"),
            "wgmma_bf16": ".bf16.bf16" in ptx,
            "wgmma_fp8": ".e4m3.e4m3" in ptx,
            "tma": "cp.async.bulk.tensor" in ptx,
            "fence_proxy_async": "fence.proxy.async" in ptx,
            # narrow stores of bf16 rows (the combine stores cross NVLink: 2-byte writes there cost ms)
            "stores_b16": ptx.count("st.global.b16"),
            "stores_v4": ptx.count("st.global.v4"),
            # and narrow loads (the comm workers' peer rows: alignment hints placed on the 1-D row offsets
            # alone compile to them)
            "loads_b16": len(re.findall(r"ld\.global(?:\.\w+)*\.b16", ptx)),
            "loads_v4": ptx.count("ld.global.v4"),
        }
    return out


if __name__ == "__main__":
    import sys

    print(json.dumps(megakernel_summary() if sys.argv[1:] == ["megakernel"] else summary()))
