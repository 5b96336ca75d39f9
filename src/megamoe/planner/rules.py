"""`megamoe plan`: minibatch, communication SMs, ring size and memory for a layer.

The megakernel splits the SMs into ``comm_sms`` communication workers and
``C = num_sms - comm_sms`` compute workers, and hands the experts their rows a
minibatch at a time. The planner applies three rules and prints why:

1. Waves: each grouped GEMM of a minibatch needs at least two full waves
   of output tiles over the compute SMs,
   ``T_mb >= 2 · C · tile_m · tile_n / min(2I, D)`` (docs/design.md; MoK: 128x256
   tiles, C 148, D 7168, I 2048 -> 2368 rows), rounded up to whole row tiles.
   The planner takes ``MINIBATCH_WAVES`` = 3: in interleaved rounds on H200 at
   EP 2 three waves beat two by 1-4 % on five of six preset/format pairs
   (qwen3.5-397b fp8-block 4.3 %) and four waves were no better than three
   (benchmarks/results/2026-11-30-pass-prologue): per-minibatch costs (the
   gate/up -> down hand-over, where the compute workers' waits are, and a push
   per minibatch) weigh more than the longer first pull and last push.
2. Communication keeps up: the fewest comm SMs whose measured per-SM copy
   rate moves the routed rows (dispatch of every row, local ones too; combine
   of the other ranks' rows: the ring keeps a rank's own outputs) in at most
   ``COMM_SLACK`` of the time the compute SMs take over them (padded to whole
   row tiles per expert) and the shared expert (the first pulls overlap it),
   rounded up to an even count (odd counts measured slower).
3. Ring: room for every row a rank expects under balanced routing (N·k) plus
   four standard deviations of uniform random routing's spread (sqrt(N·k)
   each), in whole minibatches, so a balanced backward replays nothing and
   the rank's own outputs stay in the ring (rule 2); skewed routing wraps the
   ring (never drops).
4. Backward ring: windows of ``ring + 128`` rows that fit the forward's ring
   (``default_backward_ring``), so a backward under balanced routing reads
   every row in place in one window, at any EP size; with a memory budget
   (``megamoe plan --memory``) the largest ring that fits, and the plan says
   what its extra windows cost.

Measured inputs (benchmarks/results/2026-11-30-fp8-experts, the megakernel's trace): the expert GEMM
rates and the comm SMs' copy rate inside the megakernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from megamoe.config import MoEConfig
from megamoe.precision import check_precision
from megamoe.planner.kernel_config import KernelConfig, LayerShape, check_kernel_config
from megamoe.planner.memory import ELEMENT_BYTES, fitting_backward_ring, kept_memory, pass_memory
from megamoe.routing.windows import WINDOW_ALIGN

#: H200 measurements the rules use. Routed expert GEMM rates on full 128-row tiles, scaled to all 132 SMs, from
#: the megakernel's trace of kimi-k2 EP 2 (benchmarks/results/2026-11-30-fp8-experts: 5.81 TFLOP of routed
#: tiles in the compute workers' busy time, 12.6 ms on 116 SMs for bf16, 9.15 ms on 120 for fp8-block: 523 and
#: 699 TFLOP/s, over the 89 % of tile rows its ~341 rows per expert fill); MXFP8 from its standalone forward
#: (benchmarks/results/2026-11-29-fp8-mxfp8, the same load).
GEMM_TFLOPS = {"bf16": 588.0, "fp8-block": 786.0, "mxfp8": 230.0}
#: The comm workers' copy rate per SM beside the expert GEMMs, whole-row copy tiles (benchmarks/results/
#: 2026-11-30-row-tiles: kimi-k2 EP 2 bf16 with 6 comm SMs, 1.89 GB of pulls and pushes per rank in 15.9 ms of
#: comm time, 19.8 GB/s per SM; comm-bound graph sweeps 20-24 GB/s per SM at D 7168 and 4096 alike). The chunked
#: tiles before moved 11 (D 7168) to 15.5 (D 4096): their cost was per 16 bytes, the row tiles' is per byte.
NVLINK_GBPS_PER_SM = 20.0
H200_SMS = 132
#: Communication may take at most this share of the compute time, and comm_sms is rounded up to even. Interleaved
#: A/B rounds of whole passes (benchmarks/results/2026-11-30-own-outputs, EP 2 bf16, ms): kimi-k2 6 / 7 / 8 / 10
#: comm SMs 16.42 / 17.39 / 16.13 / 16.76, qwen3.5-397b 11 / 12 / 13 / 14 7.02 / 6.81 / 7.20 / 6.89,
#: deepseek-v4-pro 4 / 5 / 6 20.32 / 21.15 / 20.99: odd counts lose 3-8 % to both even neighbours; 0.85 lands on
#: 7 -> 8, 12 and 5 -> 6.
COMM_SLACK = 0.85
#: The BF16 backward's expert GEMM rate: the standalone backward on kimi-k2's 341-row experts ran at 0.88x
#: the forward tiles' rate (450 against 501-517 TFLOP/s, benchmarks/results/2026-12-01-gemm-vs-dense); not yet
#: measured inside the backward megakernel.
BACKWARD_GEMM_TFLOPS = GEMM_TFLOPS["bf16"] * 0.88
#: Waves of gate/up tiles per minibatch (rule 1). Interleaved A/B rounds, EP 2, ms per pass (benchmarks/results/
#: 2026-11-30-pass-prologue), two / three / four waves: qwen3.5-397b bf16 6.20 / 6.14 / 6.24, fp8-block 5.10 /
#: 4.88 / 4.92; kimi-k2 bf16 15.31 / 15.42 / 15.96, fp8-block 11.57 / 11.41 / 11.73; deepseek-v4-pro bf16 19.53 /
#: 19.14 / 19.41, fp8-block 14.04 / 14.00 / 13.80.
MINIBATCH_WAVES = 3


@dataclass(frozen=True)
class Plan:
    """A planned :class:`KernelConfig`, its per-rank memory and the reasoning.

    Memory (bytes by buffer, per rank, besides the weights): ``memory`` holds the pass's buffers, which the
    layers of one shape share (staging, combine and gradient slots, the expert outputs); ``kept`` what one
    layer keeps from its forward for its backward (ring rows, h, act, the shared expert's h and act, the
    schedule), once per layer of the model.
    """

    config: KernelConfig
    memory: dict[str, int]
    kept: dict[str, int] = field(default_factory=dict)
    reasoning: list[str] = field(default_factory=list)

    @property
    def memory_total(self) -> int:
        """The pass's buffers and one layer's kept buffers."""
        return self.memory_for(1)

    def memory_for(self, layers: int) -> int:
        """Bytes per rank for a model of ``layers`` MoE layers of this shape: the pass's buffers once, the kept
        buffers once per layer (a model runs every layer's forward before any backward)."""
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            raise ValueError(f"layers must be a positive int, got {layers!r}")
        return sum(self.memory.values()) + layers * sum(self.kept.values())


def wave_rows(cfg: MoEConfig, compute_sms: int, tile_m: int, tile_n: int, waves: int = MINIBATCH_WAVES) -> int:
    """Rule 1, exact: waves · C · tile_m · tile_n / min(2I, D), rounded up to whole row tiles."""
    rows = waves * compute_sms * tile_m * tile_n / min(2 * cfg.intermediate, cfg.hidden)
    return math.ceil(rows / tile_m) * tile_m


def tile_use(cfg: MoEConfig, ep: int, tokens: int, tile_m: int) -> float:
    """Share of the routed tiles' rows that hold rows under balanced routing: each expert's rows
    (ep * tokens * k / E) are padded to whole tiles of tile_m rows."""
    rows = ep * tokens * cfg.top_k / cfg.num_experts
    return rows / (math.ceil(rows / tile_m) * tile_m)


def _comm_over_compute(cfg: MoEConfig, ep: int, tokens: int, comm_sms: int, num_sms: int, precision: str,
                       tile_m: int = 128, backward: bool = False) -> float:
    """Time for the comm SMs to move a routed row (dispatch + combine) over the compute SMs' time per row.

    The dispatch counts every row, local ones too: the comm workers copy local rows into the ring as well
    (megakernel trace, kimi-k2 EP 2: 10 SMs planned on remote bytes alone finished their pushes 2.7 ms after
    the compute SMs). The combine counts the (ep - 1) / ep of the rows other ranks own: the outputs of a
    rank's own routes stay in the ring, where the weighted sum reads them (the planned ring holds every row
    of balanced routing; a wrapping ring pushes them too). The routed compute time counts the rows padding
    each expert's last tile (``tile_use``: kimi-k2 at EP 1 fills 67 %); it includes the shared expert's share
    (BF16, its tokens spread over their k routed rows under balanced routing): the pulls start under it.

    ``backward``: the backward megakernel's rows instead: it pulls every row's d_out and x (BF16) and pushes d_x
    home (all of it: its own routes' slots too), against twice the forward's FLOPs at the backward's GEMM rate.
    """
    if backward:
        row_bytes = cfg.hidden * 2.0 * 3
        rate, flops = BACKWARD_GEMM_TFLOPS, 2
    else:
        row_bytes = cfg.hidden * (ELEMENT_BYTES[precision] + 2.0 * (ep - 1) / ep)  # pull (FP8?) + push home (BF16)
        rate, flops = GEMM_TFLOPS[precision], 1
    comm_s = row_bytes / (comm_sms * NVLINK_GBPS_PER_SM * 1e9)
    share = (num_sms - comm_sms) / num_sms
    compute_s = flops * (cfg.routed_flops(1) / (rate * tile_use(cfg, ep, tokens, tile_m))
                         + cfg.shared_flops(1) / cfg.top_k / GEMM_TFLOPS["bf16"]) / (1e12 * share)
    return comm_s / compute_s


def plan(
    cfg: MoEConfig,
    ep: int,
    tokens: int,
    *,
    num_sms: int = H200_SMS,
    precision: str = "bf16",
    comm_sms: int | None = None,
    minibatch: int | None = None,
    ring_rows: int | None = None,
    tile_m: int = 128,
    tile_n: int = 256,
    backward_comm_sms: int | None = None,
    backward_minibatch: int | None = None,
    backward_ring_rows: int | None = None,
    memory_gib: float | None = None,
    layers: int = 1,
) -> Plan:
    """Plan the kernel for ``tokens`` tokens per rank on ``ep`` ranks; explicit knobs override the rules.
    ``memory_gib``: at most this much per rank for the pass and ``layers`` layers' kept buffers (rule 4): the
    backward's ring shrinks to fit (ValueError when even its least does not)."""
    check_precision(precision)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    experts = cfg.experts_per_rank(ep)
    why = [f"{experts} local experts per rank (E {cfg.num_experts} / EP {ep}); "
           f"{tokens} tokens x k {cfg.top_k} = {tokens * cfg.top_k} routed rows per rank when balanced"]

    if comm_sms is None:
        fitting = [s for s in range(1, num_sms)
                   if _comm_over_compute(cfg, ep, tokens, s, num_sms, precision, tile_m) <= COMM_SLACK]
        if not fitting:
            raise ValueError(f"no comm_sms < {num_sms} keeps communication within {COMM_SLACK:.0%} of compute; "
                             f"give comm_sms")
        comm_sms = min(fitting[0] + fitting[0] % 2, num_sms - 1)  # even: odd counts measured 3-8 % slower
        ratio = _comm_over_compute(cfg, ep, tokens, comm_sms, num_sms, precision, tile_m)
        why.append(f"comm_sms {comm_sms}: at {NVLINK_GBPS_PER_SM:.0f} GB/s per SM, "
                   f"moving a row there (local rows too: the comm workers copy them) and, owned by another rank, "
                   f"back takes {ratio:.0%} of "
                   f"computing it and its share "
                   f"of the shared expert on the other {num_sms - comm_sms} SMs (<= {COMM_SLACK:.0%} needed; "
                   f"{GEMM_TFLOPS[precision]:.0f} TFLOP/s measured GEMM rate on full tiles, "
                   f"{tile_use(cfg, ep, tokens, tile_m):.0%} of the tile rows filled)"
                   + (f"; {fitting[0]} would do, rounded up to even (odd counts measured 3-8 % slower)"
                      if comm_sms != fitting[0] else ""))
    else:
        why.append(f"comm_sms {comm_sms}: given")
    compute = num_sms - comm_sms
    if compute < 1:
        raise ValueError(f"comm_sms ({comm_sms}) must be < num_sms ({num_sms})")

    if minibatch is None:
        minibatch = wave_rows(cfg, compute, tile_m, tile_n)
        why.append(f"minibatch {minibatch} rows: {MINIBATCH_WAVES} waves of {tile_m}x{tile_n} tiles over {compute} "
                   f"compute SMs = {MINIBATCH_WAVES}*{compute}*{tile_m}*{tile_n}/min(2I={2 * cfg.intermediate}, "
                   f"D={cfg.hidden}), rounded up to whole {tile_m}-row tiles (two is the least; three measured "
                   f"fastest on H200)")
    else:
        why.append(f"minibatch {minibatch}: given")

    if ring_rows is None:
        expected = tokens * cfg.top_k
        ring_rows = max(1, math.ceil((expected + 4 * math.sqrt(expected)) / minibatch)) * minibatch
        why.append(f"ring {ring_rows} rows = {ring_rows // minibatch} minibatches: every row of balanced routing "
                   f"({expected}) and 4 standard deviations of random routing's spread fit, so the backward replays "
                   f"nothing and a rank's own outputs stay in the ring; skewed routing wraps the ring")
    else:
        why.append(f"ring {ring_rows}: given")

    if ep == 1:
        why.append("EP 1: no peers, nothing to overlap: megamoe_forward runs the expert kernels on every SM instead, "
                   "reading the outputs in place (MegaKernel(..., one_rank_megakernel=True) runs this config with the "
                   "memory below)")
    if backward_comm_sms is None and ep > 1 and precision == "bf16":
        fitting = [s for s in range(1, num_sms) if _comm_over_compute(cfg, ep, tokens, s, num_sms, precision, tile_m,
                                                                     backward=True) <= COMM_SLACK]
        backward_comm_sms = min(fitting[0] + fitting[0] % 2, num_sms - 1) if fitting else comm_sms
        why.append(f"backward comm_sms {backward_comm_sms}: the same rule for the backward megakernel, which pulls "
                   f"every row's d_out and x and pushes d_x home (3 BF16 rows) against twice the FLOPs at "
                   f"{BACKWARD_GEMM_TFLOPS:.0f} TFLOP/s (its minibatches are the forward's)")
    elif backward_comm_sms is not None:
        why.append(f"backward comm_sms {backward_comm_sms}: given")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise ValueError(f"layers must be a positive int, got {layers!r}")
    if memory_gib is not None and (isinstance(memory_gib, bool) or not isinstance(memory_gib, (int, float))
                                   or not memory_gib > 0):
        raise ValueError(f"memory_gib must be a positive number, got {memory_gib!r}")
    if backward_minibatch is not None:
        why.append(f"backward minibatch {backward_minibatch} rows: given")
    else:
        why.append("backward minibatch: the forward's (no backward sweep measured yet)")
    config = KernelConfig(num_sms, comm_sms, minibatch, ring_rows, tile_m, tile_n, backward_comm_sms,
                          backward_minibatch, backward_ring_rows=backward_ring_rows)
    check_kernel_config(config, LayerShape.of(cfg, ep, tokens), precision, tile_m=tile_m, available_sms=num_sms)
    memory = pass_memory(cfg, ep, tokens, config, precision)
    kept = kept_memory(cfg, ep, tokens, config, precision)
    if memory_gib is not None:
        config, memory, kept = _fit_budget(cfg, ep, tokens, config, precision, memory_gib, layers, memory, kept, why)
    how = ("given" if backward_ring_rows is not None else "the budget's" if config.backward_ring_rows is not None
           else "windows of ring + 128 rows that fit the forward ring")
    why.append(_backward_ring_reason(cfg, tokens, config, how))
    why.append(f"memory per rank besides the weights: {sum(memory.values()) / 2**30:.2f} GiB for the pass (shared "
               f"by the layers of this shape), {sum(kept.values()) / 2**30:.2f} GiB kept per layer for its backward")
    return Plan(config, memory, kept, why)


#: HBM bytes per second of a carry's round trip (a copy's rate on the H200: BENCHMARKS.md, 4252 GB/s read + write).
HBM_BYTES_PER_S = 4252e9


def _backward_ring_reason(cfg: MoEConfig, tokens: int, config: KernelConfig, how: str) -> str:
    ring = config.bwd_ring_rows
    expected = tokens * cfg.top_k
    windows = max(1, -(-int(expected + 4 * math.sqrt(expected)) // ring))
    carry = 2 * 3 * cfg.intermediate * cfg.hidden * 4  # an expert's FP32 blocks, written then read
    text = (f"backward ring {ring} rows ({how}): {windows} window{'s' if windows > 1 else ''} for balanced routing's "
            f"rows; the same at any EP size")
    if windows > 1:
        text += (f"; each extra window carries one expert's weight gradients in FP32 ({carry / 2**20:.0f} MiB "
                 f"written and read, ~{carry / HBM_BYTES_PER_S * 1e3:.2f} ms of HBM) and launches its steps once "
                 f"more: ~{(windows - 1) * carry / HBM_BYTES_PER_S * 1e3:.2f} ms more traffic for the pass, the "
                 f"expert GEMMs unchanged")
    return text


def _fit_budget(cfg, ep, tokens, config, precision, memory_gib, layers, memory, kept, why):
    """Rule 4 under a budget: the backward ring shrunk until the pass and ``layers`` layers fit ``memory_gib``."""
    budget = int(memory_gib * 2**30)
    total = sum(memory.values()) + layers * sum(kept.values())
    ring = fitting_backward_ring(cfg, ep, tokens, config, precision, budget, layers)
    if ring is None:
        floor = replace(config, backward_ring_rows=WINDOW_ALIGN)
        need = sum(pass_memory(cfg, ep, tokens, floor, precision).values()) + layers * sum(
            kept_memory(cfg, ep, tokens, floor, precision).values())
        raise ValueError(f"{layers} layer(s) of this shape need at least {need / 2**30:.2f} GiB per rank (a backward "
                         f"ring of 128 rows; the forward's ring {config.ring_rows} rows: pin a smaller ring_rows), "
                         f"more than the {memory_gib} GiB budget")
    if ring == config.bwd_ring_rows:
        why.append(f"memory budget {memory_gib} GiB for {layers} layer(s): {total / 2**30:.2f} GiB fits")
        return config, memory, kept
    config = replace(config, backward_ring_rows=ring)
    memory = pass_memory(cfg, ep, tokens, config, precision)
    why.append(f"memory budget {memory_gib} GiB for {layers} layer(s): {total / 2**30:.2f} GiB did not fit; the "
               f"backward ring shrinks to {ring} rows ({(sum(memory.values()) + layers * sum(kept.values())) / 2**30:.2f}"
               f" GiB)")
    return config, memory, kept


def format_plan(p: Plan, layers: int = 1) -> str:
    """The plan as text: the config, the reasoning, the memory per rank for ``layers`` MoE layers."""
    c = p.config
    lines = [f"KernelConfig(num_sms={c.num_sms}, comm_sms={c.comm_sms}, minibatch={c.minibatch}, "
             f"ring_rows={c.ring_rows}, tile_m={c.tile_m}, tile_n={c.tile_n}, "
             f"backward_comm_sms={c.backward_comm_sms}, backward_minibatch={c.backward_minibatch}, "
             f"backward_ring_rows={c.backward_ring_rows})", "", "why:"]
    lines += [f"  - {line}" for line in p.reasoning]
    width = max(map(len, (*p.memory, *p.kept)))
    lines += ["", "memory per rank, the pass (shared by the layers of this shape):"]
    lines += [f"  {name:{width}} {size / 2**20:10.1f} MiB" for name, size in p.memory.items()]
    lines += ["", "memory per rank, kept by each layer for its backward:"]
    lines += [f"  {name:{width}} {size / 2**20:10.1f} MiB" for name, size in p.kept.items()]
    lines.append(f"  {'total per layer':{width}} {sum(p.kept.values()) / 2**20:10.1f} MiB")
    lines += ["", f"  {f'total for {layers} layer' + ('s' if layers != 1 else ''):{width}} "
                  f"{p.memory_for(layers) / 2**20:10.1f} MiB"]
    return "\n".join(lines)
