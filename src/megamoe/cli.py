"""The `megamoe` command line: `megamoe bench`."""

from __future__ import annotations

import os
import sys

import torch
import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help="megamoe: an expert-parallel MoE layer.")


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


@app.command()
def bench(
    preset: str = typer.Option(None, help="Model shape (default: kimi-k2 on GPU, tiny on CPU)."),
    tokens: str = typer.Option(None, help="Tokens per rank: one count, or one per rank comma-separated "
                                          "(default: 8192 on GPU, 256 on CPU)."),
    ep: int = typer.Option(None, help="Expert-parallel ranks (default: every GPU, or 4 simulated CPU ranks)."),
    device: str = typer.Option(None, help="cuda or cpu (default: cuda when a GPU is visible)."),
    precision: str = typer.Option("bf16", help="bf16 (fp32 for CPU checks)."),
    impl: str = typer.Option(None, help="Comma-separated implementations: reference, nccl-torch, unfused, "
                                        "megamoe, megamoe-graph (the last three forward only). Default: "
                                        "nccl-torch,unfused,megamoe on GPU, all four on CPU."),
    experts: str = typer.Option("bf16", help="Comma-separated routed-expert formats of the megamoe "
                                             "implementations, each run in turn: bf16, fp8-block, mxfp8 (the "
                                             "others stay BF16; FP8 rows are checked with FP8 tolerances and "
                                             "their weights quantised once, outside the timed passes)."),
    passes: str = typer.Option("fwd,bwd", help="Comma-separated passes: fwd, bwd."),
    iters: int = typer.Option(None, help="Timed iterations (default 20 on GPU, 2 on CPU)."),
    warmup: int = typer.Option(None, help="Untimed iterations first (default 3 on GPU, 0 on CPU: nothing to "
                                          "compile under the interpreter)."),
    routing: str = typer.Option("uniform", help="uniform, zipf or one-rank."),
    seed: int = typer.Option(0, help="Seed of every input."),
    json_path: str = typer.Option(None, "--json", help="Write the records as JSON here."),
    md_path: str = typer.Option(None, "--md", help="Write a Markdown table (with machine, commit, command) here."),
) -> None:
    """Check every implementation against the reference and time it, side by side."""
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
            preset=preset or ("kimi-k2" if gpu else "tiny"),
            tokens=tuple(int(t) for t in _csv(tokens or ("8192" if gpu else "256"))),
            ep=ep or (torch.cuda.device_count() if gpu else 4),
            device=device,
            precision=precision,
            impls=_csv(impl or ("nccl-torch,unfused,megamoe" if gpu else "reference,nccl-torch,unfused,megamoe")),
            experts=_csv(experts),
            passes=_csv(passes),
            iters=iters if iters is not None else (20 if gpu else 2),
            warmup=warmup if warmup is not None else (3 if gpu else 0),
            seed=seed,
            routing=routing,
        )
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    console.print(f"[bold]megamoe bench[/bold]: {opts.preset} on {opts.ep} {device} rank(s), "
                  f"impls {', '.join(opts.impls)}, passes {', '.join(opts.passes)}, {opts.iters} iters")
    records = launch(run_rank, opts.ep, opts, device=device)[0]
    meta = run_metadata(device)
    for record in records:
        record.update(meta)
    print_table(records, console)
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
    preset: str = typer.Option(None, help="Expert shapes (default: kimi-k2 on GPU, tiny on CPU)."),
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
        cfg = get_preset(preset or ("kimi-k2" if gpu else "tiny"))
        routes = (tokens or (8192 if gpu else 64)) * cfg.top_k
        counts = tuple(int(e) for e in _csv(experts or ("192,16" if gpu else "4")))
        chosen = _csv(passes)
        if not set(chosen) <= {"fwd", "bwd"}:
            raise ValueError(f"passes must be fwd and/or bwd, got {passes!r}")
        records = bench_module.run(cfg, routes, counts, torch.device("cuda" if gpu else "cpu"), sweep=sweep,
                                   passes=chosen, profile=profile, formats=tuple(_csv(formats)))
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    meta = run_metadata("cuda" if gpu else "cpu")
    for record in records:
        record.update(meta, preset=preset or ("kimi-k2" if gpu else "tiny"))
    print(bench_module.format_table(records))
    if json_path:
        write_json(records, json_path)
    if bench_module.failures(records):
        console.print("[red]some results disagree with the torch path[/red]")
        raise typer.Exit(1)


@app.command()
def plan(
    preset: str = typer.Option("kimi-k2", help="Model shape."),
    ep: int = typer.Option(2, help="Expert-parallel ranks."),
    tokens: int = typer.Option(8192, help="Tokens per rank."),
    sms: int = typer.Option(132, help="SMs of the GPU (H200: 132)."),
    precision: str = typer.Option("bf16", help="bf16, fp8-block or mxfp8."),
    comm_sms: int = typer.Option(None, help="Pin the communication SMs."),
    minibatch: int = typer.Option(None, help="Pin the minibatch (rows)."),
    ring_rows: int = typer.Option(None, help="Pin the ring size (rows)."),
) -> None:
    """The megakernel's minibatch, comm/compute SM split, ring size and memory, with the reasoning."""
    from megamoe.config import preset as get_preset
    from megamoe.planner import format_plan
    from megamoe.planner import plan as make_plan

    try:
        result = make_plan(get_preset(preset), ep, tokens, num_sms=sms, precision=precision, comm_sms=comm_sms,
                           minibatch=minibatch, ring_rows=ring_rows)
    except ValueError as exc:
        Console().print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    print(f"megamoe plan: {preset}, EP {ep}, {tokens} tokens per rank, {precision}, {sms} SMs")
    print(format_plan(result))


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
