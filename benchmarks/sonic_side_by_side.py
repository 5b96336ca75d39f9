"""SonicMoE beside megamoe at EP 1 on one GPU: the training forward and forward+backward, BF16, interleaved rounds.

    PYTHONPATH=src python3 benchmarks/sonic_side_by_side.py [--shapes sonic-7b,sonic-d4096,sonic-120b,qwen3-30b-a3b]
        [--tokens N] [--impls megamoe,sonic,sonic-tc,megamoe-tc] [--rounds 5] [--seconds 1.0]
        [--sonic-tune on|off] [--sonic-layout interleaved|concat] [--skip-check] [--out PATH]
    PYTHONPATH=src python3 benchmarks/sonic_side_by_side.py --device cpu --tiny      # smoke run: megamoe only

SonicMoE (Dao-AILab/sonic-moe, its PyPI wheel ``sonic-moe``; QuACK's CuTe-DSL grouped GEMMs) must be importable
(``import sonicmoe``); how it gets to the GPU machine is .sonic/RUN.md (never committed). Without it the script
prints the import error, times megamoe alone and exits 0.

The shapes are SonicMoE's three published ones (issue 49; presets in megamoe.config) and Qwen3-30B-A3B, each at
its tokens per GPU: sonic-7b T 24576 (D 1536, I 256, E 128, k 8), sonic-d4096 T 32768 (D 4096, I 512, E 128, k 8),
sonic-120b T 32768 (D 4096, I 2048, E 64, k 4), qwen3-30b-a3b T 8192 (D 2048, I 768, E 128, k 8). SwiGLU, no
biases, no shared expert.

The implementations (every one differentiable in x, the routing scores and the experts' weights):

- ``megamoe``: ``megamoe.moe(world, x, top_experts, router_weights, w_gate_up, w_down)`` at EP 1.
- ``sonic``: ``sonicmoe.functional.moe_general_routing_inputs`` fed the same top-k ids and weights (its API for
  given routing: flat (token, expert, score) triples, tokens ascending).
- ``sonic-tc``: ``sonicmoe.functional.moe_TC_softmax_topk_layer``, what ``sonicmoe.MoE`` and its benchmark
  (benchmarks/moe-cute.py) call: its own router inside (``x @ router_w.T``, softmax over the top-k logits).
- ``megamoe-tc``: the same router in torch (``F.linear``, ``topk``, softmax over the top-k) in front of
  ``megamoe.moe``: the peer of ``sonic-tc``.

The routing fed to ``megamoe`` and ``sonic`` is that router's on the same x and router weights, so all four route
alike (``sonic-tc``'s top-k kernel may break ties between equal BF16 logits otherwise: counted and reported).
SonicMoE's gate/up weights are its default layout, gate and up rows interleaved (``--sonic-layout concat``: its
``concat_layout=True``, the very tensor megamoe reads); its down weights are megamoe's tensor, permuted as
``sonicmoe.MoE`` permutes its own. QuACK autotunes each GEMM on its first call of a shape (``--sonic-tune off``: its
default tile config, no tuning; a tuned run of the four shapes compiles for minutes).

Before timing, once per shape: every impl's output (and, for the given-routing impls, its gradients of x, the
routing scores and both expert weights) against megamoe's FP32 oracle (``megamoe.reference.layer``) at the
project's BF16 bounds (``megamoe.bench.accuracy``), and ``sonic``'s output against ``megamoe``'s directly.

Timing: a steady-state round of every call first (untimed: the GPU reaches its power cap), then ``--rounds``
rounds, each running every impl's forward, then its forward+backward, back to back for ``--seconds`` each
(groups of calls between CUDA events; the ms per call of a round is the events' time over the calls), so every
impl sees the same clocks. The median round is reported. ``fwd`` is the training forward (autograd on, the
activations the backward needs kept); ``fwd+bwd`` the forward and ``backward(d_out)``; ``bwd`` their difference.
TFLOP/s count the routed experts' GEMMs only, as SonicMoE counts them: 6 T k D I for the forward, 18 T k D I for
forward+backward, 12 T k D I for the backward. SonicMoE's published H100 figures at its shapes are printed beside.

Prints one table; writes the JSON record to --out (default ``$OUT/sonic_side_by_side.json`` where OUT is set,
else ``./sonic_side_by_side.json``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback

import torch

#: name: (preset, tokens per GPU); ``tiny`` is the CPU smoke shape (no shared expert: SonicMoE has none).
SHAPES = {
    "sonic-7b": ("sonic-7b", 24576),
    "sonic-d4096": ("sonic-d4096", 32768),
    "sonic-120b": ("sonic-120b", 32768),
    "qwen3-30b-a3b": ("qwen3-30b-a3b", 8192),
}
TINY = {"hidden": 256, "intermediate": 128, "num_experts": 8, "top_k": 2, "tokens": 64}
#: SonicMoE's published H100 BF16 rates (its README's "tput" figure, read in issue 49): (fwd, bwd) TFLOP/s.
PUBLISHED_H100 = {"sonic-7b": (365, 405), "sonic-d4096": (500, 510), "sonic-120b": (595, 585)}
IMPLS = ("megamoe", "sonic", "sonic-tc", "megamoe-tc")
SONIC_IMPLS = ("sonic", "sonic-tc")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--tokens", type=int, default=None, help="tokens per GPU for every shape (default: each one's)")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {', '.join(IMPLS)}")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (after one untimed steady-state round)")
    p.add_argument("--seconds", type=float, default=1.0, help="seconds of back-to-back calls per impl and pass "
                                                              "in a round")
    p.add_argument("--group", type=int, default=4, help="calls between two CUDA events")
    p.add_argument("--sonic-tune", choices=("on", "off"), default="on",
                   help="QuACK's GEMM autotuning (on: as SonicMoE runs; off: its default tile config)")
    p.add_argument("--sonic-layout", choices=("interleaved", "concat"), default="interleaved",
                   help="SonicMoE's gate/up weight layout (interleaved: its default)")
    p.add_argument("--skip-check", action="store_true", help="no check against the oracle before timing")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true",
                   help=f"one tiny shape ({', '.join(f'{k} {v}' for k, v in TINY.items())}), one short round: "
                        "the CPU smoke run (--device cpu: Triton's interpreter)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON record (default $OUT/sonic_side_by_side.json, or ./)")
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.impls = [s for s in args.impls.split(",") if s]
    for s in args.shapes:
        if s not in SHAPES:
            p.error(f"unknown shape {s!r} (choose from {', '.join(SHAPES)})")
    for s in args.impls:
        if s not in IMPLS:
            p.error(f"unknown impl {s!r} (choose from {', '.join(IMPLS)})")
    if args.tiny:
        args.shapes, args.rounds, args.seconds, args.group = ["tiny"], min(args.rounds, 1), min(args.seconds, 0.2), 1
    if args.out is None:
        args.out = os.path.join(os.environ.get("OUT") or ".", "sonic_side_by_side.json")
    return args


# ------------------------------------------------------------------------------------------------ SonicMoE


def import_sonic(device: str) -> tuple[object | None, str | None, dict]:
    """(namespace of SonicMoE's entry points, None) or (None, why not); with the versions found."""
    import importlib.metadata as md

    versions = {}
    for dist in ("sonic-moe", "quack-kernels", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13",
                 "nvidia-cutlass-dsl-libs-base", "apache-tvm-ffi", "cuda-bindings"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    try:
        import sonicmoe
        from sonicmoe.enums import ActivationType
        from sonicmoe.functional import moe_general_routing_inputs, moe_TC_softmax_topk_layer
    except Exception as exc:  # ImportError, or the CUDA DSL failing as it loads
        tb = traceback.format_exc()
        versions["import_traceback"] = tb[-4000:]
        last = [line.strip() for line in tb.strip().splitlines() if line.strip().startswith("File ")]
        return None, f"{type(exc).__name__}: {exc} (raised at {last[-1] if last else '?'})", versions
    versions["sonicmoe.__version__"] = getattr(sonicmoe, "__version__", None)
    versions["sonicmoe.__file__"] = sonicmoe.__file__
    if device != "cuda":
        return None, "SonicMoE runs on CUDA GPUs only (SM90/SM100 CuTe-DSL kernels): --device cpu", versions

    class Sonic:
        pass

    s = Sonic()
    s.ActivationType, s.general, s.tc = ActivationType, moe_general_routing_inputs, moe_TC_softmax_topk_layer
    return s, None, versions


def sonic_tuning(on: bool) -> int:
    """Off: every QuACK autotuner loaded keeps one config, ``config=None`` (its function's default tile config);
    returns how many were set."""
    if on:
        return 0
    from quack.autotuner import AutotuneConfig, Autotuner

    n = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("quack") or mod is None:
            continue
        for value in list(vars(mod).values()):
            if isinstance(value, Autotuner):
                value.configs = [AutotuneConfig(config=None)]
                value.cache.clear()
                n += 1
    return n


# ------------------------------------------------------------------------------------------------ the problem


class Problem:
    """One shape's tensors, shared by every impl: x, the router, the routing it gives, both expert weights (the
    leaves the gradients reach), d_out; SonicMoE's view of the weights."""

    def __init__(self, cfg, tokens: int, device, seed: int, sonic_layout: str, with_sonic: bool):
        g = torch.Generator(device=device).manual_seed(seed)  # drawn where they live: sonic-120b has 1.6 G weights
        T, D, I, E, k = tokens, cfg.hidden, cfg.intermediate, cfg.num_experts, cfg.top_k

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16)

        self.T, self.D, self.I, self.E, self.k = T, D, I, E, k
        self.x = randn(T, D).requires_grad_()
        self.router_w = randn(E, D, scale=D ** -0.5).requires_grad_()
        self.w_gate_up = randn(E, 2 * I, D, scale=D ** -0.5).requires_grad_()  # gate rows, then up rows
        self.w_down = randn(E, D, I, scale=I ** -0.5).requires_grad_()
        self.d_out = randn(T, D)
        with torch.no_grad():
            self.top_experts, scores = route(self.x, self.router_w, k)
        self.router_weights = scores.detach().requires_grad_()  # float32 [T, k]
        self.sonic_w1 = None
        if with_sonic:
            if sonic_layout == "concat":
                self.sonic_w1_leaf = self.w_gate_up
            else:  # SonicMoE's default: gate row i at 2i, up row i at 2i+1
                w = torch.empty_like(self.w_gate_up, requires_grad=False)
                with torch.no_grad():
                    w[:, 0::2], w[:, 1::2] = self.w_gate_up[:, :I], self.w_gate_up[:, I:]
                self.sonic_w1_leaf = w.requires_grad_()
            # as sonicmoe.MoE passes its c_fc / c_proj weights: (2I, D, E) and (D, I, E) views
            self.sonic_w1, self.sonic_w2 = self.sonic_w1_leaf.permute(1, 2, 0), self.w_down.permute(1, 2, 0)
            # moe_general_routing_inputs: flat triples, token ids ascending
            self.token_idx = torch.arange(T, device=device, dtype=torch.int32).repeat_interleave(k)
            self.expert_idx = self.top_experts.reshape(-1).contiguous()
            self.scores_flat = self.router_weights.detach().reshape(-1).clone().requires_grad_()

    def leaves(self):
        out = [self.x, self.router_w, self.w_gate_up, self.w_down, self.router_weights]
        if self.sonic_w1 is not None:
            out += [self.sonic_w1_leaf, self.scores_flat]
        return out

    def zero_grads(self):
        for t in self.leaves():
            t.grad = None

    def sonic_grads(self) -> dict:
        """SonicMoE's gradients in megamoe's layouts."""
        d_w1 = self.sonic_w1_leaf.grad
        if d_w1 is not None and self.sonic_w1_leaf is not self.w_gate_up:
            d_w1 = torch.cat([d_w1[:, 0::2], d_w1[:, 1::2]], dim=1)  # back to gate rows, then up rows
        return {"x": self.x.grad, "router_weights": None if self.scores_flat.grad is None
                else self.scores_flat.grad.view(self.T, self.k), "w_gate_up": d_w1, "w_down": self.w_down.grad}


def route(x, router_w, k: int):
    """The router SonicMoE's MoE runs: logits ``x @ router_w.T`` in x's dtype, top-k, softmax over the top-k
    logits in FP32. Returns (int32 ids [T, k], float32 weights [T, k])."""
    logits = torch.nn.functional.linear(x, router_w)
    vals, ids = logits.topk(k, dim=-1)
    return ids.to(torch.int32), vals.float().softmax(dim=-1)


# ------------------------------------------------------------------------------------------------ the impls


def make_calls(names, p: Problem, world, sonic, T: int) -> dict:
    """{impl: (forward fn -> out, step fn)}: each forward is the training forward; each step is forward and
    backward(d_out) with the leaves' gradients dropped first. The first megamoe call of each runs its host checks
    (expert ids, the kernels' error words), later ones none (no host syncs)."""
    import megamoe

    calls = {}
    state = {"checked": set()}

    def mm(routing_fn):
        def fwd():
            key = routing_fn is None
            check = key not in state["checked"]
            state["checked"].add(key)
            if routing_fn is None:
                top, w = p.top_experts, p.router_weights
            else:
                top, w = routing_fn()
            return megamoe.moe(world, p.x, top, w, p.w_gate_up, p.w_down, (), max_tokens=T, check=check)
        return fwd

    def torch_router():
        return route(p.x, p.router_w, p.k)

    def sonic_general():
        return sonic.general(p.x, p.scores_flat, p.token_idx, p.expert_idx, p.sonic_w1, None, p.sonic_w2, None,
                             E=p.E, stream_id=current_stream_id(), activation_type=sonic.ActivationType.SWIGLU,
                             is_inference_mode_enabled=False, concat_layout=p.sonic_w1_leaf is p.w_gate_up)[0]

    def sonic_tc():
        out, _logits, freq = sonic.tc(p.x, p.router_w, p.sonic_w1, None, p.sonic_w2, None, K=p.k,
                                      stream_id=current_stream_id(), activation_type=sonic.ActivationType.SWIGLU,
                                      is_inference_mode_enabled=False, is_softmax_over_topk=True,
                                      norm_topk_probs=False, concat_layout=p.sonic_w1_leaf is p.w_gate_up)
        state["tc_freq"] = freq
        return out

    fwds = {"megamoe": mm(None), "megamoe-tc": mm(torch_router), "sonic": sonic_general, "sonic-tc": sonic_tc}
    for name in names:
        fwd = fwds[name]

        def step(fwd=fwd):
            p.zero_grads()
            fwd().backward(p.d_out)

        calls[name] = (fwd, step)
    calls["_state"] = state
    return calls


def current_stream_id() -> int:
    return torch.cuda.current_stream().cuda_stream


# ------------------------------------------------------------------------------------------------ checks


def check_shape(p: Problem, calls: dict, names) -> dict:
    """Every impl against the FP32 oracle at the BF16 bounds (the given-routing impls: output and gradients; the
    router impls: output, and how many routes their router picked differently from the routing fed to the
    others); sonic's output against megamoe's."""
    from megamoe.bench.accuracy import compare, error_stats
    from megamoe.reference.layer import moe_forward_backward

    want_out, want_grads = moe_forward_backward(p.x.detach(), p.top_experts, p.router_weights.detach(),
                                                p.w_gate_up.detach(), p.w_down.detach(), p.d_out)
    want = {"out": want_out, **{n: want_grads[n] for n in ("x", "router_weights", "w_gate_up", "w_down")}}
    result, outs = {}, {}
    for name in names:
        fwd, _ = calls[name]
        p.zero_grads()
        t0 = time.time()
        try:
            out = fwd()
            out.backward(p.d_out)
            if p.x.is_cuda:
                torch.cuda.synchronize()
        except Exception as exc:
            result[name] = {"correct": False, "failed": f"{type(exc).__name__}: {exc}",
                            "trace": traceback.format_exc()[-3000:]}
            print(f"  check {name}: FAILED to run: {type(exc).__name__}: {exc}", flush=True)
            continue
        first_call_s = time.time() - t0
        outs[name] = out.detach()
        if name in ("megamoe", "megamoe-tc"):
            got = {"out": out.detach(), "x": p.x.grad, "w_gate_up": p.w_gate_up.grad, "w_down": p.w_down.grad,
                   "router_weights": p.router_weights.grad if name == "megamoe" else None}
        elif name == "sonic":
            got = {"out": out.detach(), **p.sonic_grads()}
        else:  # sonic-tc: the routing scores are its own (not a leaf we hold)
            got = {"out": out.detach(), "x": None, "router_weights": None, "w_gate_up": None, "w_down": None}
        if name in ("megamoe-tc", "sonic-tc"):
            # their own router: the output, and the weight gradients where routing matched (x's gradient also
            # carries the router's backward, which the oracle does not have)
            got_c = {"out": got["out"]}
            if name == "megamoe-tc":
                got_c.update({"w_gate_up": got["w_gate_up"], "w_down": got["w_down"]})
            want_c = {n: want[n] for n in got_c}
        else:
            got_c, want_c = got, want
        r = compare(got_c, want_c, "bf16")
        r["compared"] = sorted(got_c)
        r["first_call_s"] = round(first_call_s, 2)
        if name == "sonic-tc" and "tc_freq" in calls["_state"]:
            freq = calls["_state"]["tc_freq"].long()
            ref = torch.bincount(p.top_experts.reshape(-1).long(), minlength=p.E)
            r["expert_counts_differ_by"] = int((freq - ref).abs().sum()) // 2
            if r["expert_counts_differ_by"] and not r["correct"]:
                # its top-k broke ties between equal BF16 logits otherwise: those tokens' rows differ from the
                # oracle's routing by design; the layer is judged on its relative L1 error alone
                r["correct"] = r["rel_err"] <= 1e-2
                r["note"] = "routing differs from the oracle's by ties: judged on rel err alone"
        result[name] = r
        extra = f", routes counted differently {r['expert_counts_differ_by']}" if "expert_counts_differ_by" in r \
            else ""
        print(f"  check {name}: {'ok' if r['correct'] else 'MISMATCH ' + str(r['failed'])} (rel err "
              f"{r['rel_err']:.2e}, worst row {r['row_err']:.2e}, worst {r['worst_tensor']}; first call "
              f"{first_call_s:.1f} s{extra})", flush=True)
    if "sonic" in outs and "megamoe" in outs:
        st = error_stats(outs["sonic"], outs["megamoe"])
        result["sonic_vs_megamoe_out"] = st
        print(f"  sonic vs megamoe output: rel {st['rel']:.2e}, worst row {st['row']:.2e}, max abs "
              f"{st['max_abs']:.3g}", flush=True)
    p.zero_grads()
    return result


# ------------------------------------------------------------------------------------------------ timing


def timed_ms(fn, seconds: float, group: int, cuda: bool) -> float:
    """ms per call of ``fn`` called back to back for ``seconds``: groups of ``group`` calls, each between two
    CUDA events (a sync after each group bounds the queue; the gaps between groups are not counted)."""
    total_ms, calls, start = 0.0, 0, time.time()
    while True:
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(group):
                fn()
            b.record()
            b.synchronize()
            total_ms += a.elapsed_time(b)
        else:
            t0 = time.perf_counter()
            for _ in range(group):
                fn()
            total_ms += (time.perf_counter() - t0) * 1e3
        calls += group
        if time.time() - start >= seconds:
            return total_ms / calls


def interleaved(calls: dict, names, rounds: int, seconds: float, group: int, cuda: bool) -> tuple[dict, dict]:
    """({impl: {"fwd": [ms per round], "step": [...]}} after one untimed round of everything, {impl: error} of the
    impls that raised: dropped from the rounds after)."""
    times, errors = {n: {"fwd": [], "step": []} for n in names}, {}
    for r in range(rounds + 1):
        for n in [n for n in names if n not in errors]:
            fwd, step = calls[n]
            for pass_name, fn in (("fwd", fwd), ("step", step)):
                try:
                    ms = timed_ms(fn, seconds, group, cuda)
                except Exception as exc:
                    errors[n] = f"{pass_name}: {type(exc).__name__}: {exc}"
                    print(f"  {n} {pass_name} raised, dropped: {errors[n]}", flush=True)
                    break
                if r:
                    times[n][pass_name].append(ms)
        if r:
            print(f"  round {r}/{rounds}: " + ", ".join(
                f"{n} {times[n]['fwd'][-1]:.3f}/{times[n]['step'][-1]:.3f} ms" for n in names if n not in errors),
                flush=True)
    return {n: t for n, t in times.items() if n not in errors}, errors


# ------------------------------------------------------------------------------------------------ main


def machine(device: str) -> dict:
    import triton

    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "triton": triton.__version__, "host": platform.node(), "commit": os.environ.get("MEGAMOE_COMMIT")}
    if device == "cuda":
        prop = torch.cuda.get_device_properties(0)
        info.update(gpu=prop.name, sms=prop.multi_processor_count, capability=f"{prop.major}.{prop.minor}")
    try:
        from megamoe.bench.machine import git_commit, nvidia_smi

        info["commit"], info["dirty"] = git_commit()
        if device == "cuda":
            info["nvidia_smi"] = nvidia_smi("name,driver_version,power.limit,clocks.max.sm")
    except Exception as exc:  # a record without them is still a record
        info["machine_info_error"] = f"{type(exc).__name__}: {exc}"
    return info


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    # one rank, its own process group (megamoe.launch's rank set-up, in this process)
    rendezvous = tempfile.mkdtemp(prefix="sonic-side-by-side-")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MEGAMOE_INIT_FILE=os.path.join(rendezvous, "rendezvous"))
    import megamoe
    from megamoe.config import MoEConfig

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda but no CUDA GPU is visible (use --device cpu --tiny for the smoke run)")
        return 2
    sonic, why, versions = import_sonic(args.device)
    names = [n for n in args.impls if sonic is not None or n not in SONIC_IMPLS]
    if sonic is None:
        print(f"SonicMoE not run: {why}", flush=True)
    else:
        tuned_off = sonic_tuning(args.sonic_tune == "on")
        print(f"SonicMoE {versions.get('sonicmoe.__version__')} from {versions.get('sonicmoe.__file__')} (quack "
              f"{versions.get('quack-kernels')}, cutlass-dsl {versions.get('nvidia-cutlass-dsl')}); autotuning "
              f"{args.sonic_tune}{f' ({tuned_off} tuners set to the default config)' if tuned_off else ''}",
              flush=True)
    world = megamoe.init_world(args.device)
    record = {"tool": "benchmarks/sonic_side_by_side.py", "argv": sys.argv[1:] if argv is None else list(argv),
              "machine": machine(args.device), "sonic": {"run": sonic is not None, "why_not": why, **versions},
              "impls": names, "rounds": args.rounds, "seconds": args.seconds, "sonic_tune": args.sonic_tune,
              "sonic_layout": args.sonic_layout, "published_h100_tflops_fwd_bwd": PUBLISHED_H100, "shapes": []}
    cuda = args.device == "cuda"
    device = world.device
    rows = []
    try:
        for shape in args.shapes:
            try:
                if shape == "tiny":
                    cfg = MoEConfig(hidden=TINY["hidden"], intermediate=TINY["intermediate"],
                                    num_experts=TINY["num_experts"], top_k=TINY["top_k"])
                    T = args.tokens or TINY["tokens"]
                else:
                    name, T = SHAPES[shape]
                    cfg = megamoe.preset(name)
                    T = args.tokens or T
                    cfg = MoEConfig(hidden=cfg.hidden, intermediate=cfg.intermediate, num_experts=cfg.num_experts,
                                    top_k=cfg.top_k)  # routed experts only, as SonicMoE's layer
                D, I, E, k = cfg.hidden, cfg.intermediate, cfg.num_experts, cfg.top_k
                fwd_flops = 6 * T * k * D * I
                print(f"{shape}: T {T}, D {D}, I {I}, E {E}, k {k} ({fwd_flops / 1e12:.2f} TFLOP forward)", flush=True)
                p = Problem(cfg, T, device, args.seed, args.sonic_layout, sonic is not None)
                calls = make_calls(names, p, world, sonic, T)
                entry = {"shape": shape, "T": T, "D": D, "I": I, "E": E, "k": k, "fwd_flops": fwd_flops,
                         "step_flops": 3 * fwd_flops, "bwd_flops": 2 * fwd_flops}
                if not args.skip_check:
                    entry["check"] = check_shape(p, calls, names)
                run = [n for n in names if "check" not in entry or "trace" not in entry["check"].get(n, {})]
                times, errors = interleaved(calls, run, args.rounds, args.seconds, args.group, cuda)
                entry["results"], entry["timing_errors"] = {}, errors
                for n in times:
                    f, s = statistics.median(times[n]["fwd"]), statistics.median(times[n]["step"])
                    b = s - f
                    res = {"fwd_ms": times[n]["fwd"], "step_ms": times[n]["step"], "fwd_ms_median": f,
                           "step_ms_median": s, "bwd_ms": b, "fwd_tflops": fwd_flops / f / 1e9,
                           "step_tflops": 3 * fwd_flops / s / 1e9,
                           "bwd_tflops": 2 * fwd_flops / b / 1e9 if b > 0 else None}
                    if "check" in entry:
                        res["correct"] = entry["check"].get(n, {}).get("correct")
                    entry["results"][n] = res
                    rows.append((shape, n, res))
                if cuda:
                    entry["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
                record["shapes"].append(entry)
                write_record(record, args.out)  # after every shape: a run stopped at its time limit keeps the rest
                if len(args.shapes) > 1:
                    print_table([r for r in rows if r[0] == shape], None)
                del p, calls
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
            except Exception as exc:  # one shape failing (out of memory, a kernel error) leaves the others
                print(f"{shape}: FAILED: {type(exc).__name__}: {exc}", flush=True)
                record["shapes"].append({"shape": shape, "error": f"{type(exc).__name__}: {exc}",
                                          "trace": traceback.format_exc()[-4000:]})
                write_record(record, args.out)
                p = calls = None
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        try:
            world.close()
            torch.distributed.destroy_process_group()
        except Exception:
            pass
        write_record(record, args.out)
    print_table(rows, sonic is None and why)
    print(f"wrote {args.out}")
    return 0


def write_record(record: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=str)


def print_table(rows, why_not) -> None:
    head = f"{'shape':<14} {'impl':<11} {'fwd ms':>9} {'fwd+bwd ms':>11} {'bwd ms':>9} {'fwd TF/s':>9} " \
           f"{'f+b TF/s':>9} {'bwd TF/s':>9} {'check':>6}"
    print()
    print(head)
    print("-" * len(head))
    for shape, n, r in rows:
        ok = {True: "ok", False: "FAIL", None: "-"}[r.get("correct")]
        bwd_tf = f"{r['bwd_tflops']:.0f}" if r["bwd_tflops"] else "-"
        print(f"{shape:<14} {n:<11} {r['fwd_ms_median']:>9.3f} {r['step_ms_median']:>11.3f} {r['bwd_ms']:>9.3f} "
              f"{r['fwd_tflops']:>9.0f} {r['step_tflops']:>9.0f} {bwd_tf:>9} {ok:>6}")
    shown = sorted({s for s, _, _ in rows} & set(PUBLISHED_H100))
    for s in shown:
        f, b = PUBLISHED_H100[s]
        print(f"{s:<14} {'published':<11} (SonicMoE's H100 figure: fwd ~{f}, bwd ~{b} TFLOP/s)")
    if why_not:
        print(f"SonicMoE not run: {why_not}")


if __name__ == "__main__":
    sys.exit(main())
