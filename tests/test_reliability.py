"""No silent wrong answer: ranks that disagree, expert ids out of range under check=False, peers that never come."""

import pytest
import torch

from megamoe.bench.problem import make_problem
from megamoe.config import MoEConfig
from megamoe.parallel.world import launch
from megamoe.planner import KernelConfig, LayerShape

from raised import raised  # tests/raised.py

CONFIG = MoEConfig(hidden=128, intermediate=64, num_experts=8, top_k=2, shared=(32,))
SMALL = KernelConfig(num_sms=4, comm_sms=1, minibatch=32, ring_rows=256, tile_m=32, tile_n=32)


def _disagreeing_kernels(world):
    from megamoe.megakernel import MegaKernel

    cases = {
        "max_tokens": lambda: MegaKernel(world, LayerShape.of(CONFIG, 2, 12 + 4 * world.rank), SMALL),
        "D": lambda: MegaKernel(world, LayerShape.of(MoEConfig(**{**CONFIG.__dict__, "hidden": 128 + 64 * world.rank}),
                                                     2, 12), SMALL),
        "k": lambda: MegaKernel(world, LayerShape.of(MoEConfig(**{**CONFIG.__dict__, "top_k": 2 + world.rank}), 2,
                                                     12), SMALL),
        "precision": lambda: MegaKernel(world, LayerShape.of(CONFIG, 2, 12), SMALL,
                                        precision=("bf16", "fp8-block")[world.rank]),
        "config": lambda: MegaKernel(world, LayerShape.of(CONFIG, 2, 12),
                                     KernelConfig(4, 1 + world.rank, 32, 256, 32, 32)),
    }
    return dict(zip(cases, raised(cases.values())))


def test_ranks_that_disagree_raise_on_every_rank_naming_the_field_and_the_values():
    """One all-gather when a MegaKernel is built: each field the ranks disagree on, with every rank's value."""
    wants = {"max_tokens": "rank 0 12, rank 1 16", "D": "rank 0 128, rank 1 192", "k": "rank 0 2, rank 1 3",
             "precision": "rank 0 'bf16', rank 1 'fp8-block'", "config": "comm_sms=1"}
    for rank, got in enumerate(launch(_disagreeing_kernels, 2)):
        for field, want in wants.items():
            message = got[field]
            assert message is not None and "the ranks disagree" in message and f"{field}:" in message, (rank, field,
                                                                                                       message)
            assert want in message, (rank, field, message)


def _bad_ids_unchecked(world):
    from megamoe.megakernel import megamoe_forward

    p = make_problem(CONFIG, world.rank, world.size, 12, dtype=torch.bfloat16, seed=2)
    bad = p.top_experts.clone()
    token, slot, value = ((5, 0, -7), (3, 1, 99))[world.rank]
    bad[token, slot] = value
    bad[token + 2, 1 - slot] = 8 + world.rank  # a later bad id: the first one is reported
    dropped = torch.where((bad < -1) | (bad >= CONFIG.num_experts), -1, bad)

    def forward(ids, check):
        return megamoe_forward(world, p.x, ids, p.router_weights, p.w_gate_up, p.w_down, p.shared, config=SMALL,
                               max_tokens=12, check=check)

    unchecked = forward(bad, False)  # runs: the bad routes as none
    as_none = forward(dropped, False)
    next_checked = raised([lambda: forward(p.top_experts, True)])[0]
    after = raised([lambda: forward(p.top_experts, True)])[0]  # reported once
    forward(bad, False)
    explicit = raised([world.check_errors])[0]
    return dict(same_as_none=torch.equal(unchecked, as_none), next_checked=next_checked, after=after,
                explicit=explicit, checked_refuses=raised([lambda: forward(bad, True)])[0])


def test_out_of_range_ids_under_check_false_are_recorded_and_raised_by_the_next_checked_call():
    """check=False does not read the ids on the host: the pass records the first bad id on the device and runs
    it as no route; the next checked call (or world.check_errors()) raises ValueError naming token, slot and id."""
    for rank, r in enumerate(launch(_bad_ids_unchecked, 2)):
        token, slot, value = ((5, 0, -7), (3, 1, 99))[rank]
        assert r["same_as_none"], rank
        for key in ("next_checked", "explicit"):
            assert r[key] is not None and f"top_experts[{token}, {slot}] = {value}" in r[key], (rank, key, r[key])
        assert r["after"] is None, r
        assert r["checked_refuses"] is not None and "top_experts holds ids" in r["checked_refuses"], r
