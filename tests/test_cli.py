"""`megamoe bench` end to end on simulated CPU ranks, and a torchrun-started world."""

import importlib.util
import json
import re
import socket
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from megamoe.cli import app
from megamoe.parallel.world import launch

FIELDS = {"impl", "preset", "precision", "pass", "ep", "tokens_per_rank", "device", "machine", "commit", "run_id",
          "time_ms", "time_ms_p10", "time_ms_p90", "tflops", "max_abs_err", "rel_err", "correct",
          "time_ms_p50", "floor_ms", "x_floor", "dirty", "device_name", "device_count", "driver_version",
          "power_limit_w", "sm_clock_mhz", "torch", "triton", "warmup", "steady_s", "steady_rounds", "routing",
          "knobs"}


def test_bench_writes_correct_records(tmp_path):
    out = tmp_path / "records.json"
    md = tmp_path / "table.md"
    result = CliRunner().invoke(app, ["bench", "--device", "cpu", "--ep", "2", "--tokens", "24,7", "--iters", "2",
                                      "--json", str(out), "--md", str(md)])
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())
    want = {(i, p) for i in ("reference", "nccl-torch", "megamoe") for p in ("fwd", "bwd")}  # the CPU's default
    assert {(r["impl"], r["pass"]) for r in records} == want
    for r in records:
        assert FIELDS <= set(r)
        assert r["correct"] and r["ep"] == 2 and r["tokens_per_rank"] == [24, 7] and r["machine"] == "cpu"
        assert r["time_ms_p10"] <= r["time_ms"] == r["time_ms_p50"] <= r["time_ms_p90"]
        assert r["iters"] == 2 and r["warmup"] == 0 and r["steady_s"] == 0 and r["steady_rounds"] == 0  # CPU defaults
        assert r["floor_ms"] is None and r["x_floor"] is None and r["sm_clock_mhz"] is None  # no rates for a CPU
        assert r["tolerance"] == "bf16" and r["rel_err"] <= r["rel_tol"] == 1e-2 and r["failed"] is None
        assert r["max_abs_tol"] == (0.5 if r["pass"] == "fwd" else None)  # the output's bound; gradients have none
    text = md.read_text()
    assert "| nccl-torch | bwd |" in text and "not GPU timings" in text
    assert all(line.split("|")[5:8] == [" — "] * 3 for line in text.splitlines()[7:13]), text  # no ratio nor rate
    assert "p50 ms" in result.output and "interleaved rounds" in result.output and "rel err ≤ tol" in result.output
    assert "no × floor column" in result.output and "not GPU timings" in result.output  # no floor for a CPU


def test_bench_rejects_bad_options_with_exit_code_2():
    result = CliRunner().invoke(app, ["bench", "--device", "cpu", "--ep", "3"])
    assert result.exit_code == 2
    assert "not divisible by ep (3)" in result.output


# mxfp8's (19 s on 2 cores) under -m slow: CI's 15 minutes; the bench's FP8 path is fp8-block's
@pytest.mark.parametrize("experts", ["fp8-block", pytest.param("mxfp8", marks=pytest.mark.slow)])
def test_bench_megamoe_with_fp8_experts(tmp_path, experts, monkeypatch):
    """FP8 experts beside BF16's in one run, under a zipf-A routing with a knob set: the records and the Markdown
    name both (the knob as the command's prefix)."""
    out, md = tmp_path / "fp8.json", tmp_path / "fp8.md"
    monkeypatch.setenv("MEGAMOE_WGRAD_PLAN_SKEW", "inf")  # GPU-only: the CPU runs wgrad_kernel either way
    result = CliRunner().invoke(app, ["bench", "--device", "cpu", "--ep", "2", "--tokens", "40,23", "--impl",
                                      "megamoe", "--experts", f"bf16,{experts}", "--passes", "fwd", "--iters",
                                      "1", "--routing", "zipf-0.5", "--json", str(out), "--md", str(md)])
    assert result.exit_code == 0, result.output
    bf16, r = json.loads(out.read_text())
    assert bf16["impl"] == "megamoe" and bf16["weights_quantize_ms"] is None and bf16["correct"], bf16
    assert r["impl"] == f"megamoe ({experts} experts)" and r["correct"], r
    assert r["routing"] == "zipf-0.5" and r["knobs"]["MEGAMOE_WGRAD_PLAN_SKEW"] == "inf"
    lines = md.read_text().splitlines()
    assert lines[0].endswith("tokens/rank · zipf-0.5 routing · bf16") and "MEGAMOE_WGRAD_PLAN_SKEW=inf " in lines[3]
    assert 1e-3 < r["rel_err"] < 6e-2, r  # FP8 rounding shows; a wrong row would not pass the row check
    assert r["weights_quantize_ms"] > 0 and "quantised once before the passes" in result.output


def _fp8_packs(world):
    from megamoe.bench.problem import make_problem
    from megamoe.bench.runners import _MegamoeRunner
    from megamoe.config import MoEConfig

    cfg = MoEConfig(hidden=128, intermediate=128, num_experts=4, top_k=2, shared=())
    p = make_problem(cfg, world.rank, world.size, 16, dtype=torch.bfloat16, device=world.device)
    return [_MegamoeRunner(world, p, "fp8-block", **kw).experts_q.transposed is not None
            for kw in ({"backward": False}, {})]


def test_bench_quantises_the_backwards_fp8_weights_only_when_it_times_a_backward():
    """A forward-only bench's FP8 pack has no dgrad transposes (as large as the pack: kimi-k2 on one H200 ran
    out of memory with them); the runner's default keeps them for bwd and step."""
    assert launch(_fp8_packs, 1, device="cpu")[0] == [False, True]


def test_bench_rejects_unknown_expert_format():
    result = CliRunner().invoke(app, ["bench", "--device", "cpu", "--experts", "fp4"])
    assert result.exit_code == 2 and "experts must be one of bf16, fp8-block, mxfp8" in result.output
    result = CliRunner().invoke(app, ["bench", "--device", "cpu", "--experts", "mxfp8", "--precision", "fp32"])
    assert result.exit_code == 2 and "precision must be bf16" in result.output


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="needs fewer than 2 visible GPUs")
def test_bench_refuses_more_ranks_than_gpus():
    result = CliRunner().invoke(app, ["bench", "--device", "cuda", "--ep", "2"])
    assert result.exit_code == 2
    assert f"ep=2 needs 2 GPUs, {torch.cuda.device_count()} visible" in result.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_world_joins_a_torchrun_group():
    probe = os.path.join(os.path.dirname(__file__), "torchrun_probe.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}", probe],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    assert sorted(re.findall(r"rank \d of \d read \d+", done.stdout)) == ["rank 0 of 2 read 101", "rank 1 of 2 read 100"]


def test_bench_experts_checks_and_records(tmp_path):
    out = tmp_path / "experts.json"
    result = CliRunner().invoke(app, ["bench-experts", "--tokens", "16", "--experts", "3", "--json", str(out)])
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())
    assert {(r["impl"], r["pass"]) for r in records} >= {("megamoe", "fwd"), ("megamoe", "bwd"),
                                                        ("torch._grouped_mm+swiglu", "fwd"), ("torch autograd", "bwd")}
    fwd = next(r for r in records if r["impl"] == "megamoe" and r["pass"] == "fwd")
    assert fwd["all_written"] and fwd["rel_err_vs_torch"] < 1e-2 and fwd["load"] == "3x10"


def test_bench_experts_sweep_times_every_candidate_and_checks_the_best(tmp_path):
    from megamoe.bench.experts import SWEEP

    out = tmp_path / "sweep.json"
    result = CliRunner().invoke(app, ["bench-experts", "--tokens", "16", "--experts", "3", "--passes", "fwd",
                                      "--sweep", "--json", str(out)])
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())
    for stage in ("gate_up", "down"):
        timed = [r["tiles"] for r in records if r["impl"] == f"megamoe {stage}"]
        assert len(timed) == len(SWEEP[stage]) and all(r["ms"] > 0 for r in records), stage
    best = next(r for r in records if r["impl"] == "megamoe")
    assert best["all_written"] and best["rel_err_vs_torch"] < 1e-2


def test_bench_experts_rejects_bad_options():
    result = CliRunner().invoke(app, ["bench-experts", "--passes", "sideways"])
    assert result.exit_code == 2 and "passes must be" in result.output
    result = CliRunner().invoke(app, ["bench-experts", "--formats", "fp4"])
    assert result.exit_code == 2 and "formats must be among" in result.output
    from megamoe.bench.experts import run
    from megamoe.config import MoEConfig

    with pytest.raises(ValueError, match="multiples of 128"):  # before any tensor is made
        run(MoEConfig(hidden=192, intermediate=128, num_experts=4, top_k=2), 8, (2,), torch.device("cpu"),
            formats=("fp8-block",))


def test_bench_experts_times_the_fp8_formats_beside_bf16(tmp_path):
    out = tmp_path / "formats.json"
    result = CliRunner().invoke(app, ["bench-experts", "--tokens", "16", "--experts", "3", "--passes", "fwd",
                                      "--formats", "bf16,fp8-block,mxfp8", "--json", str(out)])
    assert result.exit_code == 0, result.output
    records = {r["impl"]: r for r in json.loads(out.read_text())}
    for fmt in ("fp8-block", "mxfp8"):
        r = records[f"megamoe {fmt}"]
        assert r["all_written"] and r["pass"] == "fwd" and r["ms"] > 0 and r["vs_bf16"] > 0, r
        # the kernels against their fp32 twin (tight) and against the BF16 torch path (FP8 rounding)
        assert r["rel_err_vs_twin"] < 2e-2 and 1e-3 < r["rel_err_vs_torch"] < 1e-1, r


def test_bench_experts_fails_a_quantized_record_off_its_twin():
    from megamoe.bench.experts import failures

    good = {"pass": "fwd", "rel_err_vs_torch": 0.05, "rel_err_vs_twin": 1e-3, "all_written": True}
    assert failures([good]) == []
    assert failures([{**good, "rel_err_vs_twin": 0.03}]) and failures([{**good, "rel_err_vs_torch": 0.2}])
    assert failures([{**good, "all_written": False}])


def test_ep_scaling_tables_the_speedups_by_ep(tmp_path):
    """benchmarks/ep_scaling.py: bench records of several runs in, one row per (preset, tokens, EP) with each
    megamoe row's time over nccl-torch's, the backward and foreign JSON ignored; no records is an error."""
    from pathlib import Path

    def record(impl, ep, ms, correct=True, pass_="fwd"):
        return {"impl": impl, "preset": "tiny", "pass": pass_, "ep": ep, "tokens_per_rank": 64, "time_ms": ms,
                "correct": correct, "commit": f"c{ep}"}

    runs = tmp_path / "runs"
    (runs / "a").mkdir(parents=True)
    (runs / "a" / "ep1.json").write_text(json.dumps([record("nccl-torch", 1, 9.0), record("megamoe", 1, 3.0),
                                                     record("megamoe", 1, 1.0, pass_="bwd")]))
    (runs / "ep2.json").write_text(json.dumps([record("nccl-torch", 2, 8.0), record("megamoe-graph", 2, 5.0),
                                               record("megamoe (fp8-block experts)", 2, 2.0, correct=False)]))
    (runs / "other.json").write_text(json.dumps({"not": "records"}))
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "ep_scaling.py"
    done = subprocess.run([sys.executable, str(script), str(runs)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| tiny")]
    assert [[c.strip() for c in r] for r in rows] == [
        ["tiny", "64", "1", "9.00", "3.00 (3.00x)", "-", "-", "-", "c1", "True"],
        ["tiny", "64", "2", "8.00", "-", "5.00 (1.60x)", "2.00 (4.00x)", "-", "c2", "False"],
    ]
    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run([sys.executable, str(script), str(empty)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "no forward bench records" in done.stderr
    if importlib.util.find_spec("matplotlib") is None:  # the bench extra; CI installs the test extra only
        return
    png = tmp_path / "scaling.png"
    done = subprocess.run([sys.executable, str(script), str(runs), "--png", str(png)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _one_line_error(result, *needles: str) -> str:
    """The command failed on a bad option: exit code 2, one line starting with "error:", no traceback."""
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    for needle in needles:
        assert needle in lines[0], result.output
    return lines[0]


@pytest.mark.parametrize("args, needles", [
    (["--ep", "0"], ["ep must be a positive int, got 0"]),  # was: EP 4
    (["--ep", "-2"], ["ep must be a positive int, got -2"]),
    (["--routing", "foo"], ["routing must be one of uniform, zipf, one-rank", "'foo'"]),
    (["--routing", "one-rank", "--ep", "8"], ["routing one-rank", "k <= experts per rank"]),
    (["--tokens", "-5"], ["tokens must be >= 0", "one per rank", "-5"]),
    (["--ep", "2", "--tokens", "3,-5"], ["tokens must be >= 0"]),
    (["--tokens", "abc"], ["tokens must be integers >= 0", "'abc'"]),
    (["--preset", "nope"], ["unknown preset 'nope'", "tiny"]),
])
def test_bench_bad_options_are_one_line_errors(args, needles):
    _one_line_error(CliRunner().invoke(app, ["bench", "--device", "cpu", "--preset", "tiny", *args]), *needles)


def test_bench_unknown_device_is_a_one_line_error():
    _one_line_error(CliRunner().invoke(app, ["bench", "--device", "tpu"]), "device must be one of cpu, cuda", "'tpu'")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs no visible GPU")
def test_bench_on_cuda_without_a_gpu_says_so():
    _one_line_error(CliRunner().invoke(app, ["bench", "--device", "cuda"]), "no CUDA GPU is visible")


def test_bench_on_cpu_says_its_timings_are_not_gpu_timings_and_shows_progress(tmp_path, capfd):
    out = tmp_path / "records.json"
    result = CliRunner().invoke(app, ["bench", "--device", "cpu", "--preset", "tiny", "--tokens", "8", "--ep", "1",
                                      "--iters", "2", "--steady", "0.01", "--impl", "reference", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "not GPU timings" in result.output
    # the ranks are processes of their own: their stderr is the test process's file descriptor 2
    err = capfd.readouterr().err
    lines = [line.strip() for line in err.splitlines()]
    for name in ("fwd", "bwd"):
        assert [line for line in lines if line.startswith(("steady", "round")) and f" {name}" in line] == [
            f"steady {name}: back to back for 0.01 s", f"round 1/2 {name}", f"round 2/2 {name}"], err
    assert err.index("round 2/2 fwd") < err.index("steady bwd")
    records = json.loads(out.read_text())
    assert [(r["impl"], r["pass"]) for r in records] == [("reference", "fwd"), ("reference", "bwd")]
    assert all(r["steady_s"] == 0.01 and r["steady_rounds"] >= 1 for r in records), records


@pytest.mark.parametrize("args, needles", [
    (["--experts", "0"], ["experts must be counts between 1 and the routes"]),
    (["--experts", "4,999"], ["experts must be counts between 1 and the routes"]),  # before the first load runs
    (["--experts", "abc"], ["experts must be comma-separated counts", "'abc'"]),
    (["--tokens", "0"], ["tokens must be >= 1, got 0"]),  # was: the default 64 tokens
    (["--tokens", "-3"], ["tokens must be >= 1, got -3"]),
    (["--formats", "foo"], ["formats must be among", "'foo'"]),
    (["--preset", "nope"], ["unknown preset 'nope'", "tiny"]),  # was wrapped over two lines at 80 columns
])
def test_bench_experts_bad_options_are_one_line_errors(args, needles):
    _one_line_error(CliRunner().invoke(app, ["bench-experts", *args]), *needles)


def test_plan_prints_the_memory_for_its_layers():
    from megamoe.config import preset
    from megamoe.planner import plan

    want = plan(preset("kimi-k2"), 2, 8192)
    one = CliRunner().invoke(app, ["plan", "--preset", "kimi-k2", "--ep", "2", "--tokens", "8192"])
    assert one.exit_code == 0, one.output
    assert "1 MoE layer" in one.output and f"total for 1 layer " in one.output
    assert f"{want.memory_for(1) / 2**20:10.1f} MiB" in one.output
    four = CliRunner().invoke(app, ["plan", "--preset", "kimi-k2", "--ep", "2", "--tokens", "8192", "--layers", "4"])
    assert four.exit_code == 0, four.output
    assert "4 MoE layers" in four.output and "total for 4 layers" in four.output
    assert f"{want.memory_for(4) / 2**20:10.1f} MiB" in four.output
    assert want.memory_for(4) > want.memory_for(1)


@pytest.mark.parametrize("args, needles", [
    (["--layers", "0"], ["layers must be >= 1, got 0"]),
    (["--layers", "-1"], ["layers must be >= 1, got -1"]),
    (["--preset", "nope"], ["unknown preset 'nope'", "tiny"]),  # was wrapped over two lines at 80 columns
    (["--preset", "tiny", "--ep", "3"], ["num_experts (8) is not divisible by ep (3)"]),
    (["--ep", "0"], ["ep must be a positive int, got 0"]),
    (["--minibatch", "0"], ["minibatch must be >= 1, got 0"]),  # was: ZeroDivisionError
    (["--sms", "0"], ["sms must be >= 1, got 0"]),
])
def test_plan_bad_options_are_one_line_errors(args, needles):
    _one_line_error(CliRunner().invoke(app, ["plan", *args]), *needles)


def test_plan_takes_a_shape_or_a_huggingface_config_and_help_lists_the_presets(tmp_path):
    """Issue 51's first step: a user's own layer on `megamoe plan` (and bench, bench-experts, trace: one helper)."""
    import json

    from typer.testing import CliRunner

    from megamoe.cli import app
    from megamoe.config import PRESETS

    runner = CliRunner()
    shape = runner.invoke(app, ["plan", "--shape", "hidden=2048,intermediate=768,experts=128,top_k=8", "--ep", "8"])
    assert shape.exit_code == 0 and "hidden=2048,intermediate=768,experts=128,top_k=8, EP 8" in shape.output, \
        shape.output
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 2048, "moe_intermediate_size": 768,
                                "num_experts": 128, "num_experts_per_tok": 8}))
    hf = runner.invoke(app, ["plan", "--hf-config", str(path), "--ep", "8"])
    assert hf.exit_code == 0 and hf.output.splitlines()[1:] == shape.output.splitlines()[1:], hf.output
    for args, message in ((["--preset", "tiny", "--shape", "hidden=64"], "give one of --preset, --shape"),
                          (["--shape", "hidden=64"], "a shape needs"),
                          (["--hf-config", str(tmp_path / "none.json")], "--hf-config"),
                          (["--preset", "gpt-5"], "unknown preset")):
        bad = runner.invoke(app, ["plan", *args])
        assert bad.exit_code == 2 and message in bad.output, (args, bad.output)
    for command in ("plan", "bench", "bench-experts", "trace"):
        text = " ".join(runner.invoke(app, [command, "--help"], terminal_width=200).output.split())
        assert all(name in text for name in PRESETS) and "--shape" in text and "--hf-config" in text, command


def test_plan_takes_a_train_preset():
    """Issue 51: `megamoe plan --preset h200x2` (a `megamoe train` preset) plans its MoE layer (Qwen3-30B-A3B's
    shape) at its tokens per rank and its layer count; the options still override them."""
    runner = CliRunner()
    got = runner.invoke(app, ["plan", "--preset", "h200x2"])
    assert got.exit_code == 0, got.output
    header = got.output.splitlines()[0]
    assert header.startswith("megamoe plan: train preset h200x2's MoE layer (hidden=2048,intermediate=768,"
                             "experts=128,top_k=8), EP 2, 8192 tokens per rank") and "8 MoE layers" in header, header
    same = runner.invoke(app, ["plan", "--preset", "qwen3-30b-a3b", "--tokens", "8192", "--layers", "8"])
    assert got.output.splitlines()[1:] == same.output.splitlines()[1:]
    small = runner.invoke(app, ["plan", "--preset", "h200x2", "--tokens", "1024", "--layers", "2"])
    assert small.exit_code == 0 and "1024 tokens per rank" in small.output and "2 MoE layers" in small.output
    _one_line_error(runner.invoke(app, ["plan", "--preset", "h200x2", "--shape", "hidden=64"]), "give one of")
    default = runner.invoke(app, ["plan"])  # no preset: kimi-k2 at 8192 tokens, one layer, as before
    assert default.exit_code == 0 and "kimi-k2, EP 2, 8192 tokens per rank" in default.output
    assert "1 MoE layer" in default.output
