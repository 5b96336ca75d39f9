"""GraphReplay's policy (capture on a key's second sighting, replay after, least recently used out), with the
CUDA graph calls faked: the real capture runs in the GPU test of tests/test_megakernel.py."""

from contextlib import contextmanager

import pytest
import torch

from megamoe.megakernel.replay import GraphReplay, KeyedPool, device_pool, graph_counts, layout_key


class _FakeGraph:
    def __init__(self):
        self.replayed = 0

    def replay(self):
        self.replayed += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    state = {"capturing": False, "captured": 0, "pools": [], "handles": 0}

    @contextmanager
    def graph(g, pool=None):
        state["captured"] += 1
        state["pools"].append(pool)
        yield

    def graph_pool_handle():
        state["handles"] += 1
        return ("pool", state["handles"])

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", graph_pool_handle)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    return state


def test_keys_are_captured_when_seen_again_and_replayed_until_evicted(fake_cuda):
    replay = GraphReplay(max_graphs=1)
    ran = []

    def work(key):
        ran.append(key)
        return f"result of {key} #{len(ran)}"

    got = [replay(key, lambda key=key: work(key)) for key in "AAABABBA"]
    # A: eager, capture, replay; B: eager; A: replay; B: capture (evicts A), replay; A: eager again
    assert ran == ["A", "A", "B", "B", "A"]
    assert (replay.captures, replay.replays, fake_cuda["captured"]) == (2, 5, 2)
    assert got[1] == got[2] == got[4] == "result of A #2"  # a replay returns what the capture returned
    assert got[5] == got[6] == "result of B #4"


def test_a_shared_pool_takes_every_capture_and_work_that_returns_nothing(fake_cuda):
    """The backward's graphs (``shared_pool``) are captured into one pool; each graph of its own otherwise."""
    shared, own = GraphReplay(shared_pool=True), GraphReplay()
    for key in "AABBCC":
        shared(key, lambda: None)
        own(key, lambda: None)
    pools = fake_cuda["pools"]
    assert pools[0::2] == [("pool", 1)] * 3 and pools[1::2] == [None] * 3 and fake_cuda["handles"] == 1
    # a later graph may reuse a shared pool's memory: what a graph returned would be overwritten
    shared("D", lambda: "kept")
    with pytest.raises(RuntimeError, match="must return None"):
        shared("D", lambda: "kept")


def test_inside_another_capture_the_work_runs_eagerly(fake_cuda):
    replay = GraphReplay()
    fake_cuda["capturing"] = True
    ran = [replay("A", lambda: "eager") for _ in range(3)]
    assert ran == ["eager"] * 3 and replay.captures == replay.replays == 0


def test_keys_seen_once_are_bounded(fake_cuda):
    replay = GraphReplay(max_graphs=2)
    for key in range(10):  # every key once: no capture, and only the last 4 remembered
        replay(key, lambda: None)
    replay(0, lambda: None)  # forgotten: eager again, not captured
    assert replay.captures == 0
    replay(9, lambda: None)  # remembered: captured now
    assert replay.captures == 1


def test_layout_key_names_address_shape_strides_and_dtype():
    t = torch.zeros(4, 6)
    assert layout_key([t, None]) == ((t.data_ptr(), (4, 6), (6, 1), torch.float32), None)
    assert layout_key([t.t()]) != layout_key([t])


def test_max_graphs_must_be_positive():
    with pytest.raises(ValueError, match="max_graphs"):
        GraphReplay(max_graphs=0)


def test_graph_counts_sum_the_kept_kernels_forward_and_backward_graphs(fake_cuda):
    """What `megamoe train` and benchmarks/backward_kernels.py record: every kept kernel's replays and captures,
    the forward's and the backward's apart; objects without graphs (CPU kernels, other resources) not counted."""
    class Kernel:
        def __init__(self, backward: bool):
            self.replay = GraphReplay()
            self.backward_replay = GraphReplay(shared_pool=True) if backward else None

    class World:
        resources = [Kernel(True), Kernel(False), type("CpuKernel", (), {"replay": None})(), object(),
                     type("Other", (), {"replay": lambda self: None})()]  # a method named replay: not a kernel

    for kernel, keys in zip(World.resources[:2], ("AAA", "AAAAB")):
        for key in keys:
            kernel.replay(key, lambda: "out")
    for key in "XXYYY":
        World.resources[0].backward_replay(key, lambda: None)
    assert graph_counts(World()) == {"kernels": 2, "replays": 2 + 3, "captures": 1 + 1,
                                     "backward_replays": 1 + 2, "backward_captures": 2}
    assert graph_counts(type("Empty", (), {"resources": []})()) == {
        "kernels": 0, "replays": 0, "captures": 0, "backward_replays": 0, "backward_captures": 0}


def test_the_keyed_pool_is_the_shared_allocator_on_the_cpu_and_inside_another_capture(fake_cuda):
    """No private pool on the CPU; on the GPU none is entered while another graph is being captured (its
    allocations belong to that graph's pool)."""
    import contextlib

    cpu = KeyedPool(torch.device("cpu"), enabled=True)
    assert cpu.pool is None and isinstance(cpu.allocating(), contextlib.nullcontext)
    gpu = KeyedPool(torch.device("cpu"))
    gpu.pool = object()  # a pool (never entered here)
    fake_cuda["capturing"] = True
    assert isinstance(gpu.allocating(), contextlib.nullcontext)


def test_kernels_share_one_keyed_pool_per_device(monkeypatch):
    """``device_pool``: one enabled pool per CUDA device for the process (``cuda`` and ``cuda:0`` name one device
    here), so kernels reuse each other's freed blocks; disabled or on the CPU a pool of none, never the shared one."""
    from megamoe.megakernel import replay

    made = []
    monkeypatch.setattr(torch.cuda, "MemPool", lambda: made.append(object()) or made[-1])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(replay, "_DEVICE_POOLS", {})
    first = device_pool(torch.device("cuda"), enabled=True)
    assert device_pool(torch.device("cuda:0"), enabled=True) is first and first.pool is made[0]
    other = device_pool(torch.device("cuda:1"), enabled=True)
    assert other is not first and other.pool is made[1] and len(made) == 2
    for off in (device_pool(torch.device("cuda:0"), enabled=False), device_pool(torch.device("cpu"), enabled=True)):
        assert off.pool is None and off is not first
    monkeypatch.setattr(replay, "KEYED_POOL", True)
    assert device_pool(torch.device("cuda:0")) is first  # None reads the switch
