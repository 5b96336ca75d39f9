"""`megamoe trace`: the TRACE buffer's decoding, the Chrome trace and PNG of a recorded H200 pass, the CLI."""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from megamoe.cli import app
from megamoe.kernels import sync
from megamoe.tools import trace as tr

#: A forward pass recorded on one H200 (`megamoe trace --preset kimi-k2 --tokens 1024`; benchmarks/results/
#: 2026-12-02-trace).
MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
RECORDED = os.path.join(os.path.dirname(__file__), "data", "trace_kimi-k2_1024_h200.json.gz")


def _buffer(programs: int, events: dict[int, list[tuple[int, int, int, int]]], logged: dict[int, int] | None = None):
    t = torch.zeros(programs, sync.TRACE_ROW.value, dtype=torch.int64)
    for p in range(programs):
        t[p, sync.TRACE_START.value] = 1_000 + 10 * p
        t[p, sync.TRACE_END.value] = 9_000 + p
        t[p, sync.TRACE_SM.value] = 100 + p
        rows = events.get(p, [])
        t[p, sync.TRACE_EVENTS.value] = (logged or {}).get(p, len(rows))
        for e, ev in enumerate(rows):
            base = sync.TRACE_FIELDS.value + e * sync.TRACE_EVENT_WORDS.value
            t[p, base: base + 4] = torch.tensor(ev)
    return t


def test_decode_reads_each_programs_row_and_counts_dropped_events():
    gate_up, wait = sync.TRACE_KIND_GATE_UP.value, sync.WAIT_ROWS_READY.value
    t = _buffer(3, {1: [(3_000, 4_000, gate_up, 5 << 16 | 2), (1_500, 2_500, wait, 0)]},
                logged={2: sync.TRACE_MAX_EVENTS.value + 7})
    programs = tr.decode(t, comm_sms=1)
    assert [p["role"] for p in programs] == ["comm", "compute", "compute"]
    assert [p["sm"] for p in programs] == [100, 101, 102]
    assert programs[0]["start"] == 0 and programs[2]["end"] == 9_002 - 1_000
    assert programs[1]["events"] == [[500, 1_500, wait, 0], [2_000, 3_000, gate_up, 5 << 16 | 2]]  # sorted, from t0
    assert programs[2]["dropped"] == 7 and len(programs[2]["events"]) == sync.TRACE_MAX_EVENTS.value
    chrome = tr.chrome_trace(tr.new_record([{"rank": 0, "programs": programs}], "p", 1, "bf16"))
    names = {e["name"]: e for e in chrome["traceEvents"] if e["ph"] == "X"}
    assert names["gate/up + SwiGLU"]["args"] == {"tile": 5, "n": 2} and names["gate/up + SwiGLU"]["dur"] == 1.0
    assert names["wait: rows_ready of minibatch"]["args"] == {"index": 0}


def test_recorded_h200_pass_converts_to_the_expected_tracks_and_events(tmp_path):
    record = tr.load(RECORDED)
    chrome = json.loads(json.dumps(tr.chrome_trace(record)))  # valid JSON, as written
    events = chrome["traceEvents"]
    for r in record["ranks"]:
        programs, c = r["programs"], r["config"]
        assert len(programs) == c["num_sms"] and sum(p["role"] == "comm" for p in programs) == c["comm_sms"]
        tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"
                  and e["pid"] == r["rank"]}
        assert sorted(tracks) == list(range(c["num_sms"]))
        assert all(tracks[p].startswith("comm ") == (p < c["comm_sms"]) for p in tracks)
        assert not any(p["dropped"] for p in programs)
        # every task the schedule implied is on the timeline exactly once, inside its program's run
        counts = Counter(e["name"] for e in events if e["ph"] == "X" and e["pid"] == r["rank"])
        for name, want in r["expected"].items():
            assert counts[name] == want, (name, counts[name], want)
        assert counts["shared gate/up"] > 0 and counts["shared down"] > 0  # kimi-k2 has a shared expert
        for p in programs:
            assert all(p["start"] <= s <= e <= p["end"] for s, e, _, _ in p["events"]), p["program"]
            kinds = {tr.event_name(k)[1] for _, _, k, _ in p["events"]}
            assert kinds <= ({"pull", "push", "wait"} if p["role"] == "comm" else
                             {"gate_up", "down", "shared", "wait"}), (p["program"], kinds)
    png = tmp_path / "trace.png"
    skipped = tr.timeline_png(record, str(png))
    if MATPLOTLIB:
        assert skipped is None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    else:
        assert "matplotlib is not installed" in skipped and not png.exists()
    rows = tr.summary(record)
    assert {row["role"] for row in rows} == {"comm", "compute"}
    assert all(row["end_ms"] > 0 for row in rows)


def test_cli_converts_a_record_and_refuses_a_run_without_a_gpu(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["trace", "--from", RECORDED, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert {"trace.json", *(["trace.png"] if MATPLOTLIB else [])} <= set(os.listdir(tmp_path))
    assert MATPLOTLIB or "matplotlib is not installed" in result.output
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    result = runner.invoke(app, ["trace", "--from", str(bad), "--out", str(tmp_path)])
    assert result.exit_code == 2 and "not a megamoe trace record" in result.output
    if not torch.cuda.is_available():
        result = runner.invoke(app, ["trace", "--out", str(tmp_path)])
        assert result.exit_code == 2 and "CUDA GPU" in result.output and "--from" in result.output
    for steady in ("-1", "nan", "inf"):  # refused before any pass, on any machine
        result = runner.invoke(app, ["trace", "--steady", steady, "--out", str(tmp_path)])
        assert result.exit_code == 2 and "--steady must be" in result.output, result.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_trace_records_every_task(tmp_path):
    result = CliRunner().invoke(app, ["trace", "--preset", "qwen3.5-397b", "--tokens", "512", "--steady", "0.2",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    record = tr.load(str(tmp_path / "trace_record.json.gz"))
    assert all(r["passes"] > 3 for r in record["ranks"])  # the steady passes ran before the traced one
    for r in record["ranks"]:
        counts = Counter(tr.event_name(k)[0] for p in r["programs"] for _, _, k, _ in p["events"])
        assert all(counts[name] == want for name, want in r["expected"].items()), (counts, r["expected"])
