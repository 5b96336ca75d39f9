"""The sm_90 build check's group ``bias`` (``megamoe.tools.sm90``): every kernel that adds the experts' optional
biases (``b_gate_up [L, 2I]``, ``b_down [L, D]``) or reduces their gradients, compiled as it launches with them.

The forward cases are the other groups' launches (the same tiles and constexprs) with the bias pointer given:
the Triton gate/up and down kernels in BF16, FP8-block and MXFP8 (dequantise-on-load), the warp-specialised Gluon
forwards (BF16 gate/up, FP8-block gate/up and down: Gluon has no interpreter, so this build and the GPU test are
all that hold them), and the forward megakernel in BF16; then the backward's segment sums and row dots
(``megamoe.kernels.expert_bias``).
"""

from __future__ import annotations

import dataclasses

from megamoe.tools.sm90_cases import Case, fp8_cases, gemm_cases, mxfp8_cases


def with_bias(case: Case, *pointers: str) -> Case:
    """``case`` with its bias pointers (``b_ptr`` unless named) given as bf16 tensors, and a Gluon kernel's
    HAS_BIAS on."""
    pointers = pointers or ("b_ptr",)
    signature = {**case.signature, **dict.fromkeys(pointers, "*bf16")}
    constexprs = {name: value for name, value in case.constexprs.items() if name not in pointers}
    if "HAS_BIAS" in case.kernel.arg_names:
        signature["HAS_BIAS"], constexprs["HAS_BIAS"] = "constexpr", True
    return dataclasses.replace(case, signature=signature, constexprs=constexprs)


#: (group builder, the case's name there) of each forward kernel built with its bias.
FORWARD = (
    (gemm_cases, "gate_up_kernel"), (gemm_cases, "down_kernel"), (gemm_cases, "forward_ws_kernel (gate/up)"),
    (fp8_cases, "gate_up_fp8_kernel"), (fp8_cases, "down_fp8_kernel"), (fp8_cases, "forward_fp8_ws_kernel (gate/up)"),
    (fp8_cases, "forward_fp8_ws_kernel (down)"), (mxfp8_cases, "gate_up_dequant"), (mxfp8_cases, "down_dequant"),
)


def bias_cases() -> dict[str, Case]:
    from megamoe.kernels import expert_bias
    from megamoe.ops.expert_bias import BIAS_COLS, BIAS_ROWS
    from megamoe.tools.sm90_megakernel_cases import megakernel_case

    built = {builder: builder() for builder in {builder for builder, _ in FORWARD}}
    cases = {name: with_bias(built[builder][name]) for builder, name in FORWARD}
    cases["megakernel (bf16)"] = megakernel_case("bf16", biases=True)
    tiles = dict(BLOCK_R=BIAS_ROWS, BLOCK_C=BIAS_COLS)
    rows = {"a_ptr": "*bf16", "stride_a": "i32", "counts_ptr": "*i32", "offsets_ptr": "*i32", "C": "i32",
            **dict.fromkeys(tiles, "constexpr")}
    for weighted in (False, True):  # d_b_gate_up from d_h; d_b_down from the rows and their router weights
        cases[f"segment_sum_kernel{' (weighted)' if weighted else ''}"] = Case(expert_bias.segment_sum_kernel, {
            **rows, "w_ptr": "*fp32" if weighted else "constexpr", "acc_ptr": "*fp32", "stride_acc": "i32"},
            {**tiles, **({} if weighted else {"w_ptr": None})}, num_warps=4, num_stages=1)
    cases["row_dot_kernel"] = Case(expert_bias.row_dot_kernel, {
        **rows, "b_ptr": "*bf16", "stride_b": "i32", "out_ptr": "*fp32"}, tiles, num_warps=4, num_stages=1)
    return cases
