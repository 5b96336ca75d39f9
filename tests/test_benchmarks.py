"""benchmarks/: every maintained tool works against today's src (CPU, no GPU needed).

Each script in benchmarks/ is listed below as a CPU tool (a smoke run on simulated CPU ranks under the Triton
interpreter, tiny shapes, or a recorded run of benchmarks/results/ reproduced from its files), a GPU tool
(H200 shapes and CUDA timing: an import and ``--help``), or a helper module of the others. Every one of them
prints its ``--help`` (all of them in one subprocess), and every ``megamoe`` module attribute a script names, at import or inside
a function, must exist (a name that moved in a reorganisation fails here, not on the GPU machine). The batch
scripts that made the recorded runs are benchmarks/recipes.md; ``gpu_ep.sh`` stays and is checked here.
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

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"

#: Scripts with a CPU smoke run below (one test each).
CPU_TOOLS = {
    "backward_ab.py", "comm_bench.py", "ep_scaling.py", "megakernel_ab.py", "megakernel_sweep.py", "output_hashes.py",
}
#: Scripts that need a GPU (CUDA events, torch.cuda timing, H200-sized shapes): import and --help, and a CPU
#: smoke of the parts that run without one.
GPU_TOOLS = {
    "backward_kernels.py", "backward_memory.py", "backward_per_sm.py", "backward_trace.py", "gemm_ceiling.py",
    "gemm_vs_dense.py", "megakernel_per_sm.py", "quant_bench.py", "schedule_bench.py", "tiles_ab.py",
    "weighted_sum_bench.py",
}
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
    """A new script says what its test is: a CPU smoke run, a GPU tool (--help), or a helper."""
    assert set(SCRIPTS) == CPU_TOOLS | GPU_TOOLS | HELPERS, set(SCRIPTS) ^ (CPU_TOOLS | GPU_TOOLS | HELPERS)
    assert not CPU_TOOLS & GPU_TOOLS and not HELPERS & (CPU_TOOLS | GPU_TOOLS)
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
def test_megakernel_sweep_runs_on_cpu_ranks(tmp_path):
    """Two CPU ranks, the tiny preset, the planner's point and one comm_sms point, a copy tile of 4 rows: every
    point bitwise equal to the first and correct against the unfused layer."""
    out = tmp_path / "sweep"
    _script("megakernel_sweep.py", "--impl", "megamoe", "--preset", "tiny", "--tokens", "32", "--ep", "2", "--sms", "8",
            "--minibatch", "", "--comm-sms", "2", "--comm-rows", "4", "--iters", "1", "--warmup", "0",
            "--out", str(out), timeout=300)
    run = json.loads((out / "sweep.json").read_text())
    points = run["points"]
    assert {p["comm_sms"] for p in points} == {2, run["plan"]["comm_sms"]}
    assert all(p["bitwise_equal"] and p["correct"] for p in points), points
    assert (out / "sweep.md").read_text().startswith("# megakernel sweep · megamoe · tiny · EP 2")


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


def test_output_hashes_hashes_the_megakernel_cases():
    """The megakernel test cases at one rank (the bench part runs every implementation on 4 ranks: a minute);
    one 16-hex hash per case and one over all."""
    lines = _script("output_hashes.py", "--parts", "cases", "--ranks", "1", timeout=300).stdout.splitlines()
    hashes = dict(reversed(line.split("  ", 1)) for line in lines)
    assert "all" in hashes and any(k.startswith("cases rank 0 R1 ") for k in hashes), hashes
    assert all(len(v) == 16 and int(v, 16) >= 0 for v in hashes.values())


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
