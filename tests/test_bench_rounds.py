"""`megamoe bench`'s timing: implementations interleaved in rounds after the warm-up and the steady phase, and
what every record says (p10 / p50 / p90, the machine, the commit, the floor, the settings)."""

import contextlib
import io
import os
import re
import stat
import sys

import pytest
import torch
from rich.console import Console

from megamoe.bench import machine
from megamoe.bench.harness import BenchOptions
from megamoe.bench.report import print_table
from megamoe.parallel.world import launch


class _Logged:
    """A runner that writes each call the harness makes to stderr (rank 0), between the progress lines."""

    def __init__(self, runner, impl: str, rank: int):
        self._runner, self._impl, self._rank = runner, impl, rank

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def _log(self, method: str) -> None:
        if self._rank == 0:
            print(f"  call {self._impl} {method}", file=sys.stderr)

    def forward(self):
        self._log("forward")
        return self._runner.forward()

    def train_forward(self):
        self._log("train_forward")
        return self._runner.train_forward()

    def backward(self, out):
        self._log("backward")
        return self._runner.backward(out)

    def step(self):
        self._log("step")
        return self._runner.step()


def _instrumented(world, opts):
    from megamoe.bench import harness

    for impl in opts.impls:
        harness.RUNNERS[impl] = (lambda make, impl: lambda w, p, *a: _Logged(make(w, p, *a), impl, w.rank))(
            harness.RUNNERS[impl], impl)
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        records = harness.run_rank(world, opts)
    return records, log.getvalue()


def _phases(log: str, name: str) -> list[tuple[str, list[str]]]:
    """Pass ``name``'s progress lines, each with the calls that followed it."""
    phases, inside = [], False
    for line in (s.strip() for s in log.splitlines()):
        if re.fullmatch(r"\w+: .*every round in this order", line):
            inside = line.startswith(f"{name}:")
        elif inside and line.startswith("call "):
            phases[-1][1].append(line[len("call "):])
        elif inside:
            phases.append((line, []))
    return phases


def test_rounds_interleave_every_impl_after_the_warm_up_and_the_records_say_how(monkeypatch):
    monkeypatch.delenv("MEGAMOE_COMMIT", raising=False)  # the ranks inherit the environment
    impls = ("reference", "nccl-torch")
    opts = BenchOptions(preset="tiny", tokens=(8,), ep=2, device="cpu", impls=impls, passes=("fwd", "bwd"),
                        iters=3, warmup=2, steady=0.05, progress=True)
    (records, log), (records1, _) = launch(_instrumented, 2, opts)
    one_round = {"fwd": [f"{i} forward" for i in impls],
                 "bwd": [f"{i} {m}" for i in impls for m in ("train_forward", "backward")]}
    for name in ("fwd", "bwd"):
        phases = _phases(log, name)
        heads = [head for head, _ in phases]
        assert heads == [f"warm-up 1/2 {name}", f"warm-up 2/2 {name}", f"steady {name}: back to back for 0.05 s",
                         f"round 1/3 {name}", f"round 2/3 {name}", f"round 3/3 {name}"], log
        for head, calls in phases:  # every round visits every impl once, in the same order
            if head.startswith("steady"):
                assert calls and calls == one_round[name] * (len(calls) // len(one_round[name])), log
            else:
                assert calls == one_round[name], (head, log)
    assert log.index("round 3/3 fwd") < log.index("warm-up 1/2 bwd")
    # records: impl by impl, pass by pass, as before the rounds; every rank's the same
    assert [(r["impl"], r["pass"]) for r in records] == [(i, p) for i in impls for p in ("fwd", "bwd")]
    assert [r["time_ms"] for r in records1] == [r["time_ms"] for r in records]
    commit = records[0]["commit"]
    assert commit is None or re.fullmatch(r"[0-9a-f]{40}", commit), commit
    for r in records:
        assert r["correct"] and r["iters"] == 3, r
        assert 0 <= r["time_ms_p10"] <= r["time_ms_p50"] <= r["time_ms_p90"] and r["time_ms"] == r["time_ms_p50"], r
        assert r["warmup"] == 2 and r["steady_s"] == 0.05 and r["steady_rounds"] >= 1 and r["rounds"] == "interleaved"
        # CPU ranks capture no CUDA graph: nothing replayed or captured inside the timed rounds
        assert r["graphs_in_rounds"] == {"replays": 0, "captures": 0, "backward_replays": 0,
                                         "backward_captures": 0}, r
        assert r["floor_ms"] is None and r["x_floor"] is None  # no measured rates for a CPU
        assert r["device_name"] and r["device_count"] == os.cpu_count()
        assert r["driver_version"] is None and r["power_limit_w"] is None and r["sm_clock_mhz"] is None
        assert r["torch"] == torch.__version__ and r["commit"] == commit
        assert isinstance(r["dirty"], bool) if commit else r["dirty"] is None


def test_floor_is_the_longer_of_compute_and_links_on_an_h200_only():
    tflop = 1e12
    # 656 TFLOP at BF16 is one second; cross-rank bytes at 335 GB/s
    assert machine.floor_ms("NVIDIA H200", "bf16", "bf16", 656 * tflop, 600 * tflop, 0.0) == pytest.approx(1e3)
    assert machine.floor_ms("NVIDIA H200", "bf16", "bf16", 1.0, 0.0, 670e9) == pytest.approx(2e3)
    # FP8 experts: the routed FLOPs at 1189 TFLOP/s, the shared ones still at BF16's rate
    assert machine.floor_ms("NVIDIA H200", "bf16", "fp8-block", 1845 * tflop, 1189 * tflop, 0.0) == \
        pytest.approx(2e3)
    for device_name, precision in (("cpu", "bf16"), (None, "bf16"), ("NVIDIA H100 80GB HBM3", "bf16"),
                                   ("NVIDIA H200", "fp32")):
        assert machine.floor_ms(device_name, precision, "bf16", tflop, tflop, 1e9) is None


def test_commit_of_the_checkout_or_none(monkeypatch, tmp_path):
    monkeypatch.delenv("MEGAMOE_COMMIT", raising=False)
    commit, dirty = machine.git_commit()
    if commit is not None:  # this checkout (None when the package runs from an installed copy)
        assert re.fullmatch(r"[0-9a-f]{40}", commit) and isinstance(dirty, bool)
    monkeypatch.setattr(machine, "__file__", str(tmp_path / "megamoe" / "bench" / "machine.py"))
    assert machine.git_commit() == (None, None)  # not a git checkout
    monkeypatch.setenv("MEGAMOE_COMMIT", "abc123")  # a copy of the tree without .git says which commit it is
    assert machine.git_commit() == ("abc123", None)


def _fake_nvidia_smi(folder, body: str) -> None:
    exe = folder / "nvidia-smi"
    exe.write_text(f"#!{sys.executable}\nimport sys\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)


def test_nvidia_smi_fields_and_clocks(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert machine.nvidia_smi("clocks.sm") is None and machine.sm_clocks_mhz("cuda") is None  # absent
    _fake_nvidia_smi(tmp_path, "q = sys.argv[1]\n"
                               "rows = {'--query-gpu=clocks.sm': ['1980', '1755'],\n"
                               "        '--query-gpu=driver_version,power.limit': ['580.159.04, 700.00',\n"
                               "                                                   '580.159.04, [N/A]']}[q]\n"
                               "print('\\n'.join(rows))")
    assert machine.sm_clocks_mhz("cuda") == [1980.0, 1755.0] and machine.sm_clocks_mhz("cpu") is None
    assert machine.nvidia_smi("driver_version,power.limit") == [["580.159.04", "700.00"], ["580.159.04", "[N/A]"]]
    assert machine.clock_range([[1980.0, 1755.0], None, [1410.0]]) == [1410.0, 1980.0]
    assert machine.clock_range([None, None]) is None
    _fake_nvidia_smi(tmp_path, "sys.exit(9)")  # fails: unknown, not an error
    assert machine.sm_clocks_mhz("cuda") is None


def test_bench_options_defaults_by_device_and_steady_refusals():
    opts = BenchOptions(preset="tiny", tokens=(8,), ep=2, device="cpu")
    assert (opts.iters, opts.warmup, opts.steady) == (3, 1, 0.0)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="steady must be a number of seconds >= 0"):
            BenchOptions(preset="tiny", tokens=(8,), ep=2, device="cpu", steady=bad)


def _record(impl, ms, **extra):
    return {"impl": impl, "preset": "kimi-k2", "precision": "bf16", "pass": "fwd", "ep": 2, "tokens_per_rank": 8192,
            "machine": "NVIDIA H200", "time_ms": ms, "time_ms_p10": ms * 0.9, "time_ms_p50": ms,
            "time_ms_p90": ms * 1.1, "tflops": 400.0, "cross_gbps": 200.0, "max_abs_err": 0.1, "rel_err": 1e-3,
            "correct": True, "worst_tensor": "out", **extra}


def test_table_prints_p50_the_floor_and_the_machine():
    shared = dict(device_name="NVIDIA H200", device_count=2, driver_version="580.159.04", power_limit_w=700.0,
                  torch="2.11", triton="3.6", commit="a" * 40, dirty=True, iters=20, warmup=3, steady_s=2.0,
                  floor_ms=10.0)
    records = [_record("nccl-torch", 24.0, x_floor=2.4, sm_clock_mhz=[1410.0, 1650.0], **shared),
               _record("megamoe", 16.0, x_floor=1.6, sm_clock_mhz=[1395.0, 1600.0], **shared),
               _record("older record", 20.0)]  # without the new fields: still printed
    console = Console(file=io.StringIO(), width=250)
    print_table(records, console)
    text = console.file.getvalue()
    assert "p50 ms" in text and "× floor" in text and "1.60" in text and "2.40" in text
    assert "NVIDIA H200 x 2; driver 580.159.04; power limit 700 W; SM clock 1395–1650 MHz" in text, text
    assert f"commit {'a' * 40} (dirty)" in text and "20 interleaved rounds after 3 warm-up and 2 s steady" in text


def test_a_graph_captured_inside_the_timed_rounds_is_noted(tmp_path):
    """A pass whose timed rounds captured a megakernel CUDA graph (a device sync in a timed pass) says so, in the
    table and the Markdown; a pass that only replayed does not."""
    from megamoe.bench.report import write_markdown

    clean = {"replays": 40, "captures": 0, "backward_replays": 40, "backward_captures": 0}
    records = [_record("megamoe", 16.0, graphs_in_rounds=clean),
               _record("megamoe", 30.0, **{"pass": "bwd"}, graphs_in_rounds={**clean, "backward_captures": 2})]
    console = Console(file=io.StringIO(), width=250)
    print_table(records, console)
    md = tmp_path / "t.md"
    write_markdown(records, str(md), "megamoe bench")
    for text in (console.file.getvalue(), md.read_text()):
        assert "bwd: 2 CUDA graph capture(s) inside the timed rounds" in text, text
        assert text.count("CUDA graph capture") == 1, text  # not the fwd pass, which only replayed


def test_cpu_table_draws_no_ratio_nor_rate_and_explains_its_columns():
    """Issue 51: a CPU run's interpreter timings give no × vs nccl-torch, TFLOP/s or GB/s; the error column that
    decides correct stands beside its bound; × floor is dropped with the reason where no floor is known; a legend
    explains every column; NO says which check failed."""
    shared = dict(device="cpu", machine="cpu", device_name="cpu", device_count=2, tflops=3e-5, cross_gbps=5e-5,
                  floor_ms=None, x_floor=None, tolerance="bf16", rel_tol=1e-2, row_tol=0.1, row_group_tol=None,
                  max_abs_tol=0.5)
    records = [_record("nccl-torch", 43.0, **shared), _record("megamoe", 846.0, **shared),
               _record("megamoe", 900.0, **{**shared, "pass": "bwd", "max_abs_tol": None, "rel_err": 0.5,
                                            "correct": False, "failed": "rank 1 w_down: rel err 5.00e-01 > 0.01"})]
    console = Console(file=io.StringIO(), width=250)
    print_table(records, console)
    text = console.file.getvalue()
    rows = [line for line in text.splitlines() if line.startswith("│")]
    assert len(rows) == 3 and all(line.count("—") == 3 for line in rows), text  # ratio, TFLOP/s, GB/s
    assert "0.05" not in text and "3e-05" not in text and "5e-05" not in text  # 43 / 846 ms: no speed ratio
    assert "rel err ≤ tol" in text and "1.00e-03 ≤ 1e-02" in text and "5.00e-01 > 1e-02" in text
    assert "max abs" not in text.splitlines()[1] and "× floor" not in text.splitlines()[1]  # the header
    assert "NO: rank 1 w_down: rel err 5.00e-01 > 0.01" in text
    assert "not GPU timings" in text and "no speed ratio, TFLOP/s or GB/s" in text
    assert "no × floor column" in text and "bf16 bounds: rel err ≤ 1e-02" in text and "max abs error ≤ 0.5" in text
    for column in ("p50 ms, p10–p90:", "× vs nccl-torch:", "TFLOP/s:", "cross GB/s:", "rel err ≤ tol:", "correct:"):
        assert f"  {column}" in text, column
