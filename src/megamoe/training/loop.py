"""The training loop of `megamoe train`: AdamW on every rank, data parallel over the expert-parallel world.

Each rank's loss is the mean over its own tokens. After the backward (:func:`reduce_gradients`):

- replicated parameters (everything but the routed experts) hold this rank's gradient: all-reduce over the
  world and divide by its size, the mean over ranks;
- the routed experts' ``gate_up_proj`` / ``down_proj`` already hold the sum over ranks of every rank's loss
  gradient (their tokens came to this rank's experts): divide by the world size only.

So every parameter steps on the gradient of the mean loss over all ranks' tokens, as one process training on
the whole batch would.
"""

from __future__ import annotations

import importlib.util
import math
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from megamoe.megakernel.replay import graph_counts
from megamoe.training.data import MarkovTokens
from megamoe.training.memory import check_fits
from megamoe.training.model import build_model, get_preset

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class TrainOptions:
    """One `megamoe train` run: every impl in ``impls`` trains the preset from the same weights and data."""

    preset: str = "cpu"
    impls: tuple[str, ...] = ("megamoe", "reference")
    steps: int | None = None  # None: the preset's (set on construction, as lr)
    ranks: int = 2
    device: str = "cpu"
    seed: int = 0
    lr: float | None = None
    check_memory: bool = True  # refuse a run whose estimated memory exceeds the device's (training.memory)

    def __post_init__(self) -> None:
        from megamoe.nn.moe import IMPLS, check_impl  # the kernels load here, after the Triton mode is chosen

        model = get_preset(self.preset)
        if not self.impls:
            raise ValueError(f"impls must name at least one of {', '.join(IMPLS)}")
        for impl in self.impls:
            check_impl(impl, "bf16")
        if len(set(self.impls)) != len(self.impls):
            raise ValueError(f"impls must not repeat, got {', '.join(self.impls)}")
        if self.steps is None:
            object.__setattr__(self, "steps", model.steps)  # frozen: set once, here
        if self.lr is None:
            object.__setattr__(self, "lr", model.lr)
        for name in ("steps", "ranks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if model.num_experts % self.ranks:
            raise ValueError(f"preset {self.preset}'s {model.num_experts} experts do not split over {self.ranks} "
                             f"ranks: ranks must divide them")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda: no CUDA GPU is visible; use device cpu")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")


def _sync(world) -> None:
    if world.is_cuda:
        torch.cuda.synchronize(world.device)


class MoETimer:
    """Seconds spent in the experts modules' forward and backward (module hooks; the device synchronised at
    each edge on CUDA, where kernels run asynchronously). The backward span runs from the module's output
    gradient to its input gradients: weight-gradient work autograd schedules after that falls in the rest."""

    def __init__(self, modules: list[torch.nn.Module], world):
        self.world, self.seconds, self._started, self._handles = world, 0.0, {}, []
        for m in modules:
            self._handles += [
                m.register_forward_pre_hook(lambda mod, args: self._start(mod)),
                m.register_forward_hook(lambda mod, args, out: self._stop(mod)),
                m.register_full_backward_pre_hook(lambda mod, grad_out: self._start(mod)),
                m.register_full_backward_hook(lambda mod, grad_in, grad_out: self._stop(mod)),
            ]

    def _start(self, module) -> None:
        _sync(self.world)
        self._started[id(module)] = time.perf_counter()

    def _stop(self, module) -> None:
        _sync(self.world)
        self.seconds += time.perf_counter() - self._started.pop(id(module))

    def take(self) -> float:
        """The seconds counted since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def expert_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """This rank's routed experts: the ``gate_up_proj`` / ``down_proj`` of every patched experts module."""
    from megamoe.adapters.hf import ExpertParallelExperts

    return [p for m in model.modules() if isinstance(m, ExpertParallelExperts)
            for p in (m.gate_up_proj, m.down_proj)]


def reduce_gradients(model: torch.nn.Module, world) -> None:
    """Make every gradient the mean over ranks of each rank's loss gradient (see the module's docstring)."""
    experts = {id(p) for p in expert_parameters(model)}
    replicated = [p for p in model.parameters() if p.requires_grad and id(p) not in experts]
    for p in replicated:  # every rank reduces the same tensors, used or not
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if replicated:  # one all-reduce of them all, not one per tensor
        flat = torch.cat([p.grad.reshape(-1) for p in replicated])
        dist.all_reduce(flat, group=world.group)
        flat /= world.size
        for p, part in zip(replicated, flat.split([p.numel() for p in replicated])):
            p.grad.copy_(part.view_as(p.grad))
    for p in expert_parameters(model):
        if p.grad is not None:
            p.grad /= world.size


def _squared_norm(params: list[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
    """The sum of the gradients' squared L2 norms, on ``device`` (each norm in place: no copy of a gradient)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is not None:
            total += torch.linalg.vector_norm(p.grad.detach()).double() ** 2
    return total


def train_rank(world, options: TrainOptions, impl: str,
               reduce: Callable[[torch.nn.Module, object], None] = reduce_gradients) -> dict:
    """One rank's run of ``impl`` (launched on every rank): per step the loss and gradient norms (the same on
    every rank) and this rank's step and MoE times; the peak memory."""
    from megamoe.adapters.hf import ExpertParallelExperts

    preset = get_preset(options.preset)
    model = build_model(preset, world, impl, options.seed)
    # fused on GPUs: one kernel for all parameters, no per-tensor temporaries beside billions of expert weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr, fused=world.is_cuda)
    data = MarkovTokens(preset.vocab, options.seed)
    experts = expert_parameters(model)
    expert_ids = {id(p) for p in experts}
    replicated = [p for p in model.parameters() if id(p) not in expert_ids]
    timer = MoETimer([m for m in model.modules() if isinstance(m, ExpertParallelExperts)], world)
    if world.is_cuda:
        torch.cuda.reset_peak_memory_stats(world.device)
    out = {"losses": [], "grad_norms": [], "expert_grad_norms": [], "step_ms": [], "moe_ms": []}
    for step in range(options.steps):
        ids = data.batch(step, world.rank, preset.batch, preset.sequence).to(world.device)
        _sync(world)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss  # the mean over this rank's predicted tokens
        loss.backward()
        reduce(model, world)
        optimizer.step()
        _sync(world)
        out["step_ms"].append((time.perf_counter() - start) * 1e3)
        out["moe_ms"].append(timer.take() * 1e3)
        world.check_errors()  # what a megakernel recorded this step (an expert id out of range, a timed-out wait)
        # after the step, untimed: the reported loss is the mean over ranks; the experts' squared norm sums the
        # ranks' slices; the replicated gradients are the same on every rank
        summed = torch.stack([loss.detach().double(), _squared_norm(experts, world.device)])
        dist.all_reduce(summed, group=world.group)
        loss_sum, expert_sq = summed.tolist()
        out["losses"].append(loss_sum / world.size)
        out["expert_grad_norms"].append(math.sqrt(expert_sq))
        out["grad_norms"].append(math.sqrt(expert_sq + _squared_norm(replicated, world.device).item()))
    timer.remove()
    out["graphs"] = graph_counts(world)
    if world.is_cuda:
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated(world.device)
    else:  # Linux reports kilobytes: the whole process's peak, the interpreter and the libraries included
        out["peak_memory_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _steady(values: list[float]) -> float:
    """The median over the steps after the first (which builds kernels and workspaces), or the only one."""
    return statistics.median(values[1:] if len(values) > 1 else values)


def summarise(per_rank: list[dict], tokens_per_rank: int) -> dict:
    """One impl's record from its ranks' results: the losses and norms, per-step times averaged over the ranks
    (the collectives keep them in step), their steady medians, tokens/s per rank, the largest peak memory."""
    steps = len(per_rank[0]["losses"])
    step_ms = [statistics.fmean(r["step_ms"][s] for r in per_rank) for s in range(steps)]
    moe_ms = [statistics.fmean(r["moe_ms"][s] for r in per_rank) for s in range(steps)]
    return {
        "losses": per_rank[0]["losses"],
        "grad_norms": per_rank[0]["grad_norms"],
        "expert_grad_norms": per_rank[0]["expert_grad_norms"],
        "step_ms": step_ms,
        "moe_ms": moe_ms,
        "final_loss": per_rank[0]["losses"][-1],
        "step_ms_median": _steady(step_ms),
        "moe_ms_median": _steady(moe_ms),
        "rest_ms_median": _steady([s - m for s, m in zip(step_ms, moe_ms)]),
        "tokens_per_s_per_gpu": tokens_per_rank / (_steady(step_ms) / 1e3),
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in per_rank),
        "peak_memory_per_rank_bytes": [r["peak_memory_bytes"] for r in per_rank],
        "graphs": per_rank[0]["graphs"],  # rank 0's megakernel CUDA graphs: replays against captures
    }


def train(options: TrainOptions, log: Callable[[str], None] | None = None) -> dict:
    """Train every impl of ``options`` in turn (each on freshly started ranks: its own peak memory); returns the
    run's record: the preset, world size, device, and per impl its losses, gradient norms, timings, memory.
    ImportError without transformers; ValueError, before any rank starts, when the preset's estimated memory
    exceeds the device's (``options.check_memory``, :func:`megamoe.training.memory.check_fits`)."""
    from megamoe.parallel.world import launch

    if importlib.util.find_spec("transformers") is None:  # said here, not as a traceback from every rank
        raise ImportError("megamoe train builds a transformers model, and transformers is not installed: pip "
                          "install -e '.[hf]' (or pip install 'transformers>=5.17')")
    preset = get_preset(options.preset)
    if options.check_memory:  # before any rank starts: a preset too big for the device is refused, not tried
        check_fits(preset, options.ranks, options.device)
    runs = {}
    for impl in options.impls:
        if log is not None:
            log(f"training {impl}: {options.steps} steps on {options.ranks} {options.device} rank(s)")
        per_rank = launch(train_rank, options.ranks, options, impl, device=options.device)
        runs[impl] = summarise(per_rank, preset.tokens_per_rank)
    device_name = torch.cuda.get_device_name(0) if options.device == "cuda" else "cpu"
    return {
        "preset": asdict(preset),
        "impls": list(options.impls),
        "steps": options.steps,
        "world_size": options.ranks,
        "device": options.device,
        "device_name": device_name,
        "seed": options.seed,
        "lr": options.lr,
        "tokens_per_rank_per_step": preset.tokens_per_rank,
        "peak_memory": ("torch.cuda.max_memory_allocated during training, largest rank" if options.device == "cuda"
                        else "max RSS of the rank's process (interpreter and libraries included), largest rank"),
        "runs": runs,
    }
