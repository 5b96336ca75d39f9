"""Compile the GEMM kernels for Hopper (sm_90) without a GPU and summarise the code.

`python -m megamoe.kernels.sm90` prints, per kernel, whether the PTX uses
wgmma tensor-core instructions and TMA bulk copies, and its shared memory;
tests run it in a subprocess (the interpreter must be off to compile).
"""

from __future__ import annotations

import json
import os

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
            {"a_desc": "tensordesc<bf16[64,128]>", "b_desc": "tensordesc<bf16[64,128]>", "out_ptr": "*bf16",
             "stride_out_e": "i32", "stride_out_m": "i32", "offsets_ptr": "*i32", "counts_ptr": "*i32",
             "num_experts": "i32", "OUT_M": "i32", "OUT_N": "i32", "DOT_FP32": "constexpr",
             "NUM_PROGRAMS": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
             "FLATTEN": "constexpr"},
            {"BLOCK_N": 128},
        ),
    }


def compile_sm90(kernel, signature: dict, constexprs: dict, num_warps: int = 8, num_stages: int = 3):
    """The compiled kernel for sm_90 (the interpreter must be off)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: signature[name] for name in kernel.arg_names}
    consts = {"DOT_FP32": False, "NUM_PROGRAMS": 132, "BLOCK_M": 128, "BLOCK_K": 64, "GROUP_M": 8, "FLATTEN": False,
              **constexprs}
    consts = {name: value for name, value in consts.items() if name in signature}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts),
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


if __name__ == "__main__":
    print(json.dumps(summary()))
