"""Which weight-gradient recipe an FP8 backward runs: its FP8 wgrads, or BF16 wgrads of BF16 rows
(``megamoe.ops.bf16_wgrads``, torchao's "rowwise, high-precision grad weight" recipe). The layer's backward asks
:func:`bf16_wgrads_pay` at its balanced rows per local expert, the expert backwards at their call's rows, and
``megamoe plan`` counts the buffers of the recipe it picks."""

from __future__ import annotations

import os

from megamoe import runtime

#: Forces the FP8 backwards' weight gradients as BF16 wgrads (True) or as FP8 wgrads (False):
#: ``MEGAMOE_FP8_BF16_WGRADS`` = 1 / 0; unset (None), :func:`bf16_wgrads_pay` decides.
BF16_WGRADS: bool | None = (None if os.environ.get("MEGAMOE_FP8_BF16_WGRADS") is None
                            else runtime.env_switch("MEGAMOE_FP8_BF16_WGRADS", False))

#: fp8-block's FP8 wgrads (quantisers included) pay from this many rows per expert: on one H100
#: (benchmarks/results/2026-12-06-h100-fp8-bf16-wgrads, ``fp8_wgrad_ab.py``) the BF16 wgrads of the rows by token
#: took 14.6 against 17.3 ms at deepseek-v3 (256 rows an expert) and 16.4 against 23.2 at kimi-k2 (171); alone,
#: qwen3-30b-a3b's (512) took 2.13 against 1.77, but in the backward the FP8 wgrads' quantisers and replays cost
#: more than that: qwen3-30b-a3b's fp8-block backward ran 3.71 ms with BF16 wgrads against 4.07 with FP8 ones at
#: 512 rows an expert, 6.19 against 6.64 at 1024 (benchmarks/results/2026-12-06-deal-rebuilt, call 7) and 11.09
#: against 11.85 at 2048 (call 10), each in its own process. Every measured load runs BF16 wgrads; above 2048
#: unmeasured.
FP8_WGRAD_MIN_ROWS = 4096


def bf16_wgrads_pay(fmt: str, rows_per_expert: float) -> bool:
    """Whether an FP8 backward in ``fmt`` runs its weight gradients as BF16 wgrads: :data:`BF16_WGRADS` where set;
    else mxfp8 always (its MX roundings along the tokens cost more than they save: qwen3-30b-a3b's mxfp8 backward
    5.42 -> 5.03 ms on an H100, with the E4M3 rows still dequantised eagerly then), fp8-block below
    :data:`FP8_WGRAD_MIN_ROWS` rows per expert."""
    if BF16_WGRADS is not None:
        return BF16_WGRADS
    return fmt == "mxfp8" or rows_per_expert < FP8_WGRAD_MIN_ROWS


def reads_x_by_token(fmt: str, shape) -> bool:
    """Whether the FP8 layer backward of ``shape`` (a :class:`~megamoe.planner.kernel_config.LayerShape`) reads x
    by token from the staged BF16 x: one rank with BF16 wgrads. Its dact and dx never read x, so it then reads none
    of the E4M3 x rows the forward keeps in its ring, and a forward that does not read them itself (mxfp8 as the
    BF16 kernels, which read the tokens by index) need not gather them."""
    return shape.num_ranks == 1 and fmt != "bf16" and bf16_wgrads_pay(fmt, shape.rows_per_expert)
