"""benchmarks/: every maintained tool works against today's src (CPU, no GPU needed).

Each script in benchmarks/ (benchmarks/README.md says what each measures) is listed below as a CPU tool (a smoke
run on simulated CPU ranks under the Triton interpreter, tiny shapes, or a recorded run of benchmarks/results/
reproduced from its files), a GPU tool (H200 shapes and CUDA timing: an import and ``--help``, and a smoke of the
parts that run without a GPU: its calls on a tiny load under the interpreter, or its report of a recorded run
printed again with ``--from``), or a helper module of the others. Every one of them prints its ``--help`` (all of
them in one subprocess), and every ``megamoe`` module attribute a script names, at import or inside a function,
must exist (a name that moved in a reorganisation fails here, not on the GPU machine). The batch scripts that made
the recorded runs, and the one-off probes since removed, are benchmarks/recipes.md; ``gpu_ep.sh`` stays and is
checked here.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from functools import lru_cache
from pathlib import Path
from unittest import mock

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
#: Where the GPU tools' calls run in their smoke tests (the CPU: Triton under its interpreter, tests/conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

#: Scripts with a CPU smoke run below (one test each).
CPU_TOOLS = {
    "backward_ab.py", "comm_bench.py", "ep_scaling.py", "megakernel_ab.py", "megakernel_sweep.py", "output_hashes.py",
    "sonic_side_by_side.py",
}
#: Scripts that need a GPU (CUDA events, torch.cuda timing, H200-sized shapes): import and --help, and a CPU
#: smoke of the parts that run without one.
GPU_TOOLS = {
    "backward_kernels.py", "backward_memory.py", "backward_per_sm.py", "backward_tiles_ab.py", "backward_trace.py",
    "fp8_wgrad_ab.py",
    "gemm_ceiling.py",
    "gemm_vs_dense.py", "megakernel_per_sm.py", "quant_bench.py", "schedule_bench.py", "tiles_ab.py",
    "weighted_sum_bench.py", "wgrad_gather_ab.py",
}
#: Scripts that make what a GPU run carries (downloads from PyPI): --help only.
PREP_TOOLS = {"sonic_carry.py"}
#: Modules the scripts import (benchmarks/ is on their path), tested by calling them.
HELPERS = {"ab_record.py", "sustained.py"}
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))


def _env(**extra: str) -> dict[str, str]:
    path = [str(ROOT / "src"), str(BENCH), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "TRITON_INTERPRET": "1", **extra}


def _run(args: list[str], timeout: float = 120, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, env=_env(**env), cwd=cwd, timeout=timeout)
    assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def _script(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return _run([sys.executable, str(BENCH / name), *args], timeout=timeout)


def test_every_script_is_classified():
    """A new script says what its test is: a CPU smoke run, a GPU tool (--help), a prep tool (--help) or a helper."""
    tools = CPU_TOOLS | GPU_TOOLS | PREP_TOOLS
    assert set(SCRIPTS) == tools | HELPERS, set(SCRIPTS) ^ (tools | HELPERS)
    assert len(tools) == len(CPU_TOOLS) + len(GPU_TOOLS) + len(PREP_TOOLS) and not HELPERS & tools
    assert sorted(p.name for p in BENCH.glob("*.sh")) == ["gpu_ep.sh"]  # the one-off batches are recipes.md


def test_every_script_the_results_cite_is_here_or_in_the_recipes():
    """A recorded run stays reproducible: each benchmarks/ script a results folder names is in the tree or, gone,
    in recipes.md (a batch script's section with its commands, or the commit to run it at)."""
    cited = set()
    for path in RESULTS.rglob("*"):
        if path.suffix in (".md", ".txt"):
            cited |= set(re.findall(r"benchmarks/([a-z_0-9]+\.(?:sh|py))\b", path.read_text(errors="replace")))
    recipes = (BENCH / "recipes.md").read_text()
    assert {"gpu_pass.sh", "megakernel_sweep.py"} <= cited  # the scan sees the folders
    gone = sorted(name for name in cited if not (BENCH / name).exists())
    missing = [name for name in gone if f"## `{name}`" not in recipes and f"benchmarks/{name}" not in recipes]
    assert not missing, missing


#: Runs every script named in argv as ``__main__`` with ``--help``, one after another in this one interpreter (a
#: fresh module namespace each, torch imported once), and prints {name: [exit code, stdout, error]} as JSON.
_HELP_DRIVER = """
import contextlib, io, json, runpy, sys, traceback
out = {}
for path in sys.argv[1:]:
    sys.argv, text, code, error = [path, "--help"], io.StringIO(), 0, ""
    try:
        with contextlib.redirect_stdout(text):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        code, error = 1, traceback.format_exc()
    out[path.rsplit("/", 1)[-1]] = [code, text.getvalue(), error]
print(json.dumps(out))
"""


@lru_cache(maxsize=1)
def _helps() -> dict[str, tuple[int, str, str]]:
    """Every script's ``--help`` (exit code, stdout, traceback), all in one subprocess: an interpreter start and
    a torch import per script took a minute of the suite."""
    done = _run([sys.executable, "-c", _HELP_DRIVER, *(str(BENCH / name) for name in SCRIPTS)], timeout=600)
    return {name: tuple(v) for name, v in json.loads(done.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_prints_its_help(name):
    code, stdout, error = _helps()[name]
    assert code == 0, error[-4000:]
    if name not in HELPERS:
        assert "usage:" in stdout, stdout


def _megamoe_names(tree: ast.AST) -> tuple[list[tuple[str, str]], list[tuple[str, str, int]]]:
    """(module, name) of every ``from megamoe... import name`` anywhere in the file, and (module, attribute, line) of
    every ``alias.attribute`` where ``alias`` is a megamoe module the file imported (``import megamoe.x as m``,
    ``from megamoe.x import module``)."""
    imported, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "megamoe":
            for a in node.names:
                imported.append((node.module, a.name))
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "megamoe" and a.asname:
                    aliases[a.asname] = a.name
    used = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            used.append((aliases[node.value.id], node.attr, node.lineno))
    return imported, used


def _module(path: str):
    try:
        return importlib.import_module(path)
    except ImportError:
        return None


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_names_only_megamoe_attributes_that_exist(name):
    """What ``--help`` cannot reach: imports inside functions, ``module.attribute`` in code that runs on a GPU only,
    and the module attributes a script patches (a patch of a name that moved would silently do nothing)."""
    imported, used = _megamoe_names(ast.parse((BENCH / name).read_text()))
    missing = []
    for module, attr in imported:
        mod = importlib.import_module(module)
        if not hasattr(mod, attr) and _module(f"{module}.{attr}") is None:
            missing.append(f"from {module} import {attr}")
    for path, attr, line in used:
        mod = _module(path)
        if mod is None:  # an alias of a non-module (a function or class): nothing to look up
            continue
        if not hasattr(mod, attr) and _module(f"{path}.{attr}") is None:
            missing.append(f"line {line}: {path}.{attr}")
    assert not missing, missing


# ---------------------------------------------------------------------------------------------- helpers


def test_sustained_rounds_interleave_every_call(monkeypatch):
    import torch

    import sustained

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # the tool syncs a GPU between groups
    calls = []
    times = sustained.interleaved_rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=2,
                                         seconds=0.01, group=2)
    assert set(times) == {"a", "b"} and all(len(t) == 2 and min(t) > 0 for t in times.values())
    assert calls[:2] == ["a", "a"] and "b" in calls  # groups of 2, one variant after the other
    table = sustained.rounds_table({"a": [2.0, 1.0, 4.0], "b": [1.0]}, 3e9, {"a": True, "b": False}, "a")
    assert table.splitlines()[0].endswith("same bits as a |") and "| a | 2.000 | 1.000-4.000 | 2 | True |" in table
    assert "| b | 1.000 | 1.000-1.000 | 3 | False |" in table


def test_ab_record_writes_the_result_and_prints_its_table(tmp_path, capsys):
    import ab_record

    result = {"median_ms": {"plan": 1.5}, "rounds_ms": {"plan": [1.5, 1.25]}, "configs": {"plan": "cfg"},
              "bitwise_equal": {"plan": True}}
    ab_record.write_and_print(result, str(tmp_path / "sub" / "ab.json"), "# title")
    assert json.loads((tmp_path / "sub" / "ab.json").read_text()) == result
    assert capsys.readouterr().out.splitlines()[-1] == "| plan | cfg | 1.50 | 1.50 1.25 | True |"


@pytest.fixture(autouse=True, scope="module")
def _benchmarks_importable():
    sys.path.insert(0, str(BENCH))
    yield
    sys.path.remove(str(BENCH))


# ---------------------------------------------------------------------------------------------- CPU tools


def test_ep_scaling_reproduces_the_recorded_table():
    """2026-11-30-ep4's bench records give its ep-scaling.md again (test_cli checks the PNG and the edge cases)."""
    d = RESULTS / "2026-11-30-ep4"
    done = _script("ep_scaling.py", str(d))
    assert done.stdout.strip() == (d / "ep-scaling.md").read_text().strip()


def test_megakernel_sweep_replots_a_recorded_sweep(tmp_path):
    """--replot of a recorded sweep.json prints its sweep.md again (plots beside the copy, not in results/)."""
    d = RESULTS / "2026-11-30-one-rank" / "minibatch-graph-4d1615d" / "kimi-k2"
    shutil.copy(d / "sweep.json", tmp_path / "sweep.json")
    done = _script("megakernel_sweep.py", "--replot", str(tmp_path / "sweep.json"))
    table = "\n".join(line for line in done.stdout.splitlines() if not line.startswith(("plots:", "matplotlib ")))
    assert table.strip() == (d / "sweep.md").read_text().strip()


@pytest.mark.slow  # a GPU tool's CPU smoke run (15-40 s): `pytest -m slow`, before a GPU session
@pytest.mark.parametrize("impl", ["megamoe", "unfused"])
def test_megakernel_sweep_runs_on_cpu_ranks(tmp_path, impl):
    """Two CPU ranks, the tiny preset, the planner's point and one comm_sms point, a copy tile of 4 rows: every
    point bitwise equal to the first and correct against nccl-torch's layer; with and without overlap."""
    out = tmp_path / "sweep"
    _script("megakernel_sweep.py", "--impl", impl, "--preset", "tiny", "--tokens", "32", "--ep", "2", "--sms", "8",
            "--minibatch", "", "--comm-sms", "2", "--comm-rows", "4", "--iters", "1", "--warmup", "0",
            "--out", str(out), timeout=300)
    run = json.loads((out / "sweep.json").read_text())
    points = run["points"]
    assert {p["comm_sms"] for p in points} == {2, run["plan"]["comm_sms"]}
    assert all(p["bitwise_equal"] and p["correct"] for p in points), points
    assert (out / "sweep.md").read_text().startswith(f"# megakernel sweep · {impl} · tiny · EP 2")


def test_megakernel_ab_has_its_cpu_test():
    """megakernel_ab.py's CPU smoke run is tests/test_megakernel.py::test_megakernel_ab_runs_on_cpu_ranks (every
    variant on 2 CPU ranks); it must stay there."""
    source = (ROOT / "tests" / "test_megakernel.py").read_text()
    assert "def test_megakernel_ab_runs_on_cpu_ranks" in source and '"megakernel_ab.py"' in source


def test_comm_bench_runs_on_cpu_ranks(tmp_path):
    """The three measurements' logic on 2 CPU ranks: every launch bit-exact against its torch reference, under
    every routing, and the timeout check raises."""
    _script("comm_bench.py", "--device", "cpu", "--preset", "tiny", "--tokens", "16", "--iters", "1", "--warmup", "0",
            "--sms", "2", "--out", str(tmp_path), timeout=300)
    rec = json.loads((tmp_path / "comm.json").read_text())
    assert not rec["notes"], rec["notes"]
    by = {}
    for r in rec["records"]:
        by.setdefault(r["measurement"], []).append(r)
    (checks,) = by["checks"]
    assert checks["exact"] and all(checks["exact"].values()), checks["exact"]
    assert all(r["exact"] for r in by["imbalance"]) and by["timeout"][0]["passed"]
    assert {r["impl"] for r in by["bandwidth"]} == {"dispatch_pull", "combine_push"}
    assert {r["num_sms"] for r in by["bandwidth"] if "num_sms" in r} == {2}  # the --sms asked for
    assert (tmp_path / "comm.md").read_text().startswith("# comm_bench: cpu (interpreter) x2")


@pytest.mark.slow  # a GPU tool's CPU smoke run (15-40 s): `pytest -m slow`, before a GPU session
def test_backward_ab_runs_on_cpu_ranks(tmp_path):
    """The backward megakernel at another comm count and the composed kernels on 2 CPU ranks: the same bits, the
    configs asked for, a time per round."""
    out = tmp_path / "ab.json"
    _script("backward_ab.py", "--device", "cpu", "--preset", "tiny", "--tokens", "16", "--variants", "3,composed",
            "--rounds", "1", "--passes", "1", "--out", str(out), timeout=300)
    res = json.loads(out.read_text())
    assert res["bitwise_equal"] == {"3": True, "composed": True}, res
    assert "backward_comm_sms=3," in res["configs"]["3"] and res["ranks"] == 2, res
    assert all(len(v) == 1 and v[0] > 0 for v in res["rounds_ms"].values()), res


@pytest.mark.slow  # a GPU tool's CPU smoke run (~30 s on 2 cores): `pytest -m slow`, before a GPU session
def test_sonic_side_by_side_runs_megamoe_without_sonicmoe(tmp_path):
    """Without SonicMoE (never installed here) the side by side says why, still checks and times megamoe (and its
    torch-router twin) on the tiny shape, and writes its record."""
    out = tmp_path / "sbs.json"
    done = _script("sonic_side_by_side.py", "--device", "cpu", "--tiny", "--out", str(out), timeout=300)
    assert "SonicMoE not run: " in done.stdout
    rec = json.loads(out.read_text())
    assert not rec["sonic"]["run"] and rec["sonic"]["why_not"], rec["sonic"]
    (shape,) = rec["shapes"]
    assert set(shape["results"]) == {"megamoe", "megamoe-tc"}, shape["results"]
    assert all(r["correct"] and r["fwd_ms_median"] > 0 for r in shape["results"].values()), shape


def test_output_hashes_hashes_the_megakernel_cases():
    """The megakernel test cases at one rank (the bench part runs every implementation on 4 ranks: a minute);
    one 16-hex hash per case and one over all."""
    lines = _script("output_hashes.py", "--parts", "cases", "--ranks", "1", timeout=300).stdout.splitlines()
    hashes = dict(reversed(line.split("  ", 1)) for line in lines)
    assert "all" in hashes and any(k.startswith("cases rank 0 R1 ") for k in hashes), hashes
    assert all(len(v) == 16 and int(v, 16) >= 0 for v in hashes.values())


# ---------------------------------------------------------------------------------------------- GPU tools


def _main(module: str, *argv: str) -> None:
    """``module``'s main() with ``argv`` on its command line, in this process (torch imported once)."""
    with mock.patch.object(sys, "argv", [f"{module}.py", *argv]):
        importlib.import_module(module).main()


def _load(experts: int, rows: int, d: int = 256, i: int = 128):
    from megamoe.bench.experts import make_load

    return make_load(experts, rows, d, i, DEVICE)


def test_backward_kernels_finds_the_gaps_and_what_the_host_did():
    """A recorded megamoe step (2026-12-05-step-timeline, CUDA activity): its gaps between device work sum to no
    more than the time no kernel ran, each launched by a host call that returned after the gap began (host-bound:
    that tree's step was), and its allocations show as stalls; a synthetic trace with host operators names the
    operator around each late launch and tells a device-side gap (launched before it began) apart; the pass's two
    ends from its CUDA events' records (the host's lead to its first launch, what ran over it, the tail)."""
    import gzip

    import backward_kernels

    d = RESULTS / "2026-12-05-step-timeline"
    record = json.loads((d / "backward_kernels_qwen3-30b-a3b_8192_step.json").read_text())["rank0"]["megamoe"]
    with gzip.open(d / "qwen3-30b-a3b_8192_step_megamoe.json.gz", "rt") as f:
        g = backward_kernels.gaps(json.load(f))
    assert 0 < g["host_bound_ms"] <= g["gap_ms"] <= record["idle_ms"]
    assert max(x["us"] for x in g["gaps"]) == pytest.approx(2143.4, abs=0.1)
    assert g["stalls"]["cudaMalloc"]["calls"] == 8 and g["stalls"]["cudaFree"]["calls"] == 7
    kernel = lambda name, ts, dur, c: {"cat": "kernel", "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                       "args": {"correlation": c}}
    call = lambda ts, dur, c: {"cat": "cuda_runtime", "name": "cuLaunchKernelEx", "ts": ts, "dur": dur,  # noqa: E731
                               "tid": 1, "args": {"correlation": c}}
    op = lambda name, ts, dur: {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": 1}  # noqa: E731
    trace = {"traceEvents": [
        op("megamoe::layer_backward", 0, 100), op("aten::empty", 20, 30),
        call(1, 2, 1), kernel("a", 10, 10, 1),           # busy 10..20
        call(45, 5, 2), kernel("b", 52, 8, 2),           # a 32 us gap; launched 30 us into it inside aten::empty
        call(55, 1, 3), kernel("c", 70, 5, 3),           # a 10 us gap the device waited through (launched before)
        kernel("d", 76, 1, 9)]}                          # a 1 us gap: under min_us
    g = backward_kernels.gaps(trace)
    assert [(x["us"], x["before"], x["late_us"], x["host_op"]) for x in g["gaps"]] == [
        (32, "b", 30, "aten::empty"), (10, "c", -4, "megamoe::layer_backward")]
    assert g["gap_ms"] == pytest.approx(0.042) and g["host_bound_ms"] == pytest.approx(0.032) and g["stalls"] == {}
    assert g["lead_us"] is None and g["lead_ops"] == []  # no event records: no ends
    # the pass's ends: the start event recorded at -5..-4, the first device work at 10 (a 14 us lead: 10 of it in
    # the operator around it, 4 in a Python frame, 3 in an operator that began before the record), the end event
    # recorded at 90 (13 us after the last device work ended)
    record = lambda ts: {"cat": "cuda_runtime", "name": "cudaEventRecordWithFlags", "ts": ts, "dur": 1.0}  # noqa: E731
    frame = {"cat": "python_function", "name": "megamoe/ops/experts_bwd.py(70): expert_backward", "ts": 2, "dur": 4}
    trace["traceEvents"] += [record(-5), record(90), frame, op("aten::zeros", -10, 9)]
    g = backward_kernels.gaps(trace)
    assert g["lead_us"] == 14 and g["tail_us"] == 13
    assert g["lead_ops"] == [{"name": "megamoe::layer_backward", "us": 10},
                             {"name": "megamoe/ops/experts_bwd.py(70): expert_backward", "us": 4},
                             {"name": "aten::zeros", "us": 3}]
    # a recorded step: the host took 0.84 ms to its first launch, and the GPU ended 4.6 ms after the end record
    with gzip.open(d / "qwen3-30b-a3b_16384_step_megamoe.json.gz", "rt") as f:
        g = backward_kernels.gaps(json.load(f))
    assert g["lead_us"] == pytest.approx(837, abs=1) and g["tail_us"] == pytest.approx(-4613, abs=1)


def test_backward_kernels_accounts_a_recorded_step_again(capsys):
    """2026-12-05-step-timeline: each implementation's recorded trace gives its recorded kernels, launches, busy
    time and kinds again; --from prints the record's report."""
    import gzip

    import backward_kernels

    d = RESULTS / "2026-12-05-step-timeline"
    record = json.loads((d / "backward_kernels_qwen3-30b-a3b_8192_step.json").read_text())
    for impl in ("nccl-torch", "megamoe"):
        want = record["rank0"][impl]
        with gzip.open(d / f"qwen3-30b-a3b_8192_step_{impl}.json.gz", "rt") as f:
            got = backward_kernels.account(want["ms"], backward_kernels.trace_kernels(json.load(f)))
        assert got["kernels"] == want["kernels"] and got["launches"] == want["launches"]
        assert got["busy_ms"] == pytest.approx(want["busy_ms"]) and got["kinds"] == pytest.approx(want["kinds"])
    _main("backward_kernels", "--from", str(d / "backward_kernels_qwen3-30b-a3b_8192_step.json"), "--top", "3")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("qwen3-30b-a3b, 8192 tokens/rank, 1 rank(s), pass step, uniform routing")
    assert backward_kernels.record_name("qwen3-30b-a3b", 8192, "step", "uniform") == "qwen3-30b-a3b_8192_step"
    assert backward_kernels.record_name("qwen3-30b-a3b", 8192, "step", "zipf") == "qwen3-30b-a3b_8192_step_zipf"
    assert backward_kernels.routing("zipf-0.5") == "zipf-0.5"
    with pytest.raises(ValueError, match="zipf-A"):
        backward_kernels.routing("zipf-hot")
    assert out[1].startswith("nccl-torch: 11.08 ms between events") and "125 launches" in out[1]


def test_backward_memory_prints_the_recorded_tables_again(capsys):
    d = RESULTS / "2026-12-05-backward-ring"
    for name in ("backward_memory_qwen3-30b-a3b_8192.json", "backward_memory_qwen3-30b-a3b_8192_fused.json"):
        _main("backward_memory", "--from", str(d / name))
    assert capsys.readouterr().out == (d / "memory_log.txt").read_text()


def test_backward_per_sm_prints_the_recorded_table_again(capsys):
    d = RESULTS / "2026-12-05-backward-ring"
    _main("backward_per_sm", "--from", str(d / "backward_per_sm_kimi-k2_8192_192.json"))
    want = [line for line in (d / "per_sm_log.txt").read_text().splitlines() if line.startswith(("|", "megakernel"))]
    assert capsys.readouterr().out.splitlines()[1:] == want


def test_megakernel_per_sm_prints_the_recorded_table_again(capsys):
    d = RESULTS / "2026-12-04-megakernel-stages"
    _main("megakernel_per_sm", "--from", str(d / "run10_stages_bf16_8192_192.json"))
    want = [line for line in (d / "run10_stages_bf16_8192_192.log").read_text().splitlines() if line.startswith("|")]
    assert capsys.readouterr().out.splitlines()[1:] == want


@pytest.mark.parametrize("precision", ["bf16", "fp8-block"])
def test_megakernel_per_sm_standalone_calls_run_on_a_tiny_load(precision):
    import megakernel_per_sm

    x, counts, offsets, wgu, wd = _load(2, 192)
    calls = megakernel_per_sm._standalone_calls(precision, counts, offsets, x.shape[0], wgu, wd)
    assert {kind for kind, _ in calls} == {"gate_up", "down"} and ("gate_up", "triton") in calls
    for fn in calls.values():
        fn()


def test_gemm_ceiling_summarizes_the_recorded_run_again(capsys):
    """2026-11-30-gemm-ceiling's groups and nvidia-smi samples give its rates, clock and power again."""
    import gemm_ceiling

    d = RESULTS / "2026-11-30-gemm-ceiling"
    record = json.loads((d / "gemm_ceiling.json").read_text())
    smi = (d / "gemm_ceiling_smi.csv").read_text().splitlines()
    got = gemm_ceiling.summarize([g["ms"] for g in record["groups"]], smi)
    assert got["first_samples"] == record["first_samples"] and got["groups"] == record["groups"]
    for key in ("burst_first_150ms", "steady_last_half", "steady_clock_mhz", "steady_power_w"):
        assert got[key] == pytest.approx(record[key]), key
    _main("gemm_ceiling", "--from", str(d))
    assert capsys.readouterr().out.strip() == ("cuBLAS bf16 8192^3 on NVIDIA H200: first 150 ms 710 TFLOP/s; last "
                                               "half (3.1-6.1 s) 662 TFLOP/s at 1475 MHz, 691 W")


def test_gemm_vs_dense_calls_run_on_a_tiny_load():
    """Every call of the table (ours, cuBLAS dense, bmm, grouped_mm, fp8-block) on 2 experts x 96 rows, once."""
    import gemm_vs_dense

    calls, flops, split = gemm_vs_dense.load_calls(2, 192, 256, 128, DEVICE)
    assert set(flops) == set(calls) >= {"gate_up", "down dense", "backward bmm", "fp8 down dense"}
    for fn in (*calls.values(), *split.values()):
        fn()


@pytest.mark.parametrize("precision", ["bf16", "fp8-block", "mxfp8"])
def test_tiles_ab_variants_give_the_same_bits(precision):
    """The A/B's premise on a tiny load: 128- and 64-row tiles give the same output."""
    import tiles_ab

    calls, outs = tiles_ab.variant_calls(precision, *_load(2, 192))
    assert list(calls) == list(tiles_ab.VARIANTS[precision])
    first = outs["128-row"]
    assert not first.isnan().any() and all(torch.equal(y, first) for y in outs.values())


def test_backward_tiles_ab_variants_give_the_same_bits_and_leave_the_switches_off():
    """The backward A/B's premise on a tiny load (the interpreter's tiles, which the switches do not touch): each
    variant's call gives the planned gradients, under its switches, and turns every switch off after it."""
    import backward_tiles_ab
    from megamoe.bench.experts import backward_load
    from megamoe.config import MoEConfig
    from megamoe.ops import experts as expert_ops
    from megamoe.ops.experts_bwd import expert_backward

    load = backward_load(MoEConfig(hidden=128, intermediate=64, num_experts=3, top_k=2), 3, 40, DEVICE)
    table = backward_tiles_ab.variants(DEVICE, 80 / 3)
    assert "planned" in table and "128-row Gluon dx, empty halves skipped" in table
    seen = {}
    for name, (tuning, switches) in table.items():
        def call(tuning=tuning, name=name):
            seen[name] = {s: getattr(expert_ops, s) for s in backward_tiles_ab.SWITCHES}
            return expert_backward(*load.args, tuning=tuning)
        grads = backward_tiles_ab.under(switches, call)()
        assert seen[name] == {s: switches.get(s, False) for s in backward_tiles_ab.SWITCHES}, name
        assert not any(getattr(expert_ops, s) for s in backward_tiles_ab.SWITCHES), name
        prints = backward_tiles_ab.fingerprint(grads)
        if name == "planned":
            first = prints
        assert all(torch.equal(a, b) for a, b in zip(prints, first)), name


def test_quant_bench_cases_are_bit_exact_on_a_small_input(monkeypatch):
    """Each case's default tile and first sweep tile against the torch reference, on a [512, 256] activation and
    a [4, 128, 256] weight stack with every special value (the GPU run's check, smaller)."""
    import quant_bench
    from megamoe.ops.quant import QuantConfig, default_config

    monkeypatch.setattr(quant_bench, "DEVICE", DEVICE.type)
    act, weights = quant_bench.special_activations((512, 256), 0), quant_bench.special_activations((4, 128, 256), 1)
    for case in quant_bench.CASES:
        x = act if case.kind == "act" else weights
        want = quant_bench.reference(case, x)
        d = default_config(case.block)
        for tile in ((d.block_m, d.block_k, d.num_warps), case.sweep[0]):
            assert quant_bench.check(case, x, want, QuantConfig(*tile))["exact"], (case.name, tile)


def test_schedule_bench_every_variant_builds_the_same_schedule():
    import schedule_bench

    assert schedule_bench.VARIANTS[0] == schedule_bench.sched.ScheduleBlocking()
    top = torch.rand(2, 64, 16, generator=torch.Generator().manual_seed(0)).topk(2).indices.int().to(DEVICE)
    first = None
    for blocking in schedule_bench.VARIANTS:
        got = schedule_bench.build(top, 8, 2 * 64 * 2, blocking)
        first = first or got
        assert all(torch.equal(getattr(got, f), getattr(first, f)) for f in schedule_bench.FIELDS), blocking


def test_wgrad_gather_ab_variants_give_the_same_bits():
    """The A/B's premise on a tiny load (64 tokens, 4 experts, k 2): every variant's two wgrads equal the copied
    rows' (on the CPU the gathers copy first; on a Hopper GPU they gather on load), and each expert's rows are its
    tokens in order."""
    import wgrad_gather_ab

    load = wgrad_gather_ab.make_load(64, 64, 32, 4, 2, DEVICE)
    assert int(load.counts.sum()) == 128 and all(
        bool((load.tokens[o : o + c].diff() > 0).all()) for o, c in zip(load.offsets.tolist(), load.counts.tolist()))
    calls, outs, flops = wgrad_gather_ab.variant_calls(load, DEVICE)
    assert list(calls) == list(wgrad_gather_ab.VARIANTS) and flops == {"down": 2 * 128 * 64 * 32,
                                                                        "gate_up": 2 * 128 * 64 * 64}
    for variant in calls:
        for kind in ("down", "gate_up"):
            calls[variant][kind]()
    want = {"down": torch.einsum("rd,ri->di", load.d_out[load.tokens.long()].float(), load.act_w.float()),
            "gate_up": torch.einsum("rj,rd->jd", load.d_h.float(), load.x[load.tokens.long()].float())}
    for kind in ("down", "gate_up"):
        first = outs["copy + wgrad"][kind]
        assert all(torch.equal(outs[v][kind], first) for v in calls), kind
        summed = sum(first[e].float() for e in range(4))  # the experts' gradients summed: every row once
        assert torch.allclose(summed, want[kind], rtol=2e-2, atol=2e-1), kind


def test_fp8_wgrad_ab_variants_give_the_gradient():
    """The FP8 / BF16 wgrad A/B's premise on a tiny load (256 tokens, 4 experts, k 2, D 128, I 128): every variant
    writes each expert's gradient (the buffer poisoned first), the BF16 wgrad within BF16's rounding of the FP32
    product, the FP8 ones within FP8's and not at BF16's (they did quantise), and the flops count every row."""
    import fp8_wgrad_ab
    from wgrad_gather_ab import make_load  # the load both wgrad A/B tools time

    load = make_load(256, 128, 128, 4, 2, DEVICE)
    for kind, shape in (("down", (4, 128, 128)), ("gate_up", (4, 256, 128))):
        out = torch.empty(shape, dtype=torch.bfloat16, device=DEVICE)
        calls, flops = fp8_wgrad_ab.variant_calls(load, kind, out, DEVICE)
        assert list(calls) == list(fp8_wgrad_ab.VARIANTS) and flops == 2 * 512 * shape[1] * shape[2]
        rel = {}
        for variant, call in calls.items():
            out.fill_(float("nan"))
            call()
            rel[variant] = None if variant == "write floor" else fp8_wgrad_ab.relative_error(load, kind, out)
        assert bool((out == 0).all()), kind  # the write floor zero-fills the gradient
        assert rel["bf16 wgrad, rows by token"] < 1e-2, (kind, rel)
        for variant in ("fp8: quantise + wgrad", "fp8 wgrad"):
            assert 1e-2 < rel[variant] < 8e-2, (kind, variant, rel)


def test_weighted_sum_bench_tiles_give_the_same_bits(monkeypatch):
    """Every tile of the sweep on 16 tokens x 4 slots (a fifth empty, half the routes read from y), timed by one
    call each: the bench's premise, the same bits whatever the tile."""
    import triton

    import weighted_sum_bench

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.0)[1])
    g = torch.Generator().manual_seed(0)
    n, k, d = 16, 4, 256
    top = torch.randint(0, 8, (n, k), generator=g, dtype=torch.int32)
    top = torch.where(torch.rand(n, k, generator=g) < 0.2, -1, top)
    own_rows = torch.where(top.flatten() % 2 == 0, torch.arange(n * k), -1).int()
    combine, y = (torch.randn(n * k, d, generator=g).bfloat16() for _ in range(2))
    weights, shared_y = torch.rand(n, k, generator=g), torch.randn(n, d, generator=g).bfloat16()
    args = (y, combine, own_rows, top, weights, shared_y)
    rows = weighted_sum_bench._time_tiles("tiny", n, k, d, True, *(t.to(DEVICE) for t in args), nbytes=1)
    assert len(rows) == len(weighted_sum_bench.TILES) and all(r["same_bits"] for r in rows), rows


# ---------------------------------------------------------------------------------------------- gpu_ep.sh


def test_gpu_ep_sh_calls_megamoe_bench_with_options_that_exist(tmp_path):
    """gpu_ep.sh (kept: the presets' steady state at any EP) parses, stops without its variables, and runs
    `megamoe bench` once per preset with options, presets and implementations of today's CLI. A stand-in
    python3 records the calls and writes the Markdown table the script reads back."""
    script = BENCH / "gpu_ep.sh"
    _run(["bash", "-n", str(script)])
    missing = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=ROOT, timeout=60,
                             env={k: v for k, v in os.environ.items() if k not in ("EP", "TOKENS", "OUT")})
    assert missing.returncode != 0 and "set" in missing.stderr
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, sys
        args = sys.argv[1:]
        with open({str(tmp_path / "calls.jsonl")!r}, "a") as f:
            f.write(json.dumps(args) + "\\n")
        md = args[args.index("--md") + 1]
        open(md, "w").write("\\n" * 7 + "| nccl-torch | fwd | 1.0 | - | 1.00 | x | x | x | 0 | True |\\n")
        """))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    done = _run(["bash", str(script)], PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}", EP="2", TOKENS="64",
                OUT=str(out), MEGAMOE_COMMIT="abc", PRESETS="kimi-k2 tiny")
    assert "# ep2-64-kimi-k2" in done.stdout and "# ep2-64-tiny" in done.stdout
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [c[:3] for c in calls] == [["-m", "megamoe", "bench"]] * 2
    assert not list(out.glob("*.err"))  # kept only when a bench fails

    from megamoe.config import PRESETS

    help_text = _run([sys.executable, "-m", "megamoe", "bench", "--help"], COLUMNS="200").stdout
    for call in calls:
        opts = dict(zip(call[3::2], call[4::2]))
        assert all(o in help_text for o in opts), [o for o in opts if o not in help_text]
        assert opts["--preset"] in PRESETS and opts["--ep"] == "2" and opts["--tokens"] == "64"
        assert all(impl in help_text for impl in opts["--impl"].split(","))
        assert all(fmt in help_text for fmt in opts["--experts"].split(","))


def test_backward_kernels_files_the_fp8_tiles_under_gemms_and_the_quantisers_apart():
    """The FP8 Gluon tiles' names hold "fp8": they are GEMM tiles (the dx runs the forward's down kernel), not
    quantisers (an H100 record of 2026-12-06 had filed forward_fp8_ws_kernel's 4.5 ms under quantisers)."""
    import backward_kernels

    gemms = ("forward_fp8_ws_kernel", "wgrad_fp8_ws_kernel", "dact_fp8_ws_kernel", "forward_ws_kernel", "dx_kernel")
    assert {backward_kernels.kind(n) for n in gemms} == {"expert GEMM tiles"}
    assert backward_kernels.kind("quantize_kernel") == "quantisers"
