"""No silent wrong answer: ranks that disagree, expert ids out of range under check=False, peers that never come."""

import os

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
    wide = p.top_experts.to(torch.int64)
    wide[1, 0] = 2**32 + 1  # int64: truncated to int32 it would be expert 1, a valid id
    wide_out = forward(wide, False)
    wide_raised = raised([world.check_errors])[0]
    wide_as_none = forward(torch.where(wide >= CONFIG.num_experts, -1, wide), False)
    return dict(same_as_none=torch.equal(unchecked, as_none), next_checked=next_checked, after=after,
                explicit=explicit, checked_refuses=raised([lambda: forward(bad, True)])[0], wide=wide_raised,
                wide_as_none=torch.equal(wide_out, wide_as_none))


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
        # an int64 id past int32 saturates (2**31 - 1): recorded, not wrapped onto a valid expert
        assert r["wide"] is not None and f"top_experts[1, 0] = {2**31 - 1}" in r["wide"], (rank, r["wide"])
        assert r["wide_as_none"], rank


def _one_rank_never_comes(world):
    import time

    from megamoe.megakernel import megamoe_forward

    cfg = MoEConfig(**{**CONFIG.__dict__, "num_experts": 6})
    p = make_problem(cfg, world.rank, world.size, 12, dtype=torch.bfloat16, seed=3)
    call = lambda: megamoe_forward(world, p.x, p.top_experts, p.router_weights, p.w_gate_up,  # noqa: E731
                                   p.w_down, p.shared, config=SMALL, max_tokens=12)
    call()  # one pass together: the kernel is built
    if world.rank == 2:  # skips the next pass and stays (a hung rank, not a dead one)
        time.sleep(60)
        return
    start = time.monotonic()
    try:
        call()
    except RuntimeError as exc:
        raise RuntimeError(f"{exc} [after {time.monotonic() - start:.1f} s]") from None


def test_a_peer_that_never_comes_is_named_within_the_timeout(monkeypatch):
    """Rank 2 skips a pass: the ranks that wait for it raise RuntimeError within MEGAMOE_PEER_TIMEOUT_S, naming
    the wait and rank 2 (on CPU ranks the megakernel's barriers meet through the group's store)."""
    import re

    monkeypatch.setenv("MEGAMOE_PEER_TIMEOUT_S", "3")
    with pytest.raises(RuntimeError) as info:
        launch(_one_rank_never_comes, 3)
    first = str(info.value).splitlines()[0]
    assert re.match(r"rank [01] failed first: RuntimeError: rank [01]: waited 3 s at .* for rank\(s\) \[2\], "
                    r"which never arrived", first), first
    seconds = float(re.search(r"\[after ([0-9.]+) s\]", first).group(1))
    assert 3 <= seconds < 3 + 4, first


def test_the_waits_budgets_are_configurable_and_checked(monkeypatch):
    from megamoe import runtime
    from megamoe.parallel.world import DEFAULT_PEER_TIMEOUT_S, peer_timeout_s
    from megamoe.runtime import resolve_wait_budget

    assert peer_timeout_s() == DEFAULT_PEER_TIMEOUT_S
    monkeypatch.setenv("MEGAMOE_PEER_TIMEOUT_S", "2.5")
    assert peer_timeout_s() == 2.5
    monkeypatch.delenv("MEGAMOE_WAIT_BUDGET", raising=False)
    with monkeypatch.context() as compiled:  # a barrier waits on the peers' host (a first pass's compiles): longer
        compiled.setattr(runtime, "interpreting", lambda: False)
        assert resolve_wait_budget() == runtime.DEFAULT_WAIT_BUDGET
        assert resolve_wait_budget(barrier=True) == runtime.DEFAULT_BARRIER_WAIT_BUDGET > runtime.DEFAULT_WAIT_BUDGET
    monkeypatch.setattr(runtime, "interpreting", lambda: True)
    assert resolve_wait_budget() == resolve_wait_budget(barrier=True) == runtime.DEFAULT_WAIT_BUDGET_INTERPRETED
    monkeypatch.setenv("MEGAMOE_WAIT_BUDGET", "1000")  # given: every wait's, barriers' too
    assert resolve_wait_budget() == resolve_wait_budget(barrier=True) == 1000 and resolve_wait_budget(7) == 7
    assert resolve_wait_budget(7, barrier=True) == 7
    for name, value, call in (("MEGAMOE_PEER_TIMEOUT_S", "0", peer_timeout_s),
                              ("MEGAMOE_PEER_TIMEOUT_S", "nan", peer_timeout_s),
                              ("MEGAMOE_WAIT_BUDGET", "-3", resolve_wait_budget),
                              ("MEGAMOE_WAIT_BUDGET", str(2**31), resolve_wait_budget)):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=name):
            call()


def test_the_ab_switches_read_0_or_1_and_refuse_anything_else(monkeypatch):
    from megamoe.runtime import env_switch

    monkeypatch.delenv("MEGAMOE_TEST_SWITCH", raising=False)
    assert env_switch("MEGAMOE_TEST_SWITCH", True) and not env_switch("MEGAMOE_TEST_SWITCH", False)
    for text, want in (("0", False), ("1", True), (" 1 ", True)):
        monkeypatch.setenv("MEGAMOE_TEST_SWITCH", text)
        assert env_switch("MEGAMOE_TEST_SWITCH", not want) is want
    for text in ("true", "", "2", "off"):
        monkeypatch.setenv("MEGAMOE_TEST_SWITCH", text)
        with pytest.raises(ValueError, match="MEGAMOE_TEST_SWITCH must be 0 or 1"):
            env_switch("MEGAMOE_TEST_SWITCH", False)


def test_the_ratio_knobs_read_a_number_at_least_0_and_refuse_anything_else(monkeypatch):
    from megamoe.runtime import env_ratio

    monkeypatch.delenv("MEGAMOE_TEST_RATIO", raising=False)
    assert env_ratio("MEGAMOE_TEST_RATIO", 2.5) == 2.5
    for text, want in (("0", 0.0), ("3", 3.0), (" 1.5 ", 1.5), ("inf", float("inf"))):
        monkeypatch.setenv("MEGAMOE_TEST_RATIO", text)
        assert env_ratio("MEGAMOE_TEST_RATIO", 7.0) == want
    for text in ("-1", "nan", "", "two", "-inf"):
        monkeypatch.setenv("MEGAMOE_TEST_RATIO", text)
        with pytest.raises(ValueError, match="MEGAMOE_TEST_RATIO must be a number >= 0"):
            env_ratio("MEGAMOE_TEST_RATIO", 1.0)


def test_a_retired_knob_still_set_is_refused_at_import(monkeypatch):
    """``retired_knob``: a gone knob in the environment raises, naming what replaced it; unset, nothing. The
    plan's old switch is one: importing megamoe with it set fails (a fresh interpreter)."""
    import subprocess
    import sys

    from megamoe.runtime import retired_knob

    monkeypatch.delenv("MEGAMOE_TEST_GONE", raising=False)
    retired_knob("MEGAMOE_TEST_GONE", "use MEGAMOE_TEST_NEW")
    monkeypatch.setenv("MEGAMOE_TEST_GONE", "1")
    with pytest.raises(ValueError, match="MEGAMOE_TEST_GONE is gone: use MEGAMOE_TEST_NEW"):
        retired_knob("MEGAMOE_TEST_GONE", "use MEGAMOE_TEST_NEW")
    done = subprocess.run([sys.executable, "-c", "import megamoe.ops.experts_bwd"], capture_output=True, text=True,
                          env={**os.environ, "MEGAMOE_WGRAD_PLANNED": "1"}, timeout=300)
    assert done.returncode != 0 and "MEGAMOE_WGRAD_PLANNED is gone: MEGAMOE_WGRAD_PLAN_SKEW=0" in done.stderr


def _gpu_rank_never_comes(world):
    import time

    from megamoe.megakernel import megamoe_forward

    cfg = MoEConfig(hidden=1024, intermediate=384, num_experts=8, top_k=2, shared=(256,))
    p = make_problem(cfg, world.rank, world.size, 256, dtype=torch.bfloat16, seed=3, device=world.device)
    call = lambda: megamoe_forward(world, p.x, p.top_experts, p.router_weights, p.w_gate_up,  # noqa: E731
                                   p.w_down, p.shared, max_tokens=256)
    call()
    if world.rank == world.size - 1:
        time.sleep(30)
        return None
    start = time.monotonic()
    message = raised([call], RuntimeError)[0]
    return message, time.monotonic() - start


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_a_peer_that_never_comes_is_named_by_the_waits(monkeypatch):
    """On the GPU the pass barrier's bounded wait (MEGAMOE_WAIT_BUDGET polls) names the rank it waited for."""
    monkeypatch.setenv("MEGAMOE_WAIT_BUDGET", str(1 << 22))
    ranks = max(2, torch.cuda.device_count())
    for rank, result in enumerate(launch(_gpu_rank_never_comes, ranks, device="cuda")[:-1]):
        message, seconds = result
        assert message is not None and f"barrier flag of rank {ranks - 1}" in message, (rank, message)
        assert seconds < 25, (rank, seconds)


def _non_finite(world, fused):
    from megamoe import moe
    from megamoe.reference.ep import ep_moe

    p = make_problem(CONFIG, world.rank, world.size, 12, dtype=torch.bfloat16, seed=4)
    x, w = p.x.clone(), p.router_weights.clone()
    if world.rank == 0:
        x[3, 7] = float("nan")
    else:
        w[5, 1] = float("inf")
    d_out = torch.randn(12, CONFIG.hidden, generator=torch.Generator().manual_seed(world.rank)).to(torch.bfloat16)
    results = {}
    for name, layer in (("megamoe", lambda *a: moe(world, *a, config=SMALL, fused_backward=fused)),
                        ("reference", lambda *a: ep_moe(world, *a))):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, p.w_gate_up, p.w_down)]
        shared = [tuple(t.detach().clone().requires_grad_() for t in pair) for pair in p.shared]
        out = layer(leaves[0], p.top_experts, leaves[1], leaves[2], leaves[3], shared)
        out.backward(d_out)
        tensors = [out, *(t.grad for t in leaves), *(t.grad for pair in shared for t in pair)]
        results[name] = [t.detach().float() for t in tensors]
    masks = [torch.equal(a.isfinite(), b.isfinite()) for a, b in zip(results["megamoe"], results["reference"])]
    out_m, out_r = results["megamoe"][0], results["reference"][0]
    finite = out_r.isfinite()
    close = bool(((out_m - out_r).abs()[finite] <= 2e-2 * out_r.abs()[finite].max()).all())
    bad_tokens = sorted(set((~finite).nonzero()[:, 0].tolist()))
    return masks, close, bad_tokens


@pytest.mark.parametrize("fused", [True, False])
def test_a_non_finite_input_stays_in_its_tokens_rows_as_in_the_reference(fused):
    """NaN in one token's x (rank 0) and Inf in one router weight (rank 1): the output is non-finite in exactly
    that token's row, as in the reference; every gradient has the reference's non-finite pattern; the other
    tokens' outputs are the reference's."""
    for rank, (masks, close, bad_tokens) in enumerate(launch(_non_finite, 2, fused)):
        assert bad_tokens == [(3, 5)[rank]], (rank, bad_tokens)
        assert all(masks), (rank, masks)
        assert close, rank


def _finite_checks(world):
    from megamoe import moe
    from megamoe.megakernel import megamoe_forward

    p = make_problem(CONFIG, world.rank, world.size, 12, dtype=torch.bfloat16, seed=5)
    x, w = p.x.clone(), p.router_weights.clone()
    x[4, 0] = float("inf")
    w[9, 0] = float("nan")
    args = (p.top_experts, w, p.w_gate_up, p.w_down, p.shared)
    return raised([lambda: megamoe_forward(world, x, *args, config=SMALL, check_finite=True),
                   lambda: moe(world, x, *args, config=SMALL, check_finite=True),
                   lambda: moe(world, p.x, *args, config=SMALL, check_finite=True)])


def test_the_opt_in_finite_check_names_the_token():
    for messages in launch(_finite_checks, 1):
        assert [m and m.split(" (")[0] for m in messages] == [
            "token 4 has a NaN or Inf in x", "token 4 has a NaN or Inf in x",
            "token 9 has a NaN or Inf in router_weights"], messages
        assert "(2 such tokens in all)" in messages[0] and "(1 such token in all)" in messages[2], messages


def test_gpu_tests_time_out_by_a_thread_that_a_blocked_kernel_cannot_hold(monkeypatch):
    """A GPU kernel that never finishes blocks its test in C: with a GPU, conftest gives every GPU test
    pytest-timeout's thread method (the signal method would never run); without one, they are skipped."""
    import conftest

    class Item:
        def __init__(self, gpu):
            self.keywords = {"gpu": True} if gpu else {}
            self.markers = []

        def add_marker(self, marker):
            self.markers.append(marker)

    for cuda in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        gpu, cpu = Item(True), Item(False)
        conftest.pytest_collection_modifyitems(None, [gpu, cpu])
        assert cpu.markers == []
        (marker,) = gpu.markers
        if cuda:
            assert marker.name == "timeout" and marker.kwargs == {"method": "thread"} and not marker.args
        else:
            assert marker.name == "skip"
