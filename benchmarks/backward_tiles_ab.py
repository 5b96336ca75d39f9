"""The BF16 expert backward's row tiles A against B at the power cap: interleaved rounds of sustained calls, one GPU.

    PYTHONPATH=src python3 benchmarks/backward_tiles_ab.py --preset kimi-k2 --experts 192 --tokens 4096
        [--rounds 5] [--seconds 0.4]

``expert_backward`` (dact, dx, the wgrads) on ``bench.experts.backward_load``'s even load (``--tokens`` x top-k rows
over ``--experts`` experts: kimi-k2's shapes at 4096 tokens over 192 experts keep its ~170 rows an expert and half
its weights), each variant a tile plan and the Hopper switches it runs under (``megamoe.ops.experts``, read at each
launch, set around each call):

- ``planned``: the planner's tiles, every switch off;
- ``empty halves skipped``: ``SKIP_EMPTY_HALF`` (a 128-row Gluon tile of at most 64 rows in one warpgroup: the dact);
- ``128-row Triton dx``, ``128-row Gluon dx``, ``128-row Gluon dx, empty halves skipped``: dx at the 128 x 256 tile
  where the plan takes 64-row tiles (at most ``FEW_ROWS_PER_EXPERT`` rows an expert), in ``dx_kernel`` or in the
  cooperative Gluon kernel (``GLUON_DX``), with and without ``SKIP_EMPTY_HALF``.

Every round runs each variant for --seconds back to back after a first round that only warms up; the table gives
each variant's median ms and whether its gradients are the planned run's bits (d_x, d_router whole; the weight
gradients by each row's int64 sum of bit patterns: a copy of them per variant would not fit).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from megamoe.bench.experts import backward_load
from megamoe.config import preset
from megamoe.ops import experts as expert_ops
from megamoe.ops.experts_bwd import expert_backward, new_grads
from megamoe.planner.tiles import plan_tiles
from megamoe.planner.tuning import Tuning

from sustained import interleaved_rounds, rounds_table  # benchmarks/, beside this script

SWITCHES = ("SKIP_EMPTY_HALF", "GLUON_DX", "PING_PONG_DX")


def variants(device: torch.device, rows_per_expert: float) -> dict[str, tuple[Tuning | None, dict]]:
    """{variant: (its tuning or None for the plan, the switches it turns on)}."""
    wide_dx = Tuning(dx=plan_tiles("dx", device))  # 128 x 256, whatever the load
    out = {"planned": (None, {}), "empty halves skipped": (None, {"SKIP_EMPTY_HALF": True})}
    if plan_tiles("dx", device, rows_per_expert).block_m != 128:
        out["128-row Triton dx"] = (wide_dx, {})
    out["128-row Gluon dx"] = (wide_dx, {"GLUON_DX": True})
    out["128-row Gluon dx, empty halves skipped"] = (wide_dx, {"GLUON_DX": True, "SKIP_EMPTY_HALF": True})
    return out


def under(switches: dict, call):
    """``call`` with ``switches`` on and every other of :data:`SWITCHES` off, then all off again."""
    def run():
        for name in SWITCHES:
            setattr(expert_ops, name, switches.get(name, False))
        try:
            return call()
        finally:
            for name in SWITCHES:
                setattr(expert_ops, name, False)
    return run


def fingerprint(grads) -> list[torch.Tensor]:
    """The gradients to compare bit for bit: d_x and d_router whole, the weight gradients as each row's int64 sum of
    its bf16 bit patterns."""
    rows = [w.view(torch.int16).to(torch.int64).sum(-1) for w in (grads.d_w_gate_up, grads.d_w_down)]
    return [grads.d_x.clone(), grads.d_router.clone(), *rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.4)
    a = parser.parse_args()
    cfg = preset(a.preset)
    device = torch.device("cuda")
    load = backward_load(cfg, a.experts, a.tokens, device)
    rows = load.x.shape[0]
    per_expert = rows / a.experts
    grads = new_grads(rows, load.w_gate_up, load.w_down)  # one set, overwritten by every variant
    calls, prints = {}, {}
    for name, (tuning, switches) in variants(device, per_expert).items():
        call = under(switches, lambda tuning=tuning: expert_backward(
            *load.args, tuning=tuning, rows_per_expert=per_expert, out=dataclasses.replace(grads)))
        grads.d_x.fill_(float("nan"))
        call()
        prints[name] = fingerprint(grads)
        calls[name] = call
    first = prints["planned"]
    same = {name: all(torch.equal(x, y) for x, y in zip(p, first)) for name, p in prints.items()}
    del prints
    times = interleaved_rounds(calls, a.rounds, a.seconds)
    flops = 12 * rows * cfg.hidden * cfg.intermediate  # dact, dx, two wgrads
    print(f"{a.preset} expert backward, {a.experts} experts x ~{per_expert:.0f} rows, {a.rounds} rounds of "
          f"{a.seconds} s each")
    print(rounds_table(times, flops, same, "planned"))


if __name__ == "__main__":
    main()
