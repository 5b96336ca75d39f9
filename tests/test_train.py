"""`megamoe train` on 2 CPU ranks: a Qwen3-MoE decoder trained through megamoe follows the reference
implementation's loss curve, its loss falls, its first gradient is the full batch's, and the record, the table
and the plot come out; bad options are refused with a message."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from typer.testing import CliRunner

from megamoe.baselines import deepep_torch
from megamoe.cli import app
from megamoe.training import MarkovTokens, TrainOptions, get_preset, memory, plot_losses, train
from megamoe.training.model import qwen3_moe_config
from megamoe.training.report import format_table

transformers = pytest.importorskip("transformers")

STEPS = 6
#: Each step's loss, megamoe against the reference (both BF16 experts, the reference's math in FP32): measured
#: 6e-7 at step 1 growing to 2.3e-3 by step 6 (training amplifies the rounding; 2e-2 is passed near step 17).
#: Not a check of the gradient's scale: AdamW divides it out (a run whose experts' gradients were not divided by
#: the world size moved the loss by 5e-4 in 8 steps). The first step's gradient norms below check that.
LOSS_TOLERANCE = 2e-2
#: The first step's gradient norms (all parameters; the routed experts alone) against one FP32 process on both
#: ranks' tokens (the same weights): measured <= 2e-5 (a norm averages the BF16 experts' rounding, 4e-3 an
#: element, over every element). Leaving the experts' (or the replicated parameters') gradients summed over the
#: ranks doubles a norm; leaving out the all-reduce moved it 22 %; all-reducing the experts too moved theirs 29 %.
FIRST_GRADIENT_TOLERANCE = 1e-3
IMPLS = ("megamoe", "reference")


def test_a_training_run_and_its_record(subtests):
    """One run of both implementations (~45 s on 2 cores: one test, so one xdist worker trains it), checked as
    subtests."""
    record = train(TrainOptions(preset="cpu", impls=IMPLS, steps=STEPS, ranks=2, device="cpu", seed=0))
    for check in (_megamoe_follows_the_reference_loss_curve, _the_loss_falls,
                  _first_step_gradient_is_the_full_batch_gradient, _record_has_timings_and_memory,
                  _memory_estimate_is_near_the_cpu_ranks_peak):
        with subtests.test(msg=check.__name__.strip("_")):
            check(record)


def _rel(got: float, want: float) -> float:
    return abs(got - want) / abs(want)


def _megamoe_follows_the_reference_loss_curve(record):
    assert list(record["runs"]) == list(IMPLS) and record["world_size"] == 2 and record["steps"] == STEPS
    got, want = record["runs"]["megamoe"]["losses"], record["runs"]["reference"]["losses"]
    assert len(got) == len(want) == STEPS and all(math.isfinite(v) for v in got + want)
    worst = max(_rel(g, w) for g, w in zip(got, want))
    assert worst < LOSS_TOLERANCE, (got, want)


def _the_loss_falls(record):
    for impl, run in record["runs"].items():
        first, last = run["losses"][0], run["losses"][-1]
        assert first == pytest.approx(math.log(get_preset("cpu").vocab), rel=0.05), impl  # an untrained model
        assert last < 0.9 * first, (impl, run["losses"])


def _full_batch_first_step(options: TrainOptions) -> tuple[float, float, float]:
    """(loss, gradient norm, routed experts' gradient norm) of the unpatched FP32 model on every rank's first
    batch: what one process training on the whole batch would see."""
    preset = get_preset(options.preset)
    torch.manual_seed(options.seed)  # as the ranks build it
    model = transformers.Qwen3MoeForCausalLM(qwen3_moe_config(preset)).float().train()
    data = MarkovTokens(preset.vocab, options.seed)
    batches = [data.batch(0, rank, preset.batch, preset.sequence) for rank in range(options.ranks)]
    losses = [model(input_ids=ids, labels=ids).loss for ids in batches]
    loss = torch.stack(losses).mean()  # every rank the same token count: the mean over all tokens
    loss.backward()
    squares = {name: p.grad.double().pow(2).sum().item() for name, p in model.named_parameters()}
    experts = sum(v for name, v in squares.items() if name.endswith(("experts.gate_up_proj", "experts.down_proj")))
    return loss.item(), math.sqrt(sum(squares.values())), math.sqrt(experts)


def _first_step_gradient_is_the_full_batch_gradient(record):
    """Catches a wrong reduction: the first step's gradients (same weights, same tokens) reduced over the ranks
    must be the gradient of the whole batch's mean loss."""
    loss, norm, expert_norm = _full_batch_first_step(TrainOptions(preset="cpu", steps=STEPS, ranks=2, seed=0))
    for impl, run in record["runs"].items():
        assert _rel(run["losses"][0], loss) < 1e-3, (impl, run["losses"][0], loss)
        assert _rel(run["grad_norms"][0], norm) < FIRST_GRADIENT_TOLERANCE, (impl, run["grad_norms"][0], norm)
        assert _rel(run["expert_grad_norms"][0], expert_norm) < FIRST_GRADIENT_TOLERANCE, (
            impl, run["expert_grad_norms"][0], expert_norm)


def _record_has_timings_and_memory(record):
    assert record["device"] == "cpu" and record["tokens_per_rank_per_step"] == 64
    for impl, run in record["runs"].items():
        assert len(run["step_ms"]) == len(run["moe_ms"]) == STEPS
        assert all(0 < m < s for m, s in zip(run["moe_ms"], run["step_ms"])), impl
        assert run["rest_ms_median"] > 0 and run["tokens_per_s_per_gpu"] > 0, impl
        assert run["peak_memory_bytes"] > 2**20, impl
        assert run["graphs"]["kernels"] == 0, (impl, run["graphs"])  # CPU ranks run no CUDA graphs


def _memory_estimate_is_near_the_cpu_ranks_peak(record):
    """`megamoe train`'s memory estimate within a factor of two of the measured max RSS (the `cpu` preset: mostly
    the process itself)."""
    want = memory.estimate(get_preset("cpu"), 2, "cpu").peak
    for impl, run in record["runs"].items():
        assert 0.5 < want / run["peak_memory_bytes"] < 2, (impl, want, run["peak_memory_bytes"])


def test_cli_writes_the_record_the_table_and_the_plot(tmp_path):
    out, plot = tmp_path / "train.json", tmp_path / "loss.png"
    result = CliRunner().invoke(app, ["train", "--device", "cpu", "--ranks", "2", "--steps", "2", "--impl",
                                      "reference,nccl-torch", "--out", str(out), "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert set(saved["runs"]) == {"reference", "nccl-torch"}
    assert all(len(run["losses"]) == 2 for run in saved["runs"].values())
    for column in ("impl", "final loss", "tokens/s/GPU", "step ms", "MoE ms", "peak MiB", "graphs"):
        assert column in result.output
    assert "nccl-torch" in result.output.split("tokens/s/GPU")[1]  # a row of the table
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"loss curves written to {plot}" in result.output


def test_table_shows_each_impls_graph_replays_and_captures():
    run = {"final_loss": 3.5, "tokens_per_s_per_gpu": 1000.0, "step_ms_median": 9.0, "moe_ms_median": 4.0,
           "peak_memory_bytes": 2**30}
    graphs = {"kernels": 1, "replays": 9, "captures": 1, "backward_replays": 8, "backward_captures": 2}
    table = format_table({"runs": {"megamoe": {**run, "graphs": graphs},
                                   "nccl-torch": {**run, "graphs": {**graphs, "kernels": 0}}}})
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
    assert rows["megamoe"][-3:] == ["17", "/", "3"] and rows["nccl-torch"][-1] == "-", table


def test_plot_losses_writes_a_png(tmp_path):
    """matplotlib is a dependency (issue 51: the README's install gave `megamoe train` no PNG)."""
    record = {"preset": {"name": "cpu"}, "world_size": 2, "device": "cpu",
              "runs": {"megamoe": {"losses": [4.9, 4.1, 3.5]}, "reference": {"losses": [4.9, 4.0, 3.5]}}}
    path = tmp_path / "sub" / "loss.png"
    assert plot_losses(record, str(path)) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_without_matplotlib_says_so_before_training(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "train.json"
    result = CliRunner().invoke(app, ["train", "--device", "cpu", "--out", str(out), "--plot", str(tmp_path / "a.png")])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "matplotlib is not installed" in result.output and "pip install matplotlib" in result.output
    assert "--plot ''" in result.output and "training" not in result.output and not out.exists()


def test_cli_refuses_a_preset_too_big_for_the_cpu_before_it_starts(monkeypatch):
    """Issue 51: `--preset h200x2 --device cpu` grew each rank to ~10 GB before anything said no."""
    monkeypatch.setattr(memory, "cpu_memory", lambda: (64 * memory.GiB, 50 * memory.GiB))
    result = CliRunner().invoke(app, ["train", "--preset", "h200x2", "--device", "cpu"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    line = " ".join(result.output.split())
    assert "preset h200x2 does not fit this machine's RAM: 2 CPU rank(s) would need about" in line, line
    assert "the machine has 64.0 GiB, 50.0 GiB available now" in line and "--no-check-memory" in line
    for part in ("weights", "gradients", "AdamW state", "activations"):
        assert part in line
    assert "megamoe train:" not in line  # refused before the run's first line


def test_memory_estimate_counts_the_models_parameters_and_refuses_what_cannot_fit(monkeypatch):
    """The closed-form count is the model's (built on the meta device: nothing allocated); h200x2 needs more
    than an 80 GiB GPU per rank and fits a 141 GiB H200; the cpu preset fits any machine."""
    for name in ("cpu", "h200x2"):
        preset = get_preset(name)
        with torch.device("meta"):
            model = transformers.Qwen3MoeForCausalLM(qwen3_moe_config(preset))
        experts = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj")))
        assert memory.parameter_counts(preset) == (sum(p.numel() for p in model.parameters()), experts), name
    h200x2 = get_preset("h200x2")
    gpu = memory.estimate(h200x2, 2, "cuda")
    assert 80 * memory.GiB < gpu.peak < 140 * memory.GiB, gpu
    assert memory.estimate(h200x2, 2, "cpu").activations > gpu.activations  # eager attention's scores
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(memory, "gpu_free_memory", lambda count: [79 * memory.GiB] * count)
    with pytest.raises(ValueError, match=r"does not fit the GPUs: each of 2 rank\(s\) would need about .* the "
                                         r"GPUs have 79.0, 79.0 GiB free"):
        memory.check_fits(h200x2, 2, "cuda")
    monkeypatch.setattr(memory, "gpu_free_memory", lambda count: [139 * memory.GiB] * count)
    memory.check_fits(h200x2, 2, "cuda")
    with pytest.raises(ValueError, match="2 ranks per GPU"):  # ranks sharing a GPU need its memory together
        memory.check_fits(h200x2, 4, "cuda")
    memory.check_fits(get_preset("cpu"), 2, "cpu")  # this machine's own RAM


@pytest.mark.parametrize("args, message", [
    (["--preset", "huge"], "preset must be one of cpu, h200x2, got 'huge'"),
    (["--impl", "megamoe,deepep-torch"], "impl deepep-torch: deep_ep is not importable"),
    (["--impl", "unfused"], "impl must be one of megamoe, reference, nccl-torch, deepep-torch, got 'unfused'"),
    (["--steps", "0"], "steps must be an integer >= 1, got 0"),
    (["--ranks", "0"], "ranks must be an integer >= 1, got 0"),
    (["--ranks", "3"], "8 experts do not split over 3 ranks"),
    (["--lr", "-1"], "lr must be a positive number, got -1.0"),
    (["--device", "tpu"], "device must be one of cpu, cuda, got 'tpu'"),
])
def test_cli_refuses_bad_options_with_a_message(args, message):
    if args == ["--impl", "megamoe,deepep-torch"] and deepep_torch.unavailable() is None:
        pytest.skip("deep_ep is importable here")
    result = CliRunner().invoke(app, ["train", "--device", "cpu", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("kwargs", [{"preset": "huge"}, {"impls": ()}, {"impls": ("megamoe", "megamoe")},
                                    {"steps": 0}, {"ranks": 0}, {"ranks": 3}, {"device": "tpu"}, {"lr": 0.0}])
def test_options_refuse_bad_input(kwargs):
    with pytest.raises(ValueError):
        TrainOptions(**kwargs)


def test_h200x2_preset_builds_its_config():
    preset = get_preset("h200x2")
    config = qwen3_moe_config(preset, attn_implementation="sdpa")
    assert (config.num_hidden_layers, config.hidden_size, config.num_experts, config.num_experts_per_tok,
            config.moe_intermediate_size) == (8, 2048, 128, 8, 768)
    assert preset.sequence == 4096 and config.max_position_embeddings >= preset.sequence
    assert TrainOptions(preset="h200x2", ranks=2).steps == preset.steps
