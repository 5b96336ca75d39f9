"""NVLink communication: pull dispatch, push combine and the backward pair against their torch twins.

Pure data movement, so every check is exact (bitwise). Each `launch` costs
seconds, so one launch per rank count runs a table of cases and returns what
failed; the test functions assert on the collected results.
"""

from __future__ import annotations

import pytest
import torch

from megamoe.ops import comm
from megamoe.ops.comm import CommShape, CommTuning
from megamoe.precision import FORMATS
from megamoe.reference import formats
from megamoe.routing.schedule import build_pull_schedule
from megamoe.parallel.world import launch

from raised import raised  # tests/raised.py

D = 384  # 3 chunks of 128 per row (a chunk count that is not a power of two); fp8-block works too


def _inputs(seed: int, tokens: list[int], k: int, L: int, routing: str):
    """Every rank's inputs, the same in every process: x, ids, weights, d_out per rank, and ids [R, N, k]."""
    R, n_max = len(tokens), max(tokens)
    g = torch.Generator().manual_seed(seed)
    E = R * L
    xs, tops, ws, d_outs = [], [], [], []
    for n in tokens:
        xs.append(torch.randn(n, D, generator=g).bfloat16())
        d_outs.append(torch.randn(n, D, generator=g).bfloat16())
        ws.append(torch.rand(n, k, generator=g))
        if routing == "uniform":  # expert 1 never chosen (an empty expert), some routes dropped
            ids = torch.randint(0, E - 1, (n, k), generator=g)
            ids = torch.where(ids >= 1, ids + 1, ids)
            ids[torch.rand(n, k, generator=g) < 0.2] = -1
        elif routing == "one-rank":  # every token of every rank to rank 0's experts
            ids = torch.randint(0, L, (n, k), generator=g)
        else:
            raise ValueError(routing)
        tops.append(ids)
    top_all = torch.full((R, n_max, k), -1, dtype=torch.int64)
    for r, ids in enumerate(tops):
        top_all[r, : ids.shape[0]] = ids
    return xs, tops, ws, d_outs, top_all


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (bf16 / fp8 / uint8 / fp32)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


#: (num_sms, tuning): grids and tiles, each checked bit-exact against the reference.
VARIANTS = (
    (3, CommTuning(tile_rows=2, num_warps=4)),
    (4, CommTuning(tile_rows=4, num_warps=2)),
    (2, CommTuning(tile_rows=1, num_warps=1)),
    (1, CommTuning()),
)


def _run_case(world, case: dict, failures: list[str]) -> None:
    tokens, k, L, align = case["tokens"], case["k"], case["L"], case["align"]
    me, R, device = world.rank, world.size, world.device
    name = case["name"]
    xs, tops, weights, d_outs, top_all = _inputs(case["seed"], tokens, k, L, case["routing"])
    shape = CommShape(R, max(tokens), D, k, L, align, push_dispatch=True)
    ws = comm.comm_workspace(world, shape)
    if comm.comm_workspace(world, shape) is not ws:
        failures.append(f"{name}: workspace not cached")
    ws.stage(x=xs[me].to(device), router_weights=weights[me].to(device), d_out=d_outs[me].to(device))
    sched = ws.pull_schedule(tops[me].to(device))
    scheds = [build_pull_schedule(top_all, r, L, align=align) for r in range(R)]
    if not torch.equal(sched.src_index.cpu(), scheds[me].src_index) or not torch.equal(
        sched.src_rank.cpu(), scheds[me].src_rank
    ):
        failures.append(f"{name}: schedule from the workspace's routing gather differs")
    valid = sched.src_rank.cpu() >= 0
    x_dev = [x.to(device) for x in xs]

    def check(what: str, got: torch.Tensor, want: torch.Tensor, rows=None) -> None:
        got, want = got.cpu(), want.cpu()
        if rows is not None:
            got, want = got[rows], want[rows]
        if not _same(got, want):
            failures.append(f"{name} rank {me}: {what} differs from the reference")

    # forward dispatch, pull: several grids and tiles give the same bits
    ref = comm.dispatch_reference(x_dev, sched)
    for num_sms, tuning in ((1, CommTuning(tile_rows=1)), (3, None), (64, CommTuning(tile_rows=4))):
        check(f"dispatch_pull num_sms={num_sms}", comm.dispatch_pull(ws, sched, num_sms=num_sms, tuning=tuning), ref)
    for num_sms, tuning in VARIANTS:  # other grids and tiles give the same bits
        check(f"dispatch_pull num_sms={num_sms} {tuning.label()}",
              comm.dispatch_pull(ws, sched, num_sms=num_sms, tuning=tuning), ref)
    sentinel = torch.full((sched.capacity, D), 7.0, dtype=torch.bfloat16, device=device)
    out = comm.dispatch_pull(ws, sched, num_sms=2, out=sentinel.clone(), rows=5)
    want = torch.where((torch.arange(sched.capacity) < 5)[:, None] & valid[:, None], ref.cpu(), sentinel.cpu())
    check("dispatch_pull rows=5 into a filled out (padding untouched)", out, want)
    for fmt in FORMATS:
        q = comm.dispatch_pull(ws, sched, num_sms=2, quantize=fmt)
        data, scale = comm.quantize_rows_reference(ref, fmt)
        check(f"dispatch_pull quantize={fmt} data", q.data, data, valid)
        check(f"dispatch_pull quantize={fmt} scale", q.scale, scale, valid)

    # forward combine, push into a filled slot buffer: untouched slots keep the fill
    ys = [torch.randn(s.capacity, D, generator=torch.Generator().manual_seed(case["seed"] + 100 + r)).bfloat16()
          for r, s in enumerate(scheds)]
    for dst, fn in (("combine", comm.combine_push), ("combine", comm.reverse_dispatch_push)):
        ws.local(dst).fill_(-3.0)
        got = fn(ws, sched, ys[me].to(device), num_sms=3)
        slots = torch.full((shape.max_tokens * k, D), -3.0, dtype=torch.bfloat16)
        check(f"{fn.__name__}", got, comm.combine_reference(ys, scheds, me, slots))
        ys = [y.flip(0).contiguous() for y in ys]
    for num_sms, tuning in VARIANTS:
        ws.local("combine").fill_(-3.0)
        got = comm.combine_push(ws, sched, ys[me].to(device), num_sms=num_sms, tuning=tuning)
        slots = torch.full((shape.max_tokens * k, D), -3.0, dtype=torch.bfloat16)
        check(f"combine_push num_sms={num_sms} {tuning.label()}", got, comm.combine_reference(ys, scheds, me, slots))

    # backward reverse-combine, pull: each route's upstream gradient row, unscaled (the expert backward applies w)
    ref_b = comm.dispatch_reference([d.to(device) for d in d_outs], sched)
    check("reverse_combine_pull", comm.reverse_combine_pull(ws, sched, num_sms=2), ref_b)
    q = comm.reverse_combine_pull(ws, sched, num_sms=2, quantize="mxfp8")
    data, scale = formats.mxfp8_quantize(ref_b.cpu(), dim=-1)
    check("reverse_combine_pull quantize=mxfp8", q.data, data, valid)
    for num_sms, tuning in VARIANTS[:2]:
        q = comm.reverse_combine_pull(ws, sched, num_sms=num_sms, quantize="mxfp8", tuning=tuning)
        check(f"reverse_combine_pull quantize=mxfp8 {tuning.label()}", q.data, data, valid)
        check(f"reverse_combine_pull quantize=mxfp8 {tuning.label()} scale", q.scale, scale, valid)

    # push dispatch (the experiment's twin): barrier-synchronised and flag-synchronised
    push = comm.build_push_schedule(ws, sched)
    for signal, num_sms in ((False, 2), (True, 3), (True, 1)):
        ws.local("routed").fill_(5.0)
        comm.device_barrier(ws)
        routed = comm.push_dispatch(ws, push, num_sms=num_sms, signal=signal, sync=not signal)
        if signal:
            comm.device_barrier(ws)  # the data is complete on this rank; keep peers from refilling early
        check(f"push_dispatch signal={signal}", routed, ref, valid)
    for num_sms, tuning in VARIANTS[:3]:
        ws.local("routed").fill_(5.0)
        comm.device_barrier(ws)
        routed = comm.push_dispatch(ws, push, num_sms=num_sms, signal=True, sync=False, tuning=tuning)
        comm.device_barrier(ws)
        check(f"push_dispatch signal=True {tuning.label()}", routed, ref, valid)
    ws.local("routed").fill_(5.0)
    comm.device_barrier(ws)
    routed = comm.push_dispatch(ws, push.below(4), num_sms=2, signal=True, sync=False)
    first = valid & (torch.arange(sched.capacity) < 4)
    check("push_dispatch below(4)", routed, ref, first)
    if not (routed.cpu()[valid & ~first] == 5.0).all():
        failures.append(f"{name} rank {me}: push_dispatch below(4) wrote rows >= 4")
    world.barrier()

    # pre-quantised rows: pulled as stored
    for fmt in ("mxfp8", "fp8-block"):
        qws = comm.comm_workspace(world, CommShape(R, max(tokens), D, k, L, align, row_format=fmt))
        qws.stage(x=xs[me].to(device), d_out=d_outs[me].to(device))
        got = comm.dispatch_pull(qws, sched, num_sms=2)
        data, scale = comm.quantize_rows_reference(ref, fmt)
        check(f"dispatch_pull row_format={fmt} data", got.data, data, valid)
        check(f"dispatch_pull row_format={fmt} scale", got.scale, scale, valid)
        got = comm.reverse_combine_pull(qws, sched, num_sms=3)  # d_out quantised once at home, pulled as stored
        data, scale = comm.quantize_rows_reference(ref_b, fmt)
        check(f"reverse_combine_pull row_format={fmt} data", got.data, data, valid)
        check(f"reverse_combine_pull row_format={fmt} scale", got.scale, scale, valid)
        # rows nobody reads as E4M3 (one rank's BF16 wgrads): staged as BF16, their E4M3 twin left as it was
        qws.local("x_q").fill_(0x7F)
        qws.local("x").fill_(3.0)
        x_me = xs[me].to(device)
        qws.stage(x=x_me, d_out=d_outs[me].to(device), unquantized=("x",))
        if not torch.equal(qws.local("x")[: x_me.shape[0]].cpu(), x_me.cpu()):
            failures.append(f"{name} rank {me}: stage(unquantized=('x',)) did not copy x ({fmt})")
        if not (qws.local("x_q").cpu() == 0x7F).all():
            failures.append(f"{name} rank {me}: stage(unquantized=('x',)) wrote x's E4M3 rows ({fmt})")
        qws.free()
    if ws.claims.cpu().tolist() != [0, 0]:  # the last program out of every launch zeroes the tile claims
        failures.append(f"{name} rank {me}: tile claims left at {ws.claims.cpu().tolist()} after the launches")
    ws.free()


def _suite(world, cases):
    failures: list[str] = []
    for case in cases:
        _run_case(world, case, failures)
    return failures


def _case(name, seed, tokens, k=2, L=2, align=1, routing="uniform"):
    return dict(name=name, seed=seed, tokens=tokens, k=k, L=L, align=align, routing=routing)


CASES = {
    2: [
        _case("uneven tokens, aligned regions", 1, [7, 4], k=3, align=4),
        _case("all tokens to rank 0", 2, [5, 6], routing="one-rank"),
    ],
    3: [_case("a rank with no tokens", 3, [6, 0, 9], k=2, L=3, align=2)],
    4: [_case("four ranks, one-rank routing", 4, [3, 5, 2, 4], k=2, L=1, routing="one-rank")],
}


@pytest.mark.parametrize("ranks", sorted(CASES))
def test_exact_against_reference_on_cpu_ranks(ranks):
    failures = launch(_suite, ranks, CASES[ranks])
    assert all(f == [] for f in failures), failures


# --------------------------------------------------------------------------- bounded waits


def _timeouts(world, budget):
    """Rank 1 never signals: rank 0's flag wait and its barrier time out with RuntimeError."""
    from megamoe.config import preset

    messages = {"max_tokens": comm.comm_shape(world, preset("tiny"), 3 + world.rank).max_tokens}
    shape = CommShape(world.size, 4, D, 2, 2, push_dispatch=True)
    ws = comm.comm_workspace(world, shape)
    g = torch.Generator().manual_seed(0)
    ws.stage(x=torch.randn(4, D, generator=g).bfloat16().to(world.device))
    sched = ws.pull_schedule(torch.randint(0, 2 * world.size, (4, 2), generator=g).to(world.device))
    push = comm.build_push_schedule(ws, sched)
    if world.rank == 0:
        for key, call in (
            ("push", lambda: comm.push_dispatch(ws, push, num_sms=2, signal=True, sync=False, wait_budget=budget)),
            ("after", lambda: comm.dispatch_pull(ws, sched, num_sms=1, sync=False)),
        ):
            try:
                call()
            except RuntimeError as exc:
                messages[key] = str(exc)
    world.barrier()
    ws.free()
    ws = comm.comm_workspace(world, shape)
    if world.rank == 0:
        try:
            comm.device_barrier(ws, wait_budget=budget)
        except RuntimeError as exc:
            messages["barrier"] = str(exc)
    world.barrier()
    ws.free()
    return messages


def _check_timeouts(messages):
    assert messages["max_tokens"] == 4  # the largest token count of the group sizes the workspace
    assert "flag 'dispatch_ready' of rank 1" in messages["push"], messages
    assert "unusable after an earlier timeout" in messages["after"], messages
    assert "flag 'barrier' of rank 1" in messages["barrier"], messages


def test_a_peer_that_never_signals_raises_instead_of_hanging():
    _check_timeouts(launch(_timeouts, 2, 50)[0])


@pytest.mark.gpu
def test_gpu_a_peer_that_never_signals_raises_instead_of_hanging():
    _check_timeouts(launch(_timeouts, 2, 1 << 16, device="cuda")[0])


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", sorted(CASES))
def test_gpu_exact_against_reference(ranks):
    if not torch.cuda.is_available() or torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs")
    failures = launch(_suite, ranks, CASES[ranks], device="cuda")
    assert all(f == [] for f in failures), failures


# --------------------------------------------------------------------------- bad arguments


def _bad_arguments(world):
    shape = CommShape(world.size, 4, D, 2, 2)
    ws = comm.comm_workspace(world, shape)
    sched = ws.pull_schedule(torch.zeros(4, 2, dtype=torch.int32))
    other = build_pull_schedule(torch.zeros(world.size, 4, 3, dtype=torch.int32), world.rank, 2)
    y = torch.zeros(sched.capacity, D, dtype=torch.bfloat16)
    calls = [
        lambda: comm.dispatch_pull(ws, sched, num_sms=0),
        lambda: comm.dispatch_pull(ws, sched, num_sms=True),
        lambda: comm.dispatch_pull(ws, other, num_sms=1),
        lambda: comm.dispatch_pull(ws, sched, num_sms=1, quantize="int4"),
        lambda: comm.dispatch_pull(ws, sched, num_sms=1, out=y[:, :64]),
        lambda: comm.dispatch_pull(ws, sched, num_sms=1, rows=-1),
        lambda: comm.combine_push(ws, sched, y.float(), num_sms=1),
        lambda: comm.combine_push(ws, sched, y[1:], num_sms=1),
        lambda: comm.reverse_dispatch_push(ws, sched, y, num_sms=-2),
        lambda: comm.build_push_schedule(ws, sched),
        lambda: ws.stage(x=torch.zeros(5, D, dtype=torch.bfloat16)),
        lambda: ws.stage(router_weights=torch.zeros(4, 2, dtype=torch.float64)),
        lambda: comm.device_barrier(ws, wait_budget=0),
    ]
    errors = raised(calls)
    ws.free()
    fresh = comm.comm_workspace(world, shape)
    errors.append(None if fresh is ws else "a freed workspace is replaced")
    world.close()
    return errors


def test_bad_arguments_raise_value_error():
    errors = launch(_bad_arguments, 1)[0]
    assert errors.pop() == "a freed workspace is replaced"
    assert None not in errors, errors
    joined = "\n".join(errors)
    for text in ("num_sms must be a positive int", "R=1, k=3", "quantize must be", "out must be a 2-D tensor",
                 "rows must be None", "must be bfloat16", "must have", "push_dispatch=True", "more than the workspace",
                 "router_weights must be float32", "wait_budget"):
        assert text in joined, (text, joined)


def test_shape_and_tuning_validation():
    with pytest.raises(ValueError, match="multiple of 64"):
        CommShape(2, 8, 100, 2)
    with pytest.raises(ValueError, match="row_format"):
        CommShape(2, 8, 128, 2, row_format="fp4")
    with pytest.raises(ValueError, match="multiple of 128"):
        CommShape(2, 8, 192, 2, row_format="fp8-block")
    with pytest.raises(ValueError, match="tile_rows"):
        CommTuning(tile_rows=3)
    with pytest.raises(ValueError, match="tile_rows"):
        CommTuning(tile_rows=128)
    with pytest.raises(ValueError, match="num_warps"):
        CommTuning(num_warps=0)
    assert CommShape(2, 8, 128, 2, experts_per_rank=3, align=4).capacity == 2 * 8 * 2 + 3 * 3
    # (CHUNKS, CP, W, ROWS, ALIGN): kimi-k2 bf16 rows, their E4M3 bytes and fp32 / E8M0 scale rows
    assert comm.copy_tile(7168, 2, CommTuning()) == (28, 32, 256, 8, 8)
    assert comm.copy_tile(7168, 1, CommTuning()) == (14, 16, 512, 8, 16)
    assert comm.copy_tile(56, 4, CommTuning()) == (7, 8, 8, 128, 4)
    assert comm.copy_tile(224, 1, CommTuning()) == (7, 8, 32, 128, 16)

