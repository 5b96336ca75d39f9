"""The `megamoe` command line: `megamoe bench`, `megamoe train`, `megamoe trace`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import NoReturn

import torch
import typer
from rich.console import Console
from rich.markup import escape

app = typer.Typer(add_completion=False, no_args_is_help=True, help="megamoe: an expert-parallel MoE layer.")


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _ints(text: str, what: str) -> tuple[int, ...]:
    """Comma-separated integers; a part that is not one is a ValueError naming ``what``."""
    values = []
    for part in _csv(text):
        try:
            values.append(int(part))
        except ValueError:
            raise ValueError(f"{what}, got {part!r}") from None
    return tuple(values)


def _fail(message: str) -> NoReturn:
    """A bad option: one line on stderr (not wrapped, whatever the terminal's width), exit code 2."""
    Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {escape(str(message))}")
    raise typer.Exit(2)


DEVICES = ("cpu", "cuda")


def _presets_help() -> str:
    from megamoe.config import PRESETS

    return ", ".join(PRESETS)


SHAPE_HELP = ("A layer shape instead of a preset: hidden=D,intermediate=I,experts=E,top_k=k[,shared=Is[+Is2]]"
              "[,activation=KIND[:LIMIT[:ALPHA]]][,bias=1] (swiglu, swiglu-clamped:L, gpt-oss, geglu; bias=1: the "
              "routed experts carry biases).")
HF_CONFIG_HELP = ("A HuggingFace model's config.json to take the MoE layer's shape from (Qwen2/3-MoE, DeepSeek-V3, "
                  "Mixtral, gpt-oss, OLMoE, GLM-4.5-MoE, Llama-4).")


def _layer(preset: str | None, shape: str | None, hf_config: str | None, default: str) -> str:
    """The layer the options name, as ``megamoe.config.preset`` reads it (a preset name or a shape's text);
    ValueError when more than one is given or one is bad."""
    import json

    from megamoe.config import hf_config_shape, parse_shape, preset as get_preset, shape_spec

    given = [name for name, v in (("--preset", preset), ("--shape", shape), ("--hf-config", hf_config)) if v]
    if len(given) > 1:
        raise ValueError(f"give one of --preset, --shape and --hf-config, got {' and '.join(given)}")
    if shape:
        return shape_spec(parse_shape(shape))
    if hf_config:
        try:
            with open(hf_config) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--hf-config {hf_config}: {exc}") from None
        return shape_spec(hf_config_shape(config))
    name = preset or default
    get_preset(name)  # known, or ValueError naming the presets
    return name


@app.command()
def bench(
    preset: str = typer.Option(None, help=f"Model shape: {_presets_help()} (default: kimi-k2 on GPU, tiny on CPU)."),
    shape: str = typer.Option(None, help=SHAPE_HELP),
    hf_config: str = typer.Option(None, "--hf-config", help=HF_CONFIG_HELP),
    tokens: str = typer.Option(None, help="Tokens per rank: one count, or one per rank comma-separated "
                                          "(default: 8192 on GPU, 256 on CPU)."),
    ep: int = typer.Option(None, help="Expert-parallel ranks (default: every GPU, or 4 simulated CPU ranks)."),
    device: str = typer.Option(None, help="cuda or cpu (default: cuda when a GPU is visible)."),
    precision: str = typer.Option("bf16", help="bf16 (fp32 for CPU checks)."),
    impl: str = typer.Option(None, help="Comma-separated implementations: reference, nccl-torch, deepep-torch "
                                        "(skipped with the reason where DeepEP is not built), unfused, megamoe, "
                                        "megamoe-graph (forward only; megamoe's and unfused's backward in "
                                        "every expert format; unfused: megamoe's steps one launch after "
                                        "another, the no-overlap ablation). Default: nccl-torch,unfused,megamoe "
                                        "on GPU, reference,nccl-torch,megamoe on CPU (where megamoe runs its steps "
                                        "one after another anyway)."),
    experts: str = typer.Option("bf16", help="Comma-separated routed-expert formats of the megamoe "
                                             "implementations, each run in turn: bf16, fp8-block, mxfp8. With an "
                                             "FP8 format, nccl-torch and deepep-torch also run their own FP8 "
                                             "experts (fp8-rowwise: torch._scaled_grouped_mm, forward only); FP8 "
                                             "rows are checked with FP8 tolerances and their weights quantised "
                                             "once, outside the timed passes."),
    passes: str = typer.Option("fwd,bwd", help="Comma-separated passes: fwd, bwd (its forward untimed before it), "
                                                "step (forward + backward)."),
    iters: int = typer.Option(None, help="Timed rounds per pass, each timing every implementation once in the "
                                         "same order; the records give p10/p50/p90 over them (default 20 on GPU, "
                                         "1 on CPU: interpreter timings say nothing)."),
    warmup: int = typer.Option(None, help="Untimed rounds first (default 3 on GPU, 0 on CPU: nothing to "
                                          "compile under the interpreter)."),
    steady: float = typer.Option(None, help="Seconds of every implementation back to back after the warm-up, "
                                            "per pass, so that the GPU settles at its power cap's clock before "
                                            "the timed rounds (default 2 on GPU, 0 on CPU)."),
    routing: str = typer.Option("uniform", help="uniform, zipf (popularity ~ rank^-1.2), zipf-A (rank^-A) or "
                                "one-rank."),
    seed: int = typer.Option(0, help="Seed of every input."),
    json_path: str = typer.Option(None, "--json", help="Write the records as JSON here."),
    md_path: str = typer.Option(None, "--md", help="Write a Markdown table (with machine, commit, command) here."),
) -> None:
    """Check every implementation against the reference and time it, side by side."""
    if device is not None and device not in DEVICES:
        _fail(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        needs = f" (ep={ep} needs {ep} GPUs, 0 visible)" if ep is not None else ""
        _fail(f"--device cuda: no CUDA GPU is visible{needs}; use --device cpu")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":  # Triton kernels run under the interpreter on the CPU (set before they are imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from megamoe.bench.harness import BenchOptions, run_rank
    from megamoe.bench.report import print_table, run_metadata, write_json, write_markdown
    from megamoe.parallel.world import launch

    console = Console()
    gpu = device == "cuda"
    try:
        opts = BenchOptions(
            preset=_layer(preset, shape, hf_config, "kimi-k2" if gpu else "tiny"),
            tokens=_ints(tokens or ("8192" if gpu else "256"),
                         "tokens must be integers >= 0 (one count, or one per rank comma-separated)"),
            ep=ep if ep is not None else (torch.cuda.device_count() if gpu else 4),
            device=device,
            precision=precision,
            impls=_csv(impl or ("nccl-torch,unfused,megamoe" if gpu else "reference,nccl-torch,megamoe")),
            experts=_csv(experts),
            passes=_csv(passes),
            iters=iters if iters is not None else (20 if gpu else 1),
            warmup=warmup if warmup is not None else (3 if gpu else 0),
            steady=steady,
            seed=seed,
            routing=routing,
            progress=True,
        )
    except ValueError as exc:
        _fail(str(exc))
    console.print(f"[bold]megamoe bench[/bold]: {opts.preset} on {opts.ep} {device} rank(s), "
                  f"impls {', '.join(opts.impls)}, passes {', '.join(opts.passes)}, {opts.iters} interleaved "
                  f"rounds after {opts.warmup} warm-up and {opts.steady:g} s steady", soft_wrap=True)
    records = launch(run_rank, opts.ep, opts, device=device)[0]
    meta = run_metadata(device)
    for record in records:
        record.update(meta)
    print_table(records, console)  # with its legend (and, on the CPU, why no ratio nor rate is shown)
    if json_path:
        write_json(records, json_path)
        console.print(f"records written to {json_path}")
    if md_path:
        write_markdown(records, md_path, "megamoe " + " ".join(sys.argv[1:]))
    if not all(r["correct"] for r in records):
        console.print("[red]some implementation disagrees with the reference[/red]")
        raise typer.Exit(1)


@app.command("bench-experts")
def bench_experts(
    preset: str = typer.Option(None, help=f"Expert shapes: {_presets_help()} (default: kimi-k2 on GPU, tiny on "
                                          "CPU)."),
    shape: str = typer.Option(None, help=SHAPE_HELP),
    hf_config: str = typer.Option(None, "--hf-config", help=HF_CONFIG_HELP),
    tokens: int = typer.Option(None, help="Tokens on the GPU; rows = tokens x k (default 8192 on GPU, 64 on CPU)."),
    experts: str = typer.Option(None, help="Comma-separated expert counts, one load each (default 192,16 on GPU, "
                                           "4 on CPU)."),
    passes: str = typer.Option("fwd,bwd", help="Comma-separated passes: fwd, bwd."),
    sweep: bool = typer.Option(False, help="Time every candidate tile shape (forward) and tile variant (backward)."),
    profile: bool = typer.Option(False, help="Per-kernel backward times from the torch profiler (GPU)."),
    formats: str = typer.Option("bf16", help="Comma-separated expert formats: bf16, fp8-block, mxfp8 (the "
                                             "quantised ones forward only, next to the BF16 kernels)."),
    json_path: str = typer.Option(None, "--json", help="Write the records as JSON here."),
) -> None:
    """Expert GEMMs alone on one device (no communication) against torch._grouped_mm + SwiGLU."""
    gpu = torch.cuda.is_available()
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from megamoe.bench import experts as bench_module
    from megamoe.bench.report import run_metadata, write_json
    from megamoe.config import preset as get_preset

    console = Console()
    try:
        preset = _layer(preset, shape, hf_config, "kimi-k2" if gpu else "tiny")
        cfg = get_preset(preset)
        tokens = tokens if tokens is not None else (8192 if gpu else 64)
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        routes = tokens * cfg.top_k
        counts = _ints(experts or ("192,16" if gpu else "4"), "experts must be comma-separated counts >= 1")
        if not counts or any(not 1 <= e <= routes for e in counts):  # all checked before the first load runs
            raise ValueError(f"experts must be counts between 1 and the routes ({tokens} tokens x k={cfg.top_k} = "
                             f"{routes}), got {experts!r}")
        chosen = _csv(passes)
        if not set(chosen) <= {"fwd", "bwd"}:
            raise ValueError(f"passes must be fwd and/or bwd, got {passes!r}")
        records = bench_module.run(cfg, routes, counts, torch.device("cuda" if gpu else "cpu"), sweep=sweep,
                                   passes=chosen, profile=profile, formats=tuple(_csv(formats)))
    except ValueError as exc:
        _fail(str(exc))
    meta = run_metadata("cuda" if gpu else "cpu")
    for record in records:
        record.update(meta, preset=preset)
    print(bench_module.format_table(records))
    if json_path:
        write_json(records, json_path)
    if bench_module.failures(records):
        console.print("[red]some results disagree with the torch path[/red]")
        raise typer.Exit(1)


def _train_presets() -> dict:
    from megamoe.training.model import PRESETS as TRAIN_PRESETS

    return TRAIN_PRESETS


@app.command()
def plan(
    preset: str = typer.Option(None, help=f"Model shape: {_presets_help()} (default kimi-k2); or a `megamoe train` "
                                          f"preset ({', '.join(_train_presets())}): its MoE layer, tokens per rank "
                                          "and layers."),
    shape: str = typer.Option(None, help=SHAPE_HELP),
    hf_config: str = typer.Option(None, "--hf-config", help=HF_CONFIG_HELP),
    ep: int = typer.Option(2, help="Expert-parallel ranks."),
    tokens: int = typer.Option(None, help="Tokens per rank (default 8192, or a train preset's)."),
    sms: int = typer.Option(132, help="SMs of the GPU (H200: 132)."),
    precision: str = typer.Option("bf16", help="bf16, fp8-block or mxfp8."),
    comm_sms: int = typer.Option(None, help="Pin the communication SMs."),
    minibatch: int = typer.Option(None, help="Pin the minibatch (rows)."),
    ring_rows: int = typer.Option(None, help="Pin the ring size (rows)."),
    backward_comm_sms: int = typer.Option(None, help="Pin the backward megakernel's communication SMs."),
    backward_minibatch: int = typer.Option(None, help="Pin the backward megakernel's minibatch (rows)."),
    backward_ring_rows: int = typer.Option(None, help="Pin the backward's ring (rows, a multiple of 128)."),
    layers: int = typer.Option(None, help="MoE layers of this shape in the model: the memory per rank for all of "
                                          "them (default 1, or a train preset's)."),
    memory: float = typer.Option(None, help="Memory budget per rank in GiB for the pass and --layers layers (besides "
                                            "the weights): the backward's ring shrinks to fit."),
) -> None:
    """The megakernel's minibatch, comm/compute SM split, ring size and memory, with the reasoning."""
    from megamoe.config import PRESETS
    from megamoe.config import preset as get_preset
    from megamoe.planner import format_plan
    from megamoe.planner import plan as make_plan

    train_preset = None if preset in PRESETS else _train_presets().get(preset)
    if train_preset is not None:  # a `megamoe train` model: its MoE layers' shape, tokens per rank and layers
        tokens = train_preset.tokens_per_rank if tokens is None else tokens
        layers = train_preset.layers if layers is None else layers
    tokens, layers = 8192 if tokens is None else tokens, 1 if layers is None else layers
    try:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        for name, value in (("sms", sms), ("minibatch", minibatch)):  # the planner divides by them
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        label = None
        if train_preset is not None and not (shape or hf_config):
            label = f"train preset {preset}'s MoE layer"
            preset, shape = None, (f"hidden={train_preset.hidden},intermediate={train_preset.moe_intermediate},"
                                   f"experts={train_preset.num_experts},top_k={train_preset.top_k}")
        preset = _layer(preset, shape, hf_config, "kimi-k2")
        result = make_plan(get_preset(preset), ep, tokens, num_sms=sms, precision=precision, comm_sms=comm_sms,
                           minibatch=minibatch, ring_rows=ring_rows, backward_comm_sms=backward_comm_sms,
                           backward_minibatch=backward_minibatch, backward_ring_rows=backward_ring_rows,
                           memory_gib=memory, layers=layers)
        text = format_plan(result, layers)
    except ValueError as exc:
        _fail(str(exc))
    print(f"megamoe plan: {f'{label} ({preset})' if label else preset}, EP {ep}, {tokens} tokens per rank, "
          f"{precision}, {sms} SMs, {layers} MoE layer{'s' if layers != 1 else ''}")
    print(text)


@app.command()
def train(
    preset: str = typer.Option("cpu", help="Model shape: cpu (a tiny Qwen3-MoE, minutes on 2 CPU cores) or h200x2 "
                                           "(8 Qwen3-30B-A3B-shaped layers for two H200s)."),
    impl: str = typer.Option("megamoe,reference", help="Comma-separated MoE implementations, each trained in turn "
                                                        "from the same weights and data: megamoe, reference, "
                                                        "nccl-torch."),
    steps: int = typer.Option(None, help="Optimizer steps per implementation (default: the preset's: cpu 12, "
                                         "h200x2 50)."),
    ranks: int = typer.Option(None, help="Expert-parallel ranks (default: every GPU, or 2 simulated CPU ranks)."),
    device: str = typer.Option(None, help="cuda or cpu (default: cuda when a GPU is visible)."),
    seed: int = typer.Option(0, help="Seed of the initial weights and of the synthetic data."),
    lr: float = typer.Option(None, help="AdamW's learning rate (default: the preset's)."),
    out: str = typer.Option("megamoe-train.json", help="Write the run's JSON record here."),
    plot: str = typer.Option("megamoe-train.png", help="Write the loss curves (PNG) here ('': no PNG)."),
    check_memory: bool = typer.Option(True, help="Refuse, before anything is allocated, a preset whose estimated "
                                                 "memory (weights, gradients, AdamW state, activations: "
                                                 "megamoe.training.memory) exceeds the device's: the CPU's RAM "
                                                 "(shared by the ranks) or each GPU's free memory."),
) -> None:
    """Train a small decoder end to end with AdamW, expert parallel, its MoE blocks run by each implementation."""
    if device is not None and device not in DEVICES:
        _fail(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        _fail("--device cuda: no CUDA GPU is visible; use --device cpu")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":  # Triton kernels run under the interpreter on the CPU (set before they are imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from megamoe.training import TrainOptions, format_table, plot_losses, plot_unavailable
    from megamoe.training import get_preset as get_train_preset
    from megamoe.training import train as run_training
    from megamoe.training import write_json as write_record
    from megamoe.training.memory import check_fits

    console = Console(soft_wrap=True)
    try:
        options = TrainOptions(preset=preset, impls=_csv(impl), steps=steps, device=device, seed=seed, lr=lr,
                               ranks=ranks if ranks is not None else (torch.cuda.device_count() if device == "cuda"
                                                                      else 2), check_memory=check_memory)
    except ValueError as exc:
        _fail(str(exc))
    if plot and (why := plot_unavailable(plot)) is not None:  # said before the training, not after it
        _fail(f"{why}; or --plot '' for no PNG")
    if options.check_memory:  # a preset too big for the device: refused before anything starts
        try:
            check_fits(get_train_preset(options.preset), options.ranks, device)
        except ValueError as exc:
            _fail(str(exc))
        options = dataclasses.replace(options, check_memory=False)  # asked once
    console.print(f"[bold]megamoe train[/bold]: {options.preset} on {options.ranks} {device} rank(s), impls "
                  f"{', '.join(options.impls)}, {options.steps} steps, lr {options.lr:g}")
    try:
        record = run_training(options, log=console.print)
    except (ImportError, ValueError) as exc:  # transformers missing; the preset does not fit the device
        _fail(str(exc))
    print(format_table(record))
    if device == "cpu":
        console.print("note: CPU run: the Triton kernels ran under the interpreter, so these timings are not GPU "
                      "timings; peak memory is each rank's max RSS")
    write_record(record, out)
    console.print(f"record written to {out}")
    if plot:
        if (why := plot_losses(record, plot)) is not None:  # matplotlib went missing during the run
            _fail(why)
        console.print(f"loss curves written to {plot}")


def _trace_rank(world, preset: str, tokens: int, precision: str, passes: int, steady: float) -> dict:
    from megamoe.tools.trace import record_rank

    return record_rank(world, preset, tokens, precision, passes, steady)


@app.command()
def trace(
    preset: str = typer.Option(None, help=f"Layer shape: {_presets_help()} (default kimi-k2)."),
    shape: str = typer.Option(None, help=SHAPE_HELP),
    hf_config: str = typer.Option(None, "--hf-config", help=HF_CONFIG_HELP),
    tokens: int = typer.Option(8192, help="Tokens per rank."),
    precision: str = typer.Option("bf16", help="bf16, fp8-block or mxfp8."),
    ranks: int = typer.Option(None, help="Expert-parallel ranks (default: every visible GPU)."),
    passes: int = typer.Option(3, help="Passes to run; the last one is traced (the first compile)."),
    steady: float = typer.Option(1.0, help="Then seconds of passes back to back before the traced one (the "
                                           "GPU at its power cap, as in training; 0: none)."),
    out: str = typer.Option("megamoe-trace", help="Folder for trace_record.json.gz, trace.json and trace.png."),
    from_record: str = typer.Option(None, "--from", help="Convert a recorded trace_record.json[.gz] instead of "
                                                         "running a pass (no GPU needed)."),
) -> None:
    """A forward pass of the megakernel on a per-SM timeline: a Perfetto / Chrome trace and a PNG."""
    from megamoe.tools import trace as tr

    if from_record is not None:
        try:
            record = tr.load(from_record)
        except (OSError, ValueError) as exc:
            _fail(str(exc))
    else:
        from megamoe.parallel.world import launch
        from megamoe.precision import check_precision

        try:
            preset = _layer(preset, shape, hf_config, "kimi-k2")
            check_precision(precision)
        except ValueError as exc:
            _fail(str(exc))
        if tokens < 1 or passes < 1 or (ranks is not None and ranks < 1):
            _fail("--tokens, --passes and --ranks must be positive")
        if not math.isfinite(steady) or steady < 0:
            _fail(f"--steady must be a finite number of seconds >= 0, got {steady}")
        if not torch.cuda.is_available():
            _fail("megamoe trace runs a pass on a CUDA GPU (the TRACE build reads the GPU's globaltimer); "
                  "convert a recorded trace with --from trace_record.json.gz")
        ranks = ranks or torch.cuda.device_count()
        results = launch(_trace_rank, ranks, preset, tokens, precision, passes, steady, device="cuda")
        record = tr.new_record(results, preset, tokens, precision, torch.cuda.get_device_name())
    os.makedirs(out, exist_ok=True)
    if from_record is None:
        tr.save(record, os.path.join(out, "trace_record.json.gz"))
    with open(os.path.join(out, "trace.json"), "w") as f:
        json.dump(tr.chrome_trace(record), f)
    skipped = tr.timeline_png(record, os.path.join(out, "trace.png"))
    console = Console(soft_wrap=True)
    for row in tr.summary(record):
        console.print(", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    console.print(f"written to {out}/: trace.json (open in https://ui.perfetto.dev)"
                  + ("" if skipped else ", trace.png") + ("" if from_record else ", trace_record.json.gz"))
    if skipped:
        console.print(skipped)


@app.command()
def version() -> None:
    """Print the package version."""
    from megamoe import __version__

    print(__version__)


def main() -> None:
    app(prog_name="megamoe")


if __name__ == "__main__":
    main()
    sys.exit(0)
