"""GraphReplay's policy (capture on a key's second sighting, replay after, least recently used out), with the
CUDA graph calls faked: the real capture runs in the GPU test of tests/test_megakernel.py."""

from contextlib import contextmanager

import pytest
import torch

from megamoe.megakernel.replay import GraphReplay, layout_key


class _FakeGraph:
    def __init__(self):
        self.replayed = 0

    def replay(self):
        self.replayed += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    state = {"capturing": False, "captured": 0}

    @contextmanager
    def graph(g):
        state["captured"] += 1
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
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
