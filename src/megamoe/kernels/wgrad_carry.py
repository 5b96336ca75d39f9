"""The weight gradients' FP32 carry across the backward's windows: the jit helpers the Triton wgrads share.

The backward streams an expert's rows through a ring, a window at a time (``megamoe.routing.windows``). An expert
whose rows span several windows reduces them in one order all the same: its wgrad blocks start from the FP32
accumulator the previous window left (``carry_in``, an `[OUT_M, OUT_N]` fp32 block of that expert) and, while
its rows go on, leave theirs in ``carry_out`` instead of writing the BF16 gradient. Per expert, ``modes[l]``:

    CARRY_IN  (1)  start from carry_in
    STORE     (2)  write the BF16 gradient (its rows end in this window)
    CARRY_OUT (4)  write the FP32 accumulator to carry_out

Without CARRY (a constexpr) every expert is STORE from zeros: the launch without windows.
"""

from __future__ import annotations

import triton
import triton.language as tl

CARRY_IN = tl.constexpr(1)
STORE = tl.constexpr(2)
CARRY_OUT = tl.constexpr(4)


@triton.jit
def wgrad_mode(modes_ptr, expert, CARRY: tl.constexpr):
    """The expert's mode bits (STORE without CARRY)."""
    if CARRY:
        return tl.load(modes_ptr + expert)
    else:
        return expert * 0 + STORE


@triton.jit
def carry_start(mode, carry_in_ptr, m0, n0, OUT_M, OUT_N, CARRY: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """The block's starting accumulator: carry_in's block with CARRY_IN, else zeros."""
    if CARRY:
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        mask = (rows < OUT_M)[:, None] & (cols < OUT_N)[None, :] & ((mode & CARRY_IN) != 0)
        return tl.load(carry_in_ptr + rows.to(tl.int64)[:, None] * OUT_N + cols[None, :], mask=mask, other=0.0)
    else:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def carry_end(acc, mode, carry_out_ptr, m0, n0, OUT_M, OUT_N, CARRY: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """With CARRY_OUT, the accumulator into carry_out's block. Returns whether the BF16 block is to be written."""
    if CARRY:
        if (mode & CARRY_OUT) != 0:
            rows = m0 + tl.arange(0, BLOCK_M)
            cols = n0 + tl.arange(0, BLOCK_N)
            mask = (rows < OUT_M)[:, None] & (cols < OUT_N)[None, :]
            tl.store(carry_out_ptr + rows.to(tl.int64)[:, None] * OUT_N + cols[None, :], acc, mask=mask)
    return (mode & STORE) != 0
