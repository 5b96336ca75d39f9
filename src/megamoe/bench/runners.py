"""The implementations `megamoe bench` times, each behind one runner (forward, backward, step), and a pass timed
on every rank together (:func:`timed_pass`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial

import torch

from megamoe.autograd import moe
from megamoe.baselines import deepep_torch
from megamoe.baselines.fp8_grouped import quantize_expert_weights
from megamoe.baselines.nccl_torch import nccl_torch_moe
from megamoe.bench.problem import RankProblem
from megamoe.megakernel import default_config, megamoe_forward
from megamoe.ops.expert_weights import quantize_experts
from megamoe.parallel.world import EPWorld
from megamoe.planner import LayerShape
from megamoe.reference.ep import ep_reference_forward_backward


def timed_pass(world: EPWorld, fn) -> tuple[float, object]:
    """Milliseconds of ``fn()`` on this rank, started together with the other ranks."""
    world.barrier("a timed pass's start")
    if world.is_cuda:
        torch.cuda.synchronize(world.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end), result
    t0 = time.perf_counter()
    result = fn()
    return (time.perf_counter() - t0) * 1e3, result


class _AutogradRunner:
    """An implementation that is a differentiable function of the problem's tensors."""

    def __init__(self, world: EPWorld, p: RankProblem, fn):
        self.world, self.p, self.fn = world, p, fn
        self.leaves = {
            "x": p.x.detach().clone().requires_grad_(),
            "router_weights": p.router_weights.detach().clone().requires_grad_(),
            "w_gate_up": p.w_gate_up.detach().requires_grad_(),
            "w_down": p.w_down.detach().requires_grad_(),
        }
        for name in ("b_gate_up", "b_down"):  # the experts' biases, where the layer has them
            if getattr(p, name) is not None:
                self.leaves[name] = getattr(p, name).detach().requires_grad_()
        self.shared = [(a.detach().requires_grad_(), b.detach().requires_grad_()) for a, b in p.shared]

    def forward(self) -> torch.Tensor:
        for t in self._all_leaves():
            t.grad = None
        lv = self.leaves
        biases = {name: lv[name] for name in ("b_gate_up", "b_down") if name in lv}
        return self.fn(
            self.world, lv["x"], self.p.top_experts, lv["router_weights"], lv["w_gate_up"], lv["w_down"],
            self.shared, self.p.config.activation, **biases,
        )

    def backward(self, out: torch.Tensor) -> dict:
        out.backward(self.p.d_out)
        grads = {name: t.grad for name, t in self.leaves.items()}
        grads["shared"] = [(a.grad, b.grad) for a, b in self.shared]
        return grads

    def train_forward(self) -> torch.Tensor:
        """The forward a backward follows (the fwd pass may time a cheaper one that keeps nothing)."""
        return self.forward()

    def step(self) -> dict:
        """Forward and backward: the gradients."""
        return self.backward(self.train_forward())

    def _all_leaves(self):
        yield from self.leaves.values()
        for pair in self.shared:
            yield from pair


class _ReferenceRunner:
    """The oracle itself. Its bwd time is (forward + backward) minus the forward."""

    def __init__(self, world: EPWorld, p: RankProblem):
        self.world, self.p = world, p

    def forward(self) -> torch.Tensor:
        return ep_reference_forward_backward(self.world, self.p, with_grads=False)[0]

    def backward(self, out: torch.Tensor) -> dict:
        return ep_reference_forward_backward(self.world, self.p)[1]

    def train_forward(self) -> torch.Tensor:
        return self.forward()

    def step(self) -> dict:
        return ep_reference_forward_backward(self.world, self.p)[1]


class _ForwardOnlyRunner(_AutogradRunner):
    """An implementation without a backward yet: only its fwd pass is checked and timed."""

    passes = ("fwd",)

    def forward(self) -> torch.Tensor:
        with torch.no_grad():
            return super().forward()


class _MegamoeRunner(_ForwardOnlyRunner):
    """megamoe without host syncs in timed passes: the group's largest N is found once, and the host checks
    (expert ids, the kernels' error words) run on the first pass of each kind (the one compared). fwd times
    ``megamoe_forward`` (nothing kept), bwd and step ``megamoe.moe`` (in the same expert format)."""

    def __init__(self, world: EPWorld, p: RankProblem, experts: str = "bf16", backward: bool = True):
        super().__init__(world, p, megamoe_forward)
        self.experts = experts
        self.passes = ("fwd", "bwd", "step")
        self.max_tokens, self.passes_run, self.trained = world.largest(p.tokens), 0, 0
        # FP8 experts: the weights are quantised once (with the backward's transposes when a backward is timed:
        # they are as large again, and kimi-k2's all on one GPU ran a forward-only bench out of memory), as after
        # a training step's optimizer step, and that quantisation is timed on its own (the second call: the first
        # compiles) and recorded beside the pass; forward and backward read the pack, as under megamoe.MoE
        self.experts_q, self.weights_quantize_ms = None, None
        if experts != "bf16":
            quantize = partial(quantize_experts, self.leaves["w_gate_up"], self.leaves["w_down"], experts,
                               backward=backward)
            for _ in range(2):
                self.experts_q = None  # freed first: the second call reuses its memory, as a training step would
                self.weights_quantize_ms, self.experts_q = timed_pass(world, quantize)

    def _pass(self, check: bool):
        return partial(megamoe_forward, max_tokens=self.max_tokens, check=check, precision=self.experts,
                       experts_q=self.experts_q)

    def forward(self) -> torch.Tensor:
        self.fn = self._pass(check=self.passes_run == 0)
        self.passes_run += 1
        return super().forward()

    def train_forward(self) -> torch.Tensor:
        self.fn = partial(moe, max_tokens=self.max_tokens, check=self.trained == 0, precision=self.experts,
                          experts_q=self.experts_q)
        self.trained += 1
        return _AutogradRunner.forward(self)


class _UnfusedRunner(_MegamoeRunner):
    """`unfused`: megamoe's own steps without overlap, the no-overlap ablation. The forward's pulls, gate/up,
    down and pushes run one launch after another, ordered on the device (``KernelConfig.overlap`` off: no host
    barrier between them, each compute step on every SM); the backward is megamoe's (its composed kernels)."""

    def __init__(self, world: EPWorld, p: RankProblem, experts: str = "bf16", backward: bool = True):
        super().__init__(world, p, experts, backward)
        shape = LayerShape.of(p.config, world.size, self.max_tokens)
        self.config = replace(default_config(world, shape, experts), overlap=False)

    def _pass(self, check: bool):
        return partial(super()._pass(check), config=self.config)

    def train_forward(self) -> torch.Tensor:
        self.fn = partial(moe, max_tokens=self.max_tokens, check=self.trained == 0, config=self.config,
                          precision=self.experts, experts_q=self.experts_q)
        self.trained += 1
        return _AutogradRunner.forward(self)


class _MegamoeGraphRunner(_MegamoeRunner):
    """megamoe with the pass captured in a CUDA graph once (after a checked eager pass) and replayed:
    what a training step that graphs its layers pays. The graph reads the problem's tensors in place."""

    def __init__(self, world: EPWorld, p: RankProblem, experts: str = "bf16", backward: bool = False):
        super().__init__(world, p, experts, backward=False)  # forward only
        self.passes = ("fwd",)
        self.graph, self.static_out = None, None

    def forward(self) -> torch.Tensor:
        if self.passes_run == 0 or not self.world.is_cuda:
            return super().forward()
        if self.graph is None:
            self.passes_run += 1
            self.fn = self._pass(check=False)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.static_out = _ForwardOnlyRunner.forward(self)
        self.graph.replay()
        return self.static_out


class _FP8PeerRunner(_ForwardOnlyRunner):
    """A peer with its own FP8 experts (row-wise E4M3 through torch._scaled_grouped_mm), forward only: the
    weights quantised once, as after an optimizer step, that quantisation timed on its own."""

    def __init__(self, world: EPWorld, p: RankProblem, fn):
        super().__init__(world, p, fn)
        quantize = partial(quantize_expert_weights, self.leaves["w_gate_up"], self.leaves["w_down"])
        self.weights_quantize_ms, experts = timed_pass(world, quantize)
        self.fn = partial(fn, experts_fp8=experts)


RUNNERS = {
    "reference": _ReferenceRunner,
    "nccl-torch": lambda world, p: _AutogradRunner(world, p, nccl_torch_moe),
    "deepep-torch": lambda world, p: _AutogradRunner(world, p, deepep_torch.deepep_torch_moe),
    "unfused": _UnfusedRunner,
    "megamoe": _MegamoeRunner,
    "megamoe-graph": _MegamoeGraphRunner,
}
#: The implementations that take the routed-expert format (BenchOptions.experts).
TAKES_EXPERT_FORMAT = ("megamoe", "megamoe-graph", "unfused")
#: The peers with FP8 experts of their own: run with them too when BenchOptions.experts names an FP8 format.
FP8_PEERS = {"nccl-torch": nccl_torch_moe, "deepep-torch": deepep_torch.deepep_torch_moe}
PEER_FP8 = "fp8-rowwise"
