"""The EP world: ranks see each other's symmetric buffers, from torch and from Triton."""

import os

import pytest
import torch
import triton
import triton.language as tl

from megamoe.parallel.symmetric import BufferSpec, SymmetricWorkspace, workspace
from megamoe.parallel.world import launch


@triton.jit
def _pull_row_kernel(peer_ptrs, out_ptr, src_rank, n, BLOCK: tl.constexpr):
    """Copy ``n`` floats of rank ``src_rank``'s buffer into ``out`` through the peer table."""
    base = tl.load(peer_ptrs + src_rank).to(tl.pointer_type(tl.float32))
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(base + offs, mask=offs < n), mask=offs < n)


def _exchange(world):
    specs = [BufferSpec("rows", (4, 8), torch.float32), BufferSpec("flags", (3,), torch.int32)]
    ws = workspace(world, specs)
    assert workspace(world, specs) is ws  # cached per (group, specs)
    assert torch.equal(ws.local("rows"), torch.zeros(4, 8, device=world.device))  # starts zeroed
    ws.local("rows").copy_(torch.arange(32, dtype=torch.float32, device=world.device).view(4, 8) + 100 * world.rank)
    world.barrier()
    peer = (world.rank + 1) % world.size
    read = ws.peer("rows", peer).clone()
    ws.peer("flags", peer)[0] = 7 + world.rank  # write into the peer's memory
    out = torch.full((8,), -1.0, device=world.device)
    _pull_row_kernel[(1,)](ws.peer_ptrs("rows"), out, peer, 8, BLOCK=8)
    if world.is_cuda:
        torch.cuda.synchronize()
    world.barrier()
    result = (read.cpu(), ws.local("flags").cpu().clone(), out.cpu())
    world.barrier()
    ws.free()
    with pytest.raises(RuntimeError, match="freed"):
        ws.local("rows")
    return result


def _check_exchange(results):
    size = len(results)
    for rank, (read, flags, pulled) in enumerate(results):
        peer = (rank + 1) % size
        expected = torch.arange(32, dtype=torch.float32).view(4, 8) + 100 * peer
        assert torch.equal(read, expected)
        assert torch.equal(pulled, expected[0])
        writer = (rank - 1) % size
        assert flags[0] == 7 + writer and flags[1:].eq(0).all()


def test_cpu_ranks_read_and_write_each_others_buffers():
    _check_exchange(launch(_exchange, 3))


@pytest.mark.gpu
def test_gpu_ranks_read_and_write_each_others_buffers():
    _check_exchange(launch(_exchange, max(2, torch.cuda.device_count()), device="cuda"))


def _bad_workspace(world):
    errors = []
    for specs in ([BufferSpec("a", (2,), torch.float32), BufferSpec("a", (2,), torch.float32)],
                  [BufferSpec("a", (-1,), torch.float32)]):
        try:
            SymmetricWorkspace(world, specs)
        except ValueError as exc:
            errors.append(str(exc))
    ws = SymmetricWorkspace(world, [BufferSpec("a", (2,), torch.float32)])
    for call in (lambda: ws.local("b"), lambda: ws.peer("a", world.size)):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    ws.free()
    return errors


def test_bad_workspace_requests_raise_value_error():
    errors = launch(_bad_workspace, 2)[0]
    assert len(errors) == 4
    assert "appears twice" in errors[0] and "bad shape" in errors[1]
    assert "no buffer 'b'" in errors[2] and "rank must be in [0, 2)" in errors[3]


def _fail_on_rank_one(world):
    if world.rank == 1:
        raise ValueError("rank one refuses")
    return world.rank


def test_launch_reports_a_failing_rank():
    with pytest.raises(RuntimeError, match="rank 1 failed first: ValueError: rank one refuses"):
        launch(_fail_on_rank_one, 2)


def _bad_input_on_rank_one(world):
    from megamoe.config import MoEConfig
    from megamoe.bench.problem import make_problem
    from megamoe.megakernel import megamoe_forward

    cfg = MoEConfig(hidden=128, intermediate=64, num_experts=4, top_k=2)
    p = make_problem(cfg, world.rank, world.size, 8, dtype=torch.bfloat16, seed=0)
    x = p.x.float() if world.rank == 1 else p.x  # rank 1's bad input; rank 0 goes on into the collective
    return megamoe_forward(world, x, p.top_experts, p.router_weights, p.w_gate_up, p.w_down)


def test_launch_reports_the_rank_with_the_bad_input_before_the_peer_that_lost_it():
    """Rank 1 refuses its input; rank 0, waiting for it in a collective, fails after it (the connection closed)
    or is stopped: the report leads with rank 1's own error and traceback."""
    with pytest.raises(RuntimeError) as info:
        launch(_bad_input_on_rank_one, 2)
    text = str(info.value)
    assert text.startswith("rank 1 failed first: ValueError: x must be bfloat16"), text[:500]
    assert "in validate" in text, text[:2000]  # the traceback is rank 1's (MoEInputs.validate)


def test_launch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="nprocs"):
        launch(_fail_on_rank_one, 0)
    with pytest.raises(ValueError, match="device"):
        launch(_fail_on_rank_one, 1, device="tpu")


def _interpreter_state(world):
    from megamoe.runtime import interpreting

    return os.environ.get("TRITON_INTERPRET"), interpreting()


@pytest.mark.parametrize("before", [None, "0", "1"])
def test_cpu_ranks_interpret_and_the_callers_environment_is_left_as_it_was(monkeypatch, before):
    """CPU ranks run under the interpreter whatever the caller has; the caller's TRITON_INTERPRET comes back as it
    was (a CPU launch that left it set made a later GPU launch in the same process interpret, and its ranks die)."""
    if before is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", before)
    assert launch(_interpreter_state, 1, device="cpu") == [("1", True)]
    assert os.environ.get("TRITON_INTERPRET") == before


def _rank_sees(world, name):
    import sys

    from megamoe.megakernel import replay  # a switch read when its module is imported

    print(f"rank {world.rank} out")
    print(f"rank {world.rank} err", file=sys.stderr)
    return os.environ.get(name), replay.KEYED_POOL, os.getppid()


def test_forked_cpu_ranks_take_the_launchers_environment_and_output_at_each_call(monkeypatch, capfd):
    """CPU ranks fork from a server that imported torch once: each still takes the environment the launcher has at
    that call (set, changed or removed since the server started; megamoe's import-time switches read it) and
    writes where the launcher's stdout and stderr go then (here pytest's capture)."""
    monkeypatch.setenv("MEGAMOE_PROBE", "first")
    monkeypatch.setenv("MEGAMOE_KEYED_POOL", "0")
    first = launch(_rank_sees, 2, "MEGAMOE_PROBE")
    assert [r[:2] for r in first] == [("first", False)] * 2
    monkeypatch.delenv("MEGAMOE_PROBE")
    monkeypatch.setenv("MEGAMOE_KEYED_POOL", "1")
    second = launch(_rank_sees, 2, "MEGAMOE_PROBE")
    assert [r[:2] for r in second] == [(None, True)] * 2
    parents = {r[2] for r in first + second}
    assert len(parents) == 1 and os.getpid() not in parents, "the ranks were not forked from one server"
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert out.count(f"rank {rank} out") == 2 and err.count(f"rank {rank} err") == 2, (out, err)


def test_world_resources_keep_one_object_per_key_and_version_and_list_them_oldest_first():
    from megamoe.parallel.world import WorldResources

    kept = WorldResources()
    a = kept.get("a", lambda: ["a"])
    assert kept.get("a", lambda: ["other"]) is a  # kept, not remade
    b = kept.get("b", lambda: ["b"])
    assert list(kept) == [a, b] and len(kept) == 2
    a2 = kept.get("a", lambda: ["a2"], version=1)  # another version replaces the first
    assert a2 == ["a2"] and list(kept) == [b, a2]
    kept.discard(b)
    assert list(kept) == [a2]
