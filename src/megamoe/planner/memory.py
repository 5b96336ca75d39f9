"""What a layer shape's buffers cost per rank, buffer by buffer, and the rings that fit a memory budget.

Two parts (besides the weights and their gradients):

- the pass's buffers, which the layers of one shape share: the symmetric workspace (staging, combine / d_x
  slots, the backward's d_out and router weights), the forward's ring (routed rows, activation, expert outputs),
  the backward's ring (``megamoe.megakernel.backward_ring``: a window's d_out, x, h and d_x rows, its dgrads,
  the weight gradients' FP32 carries) and the shared expert's;
- what each layer keeps from its forward for its backward: the forward ring's pre-activation h (FP8: its E4M3
  rows too), the shared expert's h and the pull schedule.

Only the routing all-gather and the schedule grow with the EP size R (int32 entries: ``R * N * k``); the rings
hold what balanced routing gives a rank (``N * k`` rows) whatever R is. The names are the ones a kernel's
buffers are checked against (tests/test_megakernel.py, and on a GPU tests/test_memory.py).
"""

from __future__ import annotations

from megamoe.config import MoEConfig
from megamoe.planner.kernel_config import KernelConfig
from megamoe.planner.wgrads import bf16_wgrads_pay
from megamoe.routing.windows import WINDOW_ALIGN, window_rows

#: Bytes per element of the routed rows in each precision: E4M3 and its scales (fp8-block: an fp32 per 128,
#: mxfp8: an E8M0 byte per 32).
ELEMENT_BYTES = {"bf16": 2.0, "fp8-block": 1.0 + 4 / 128, "mxfp8": 1.0 + 1 / 32}
#: The BF16 dact's n-tile on a GPU (its router-gradient partials: one fp32 per row and n-tile).
DACT_BLOCK_N = 128


def pass_memory(cfg: MoEConfig, ep: int, tokens: int, config: KernelConfig, precision: str) -> dict[str, int]:
    """Bytes per rank of the pass's buffers, by buffer (module docstring)."""
    d, i, k, n = cfg.hidden, cfg.intermediate, cfg.top_k, tokens
    shared = sum(cfg.shared)
    act = ELEMENT_BYTES[precision]
    ring = config.ring_rows
    memory = {
        "symmetric x [N, D] (bf16)": n * d * 2,
        **({"symmetric quantised x [N, D] + scales (FP8)": int(n * d * act)} if precision != "bf16" else {}),
        "symmetric combine slots [N*k, D] (the backward's d_x slots)": n * k * d * 2,
        "symmetric d_out [N, D] (backward)": n * d * 2,
        **({"symmetric quantised d_out [N, D] + scales (FP8 backward)": int(n * d * act)}
           if precision != "bf16" else {}),
        "symmetric router weights and their gradients [N, k] x 2 (backward)": (2 * n * k + 1) * 4,
        "routing all-gather [R, N, k]": ep * n * k * 4,
        "ring rows [ring, D]": int(ring * d * act),
        "ring activation [ring, I]": int(ring * i * act),
        "ring expert outputs y [ring, D]": ring * d * 2,
        **({"shared expert activation [N, Is]": n * shared * 2, "shared expert y [N, D]": n * d * 2}
           if shared else {}),
    }
    memory.update(backward_memory(cfg, tokens, config.bwd_ring_rows, precision, ep))
    return memory


def backward_memory(cfg: MoEConfig, tokens: int, ring: int, precision: str, ep: int) -> dict[str, int]:
    """Bytes per rank of the backward's own buffers at a backward ring of ``ring`` rows."""
    d, i = cfg.hidden, cfg.intermediate
    rows = window_rows(ring)
    shared = sum(cfg.shared)
    act = ELEMENT_BYTES[precision]
    memory = {
        "backward ring d_out and x rows [ring+128, D] x 2": int(2 * rows * d * act),
        "backward ring d_x [ring+128, D] (bf16)": rows * d * 2,
        "backward ring h, replayed activation [ring+128, 2I + I]": int(rows * (2 * i * 2 + i * act)),
        "backward ring router weights and their gradients [ring+128] x 2": rows * 8,
        "backward dgrads d_h, w*act, router partials [ring+128, 3I]": rows * (3 * i * 2 + -(-i // DACT_BLOCK_N) * 4),
        "backward weight-gradient carries, fp32 [3I, D] x 2": 2 * 3 * i * d * 4,
    }
    if precision != "bf16":  # the FP8 dx's d_h along 2I, and the wgrads' operands (planner.wgrads's recipe)
        experts = cfg.experts_per_rank(ep)
        memory["backward FP8 d_h [ring+128, 2I]"] = int(rows * 2 * i * act)
        if not bf16_wgrads_pay(precision, tokens * cfg.top_k / max(experts, 1)):  # four along the tokens
            padded = -(-(rows + experts * (WINDOW_ALIGN - 1)) // WINDOW_ALIGN) * WINDOW_ALIGN
            memory["backward FP8 wgrads' token-major operands [2D + 3I, ring+pad]"] = int(
                padded * (2 * d + 3 * i) * act)
        elif ep > 1:  # BF16 wgrads of the pulled E4M3 rows, dequantised (one rank reads its staged tokens)
            memory["backward BF16 wgrads' d_out and x, dequantised [ring+128, D] x 2"] = 2 * rows * d * 2
    if shared:
        memory["backward shared expert d_h, w*act, d_x [N, 3*Is + D]"] = tokens * (3 * shared + d) * 2
    return memory


def kept_memory(cfg: MoEConfig, ep: int, tokens: int, config: KernelConfig, precision: str) -> dict[str, int]:
    """Bytes one layer keeps from its forward for its backward, by buffer (module docstring)."""
    d, i, k = cfg.hidden, cfg.intermediate, cfg.top_k
    shared = sum(cfg.shared)
    ring = config.ring_rows
    return {  # BF16 pulls x again: a layer keeps its pre-activations and the schedule (FP8: the ring's E4M3 x)
        "ring pre-activation h [ring, 2I]": ring * 2 * i * 2,
        **({"ring rows x, E4M3 + scales [ring, D]": int(ring * d * ELEMENT_BYTES[precision])}
           if precision != "bf16" else {}),
        **({"shared expert pre-activation h [N, 2*Is]": tokens * 2 * shared * 2} if shared else {}),
        "pull schedule (worst case R*N*k rows)": ep * tokens * k * 8,
    }


def fitting_backward_ring(cfg: MoEConfig, ep: int, tokens: int, config: KernelConfig, precision: str,
                          budget: int, layers: int) -> int | None:
    """The largest backward ring (a multiple of 128, at most the config's) whose pass and ``layers`` layers fit
    ``budget`` bytes, or None when not even a 128-row ring does. The bytes grow linearly with the ring."""
    def total(ring: int) -> int:
        c = KernelConfig(config.num_sms, config.comm_sms, config.minibatch, config.ring_rows, config.tile_m,
                         config.tile_n, config.backward_comm_sms, config.backward_minibatch, config.overlap, ring)
        return sum(pass_memory(cfg, ep, tokens, c, precision).values()) + layers * sum(
            kept_memory(cfg, ep, tokens, c, precision).values())

    top = config.bwd_ring_rows
    if total(top) <= budget:
        return top
    low = WINDOW_ALIGN
    if total(low) > budget:
        return None
    per_row = (total(top) - total(low)) / (top - low)
    ring = low + int((budget - total(low)) // per_row) // WINDOW_ALIGN * WINDOW_ALIGN
    while ring > low and total(ring) > budget:  # rounding
        ring -= WINDOW_ALIGN
    return ring
