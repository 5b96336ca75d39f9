"""`megamoe.MoE` and `megamoe.MoEBlock`: the layer as modules holding their weights.

``MoE`` holds this rank's routed experts (``w_gate_up [L, 2I, D]``, ``w_down [L, D, I]``, bf16) and the shared
experts (replicated) as Parameters and runs :func:`megamoe.moe`. ``MoEBlock`` is a :class:`~megamoe.nn.router.Router`
and a ``MoE``: ``forward(x)`` routes and runs the layer.

Init (``seed``): expert e's weights come from a generator seeded by (seed, e) alone, whatever rank holds it, and
the shared experts' from (seed, s): any EP size builds the same model. ``w_gate_up ~ N(0, 1/D)``,
``w_down ~ N(0, 1/I)``.

Gradients: the routed experts' cover every rank's tokens routed to them (complete); the shared experts' and the
router's cover this rank's tokens only — reduce them across the ranks (all-reduce, or FSDP / DDP over the data
dimension) as for any replicated weight.
"""

from __future__ import annotations

import torch
from torch import nn

from megamoe.autograd import moe
from megamoe.baselines import deepep_torch
from megamoe.baselines.nccl_torch import nccl_torch_moe
from megamoe.config import MoEConfig
from megamoe.inputs import MoEInputs
from megamoe.nn.router import Router
from megamoe.ops.expert_weights import PackCache
from megamoe.parallel.world import EPWorld
from megamoe.planner import KernelConfig
from megamoe.precision import check_precision
from megamoe.reference.ep import ep_moe

#: The implementations a MoE can run: the megakernel, the pure-PyTorch reference over the EP group (FP32 math,
#: autograd), the NCCL all-to-all + torch._grouped_mm baseline and DeepEP's dispatch / combine + the same experts
#: (where DeepEP is built: benchmarks/deepep/build.sh).
IMPLS = ("megamoe", "reference", "nccl-torch", "deepep-torch")


def check_impl(impl: str, precision: str) -> None:
    """ValueError unless ``impl`` is one of :data:`IMPLS`, runs ``precision`` and can run here."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl != "megamoe" and precision != "bf16":
        raise ValueError(f"impl {impl!r} runs bf16 experts only, got precision {precision!r}")
    if impl == "deepep-torch" and (reason := deepep_torch.unavailable()) is not None:
        raise ValueError(f"impl deepep-torch: {reason}")


def run_impl(impl: str, world: EPWorld, inputs: MoEInputs, *, precision: str = "bf16",
             config: KernelConfig | None = None, max_tokens: int | None = None, check_finite: bool = False,
             weights: PackCache | None = None) -> torch.Tensor:
    """The layer's ``inputs`` over ``world`` through ``impl`` (every implementation takes them all, the expert
    biases included); the keywords reach the megakernel only (the others are BF16 and ignore the kernel's knobs).
    ``weights``: the caller's cache of the FP8 weight pack (made once per optimizer step for the forward and the
    backward)."""
    if impl == "reference":
        return ep_moe(world, inputs)
    if impl == "nccl-torch":
        return nccl_torch_moe(world, inputs)
    if impl == "deepep-torch":
        return deepep_torch.deepep_torch_moe(world, inputs)
    experts_q = None
    if weights is not None and precision != "bf16" and not torch.compiler.is_compiling():
        w_gate_up, w_down = inputs.w_gate_up, inputs.w_down
        backward = torch.is_grad_enabled() and (w_gate_up.requires_grad or w_down.requires_grad)
        experts_q = weights.get(w_gate_up, w_down, precision, backward=backward)
    return moe(world, inputs, precision=precision, config=config, max_tokens=max_tokens, check_finite=check_finite,
               experts_q=experts_q)


def _normal(shape: tuple[int, ...], std: float, seed: int, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=device) * std).to(torch.bfloat16)


class MoE(nn.Module):
    """This rank's share of one MoE layer (collective: every rank of ``world`` builds one alike).

    Args:
        config: the layer's shape (E, k, D, I, shared sizes) and its experts' activation.
        world: the expert-parallel group; this rank holds experts ``rank*L .. rank*L+L-1``.
        precision: the routed experts' precision (bf16, fp8-block, mxfp8: every one trains).
        device: where the weights live (default: the world's device).
        max_tokens: the group's largest token count per rank; None finds it every call (an all-reduce, a host
            sync; ``torch.compile`` needs it given).
        kernel_config: the megakernel's knobs (default: the planner's).
        seed: the weights' init seed (see the module docstring).
        impl: ``megamoe`` (default), ``reference``, ``nccl-torch`` or ``deepep-torch`` (:data:`IMPLS`): the same
            weights through another implementation, for comparisons (the others are BF16 and ignore the kernel's
            knobs).
        check_finite: every forward raises ValueError naming the first token whose x or router weights are not
            finite (a host sync; megamoe only).
        expert_bias: the routed experts have biases (gpt-oss): Parameters ``b_gate_up [L, 2I]`` and ``b_down
            [L, D]``, bf16, zero at init (every implementation takes them); None (the default) takes
            ``config.expert_bias``. Without, both are None.

    FP8 precisions keep the routed weights quantised (:class:`~megamoe.ops.expert_weights.PackCache`): made at
    the first forward after each optimizer step (the weights' in-place version tells), read by every forward
    and backward until the next, transposes for the dgrads included while training — about the routed BF16
    weights' bytes again, held until the pack is replaced. Under ``torch.compile`` every call quantises instead.

    ``forward(x [N, D] bf16, top_experts int [N, k], router_weights float32 [N, k])`` returns bf16 `[N, D]`.
    """

    def __init__(self, config: MoEConfig, world: EPWorld, *, precision: str = "bf16",
                 device: torch.device | str | None = None, max_tokens: int | None = None,
                 kernel_config: KernelConfig | None = None, seed: int = 0, impl: str = "megamoe",
                 check_finite: bool = False, expert_bias: bool | None = None):
        super().__init__()
        check_impl(impl, precision)
        if not isinstance(config, MoEConfig):
            raise ValueError(f"config must be a MoEConfig, got {type(config).__name__}")
        check_precision(precision)
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 0):
            raise ValueError(f"max_tokens must be None or an int >= 0, got {max_tokens!r}")
        self.config, self.world, self.precision, self.impl = config, world, precision, impl
        self.max_tokens, self.kernel_config, self.check_finite = max_tokens, kernel_config, bool(check_finite)
        L = config.experts_per_rank(world.size)
        device = torch.device(device) if device is not None else world.device
        D, I = config.hidden, config.intermediate
        first = world.rank * L
        self.w_gate_up = nn.Parameter(torch.stack(
            [_normal((2 * I, D), D ** -0.5, seed * 1_000_003 + first + l, device) for l in range(L)]))
        self.w_down = nn.Parameter(torch.stack(
            [_normal((D, I), I ** -0.5, seed * 1_000_003 + 500_000 + first + l, device) for l in range(L)]))
        self.shared_gate_up = nn.ParameterList(
            [nn.Parameter(_normal((2 * size, D), D ** -0.5, seed * 7919 + 2 * s + 1, device))
             for s, size in enumerate(config.shared)])
        self.shared_down = nn.ParameterList(
            [nn.Parameter(_normal((D, size), size ** -0.5, seed * 7919 + 2 * s + 2, device))
             for s, size in enumerate(config.shared)])
        bf16 = dict(dtype=torch.bfloat16, device=device)
        expert_bias = config.expert_bias if expert_bias is None else expert_bias
        self.b_gate_up = nn.Parameter(torch.zeros(L, 2 * I, **bf16)) if expert_bias else None
        self.b_down = nn.Parameter(torch.zeros(L, D, **bf16)) if expert_bias else None
        self.weights_q = PackCache()  # FP8: the step's weight pack
        self.register_load_state_dict_post_hook(PackCache.after_load)

    def forward(self, x: torch.Tensor, top_experts: torch.Tensor, router_weights: torch.Tensor) -> torch.Tensor:
        inputs = MoEInputs(x, top_experts, router_weights, self.w_gate_up, self.w_down,
                           list(zip(self.shared_gate_up, self.shared_down)), self.config.activation,
                           self.b_gate_up, self.b_down)
        return run_impl(self.impl, self.world, inputs, precision=self.precision, config=self.kernel_config,
                        max_tokens=self.max_tokens, check_finite=self.check_finite, weights=self.weights_q)

    def extra_repr(self) -> str:
        c = self.config
        return (f"E={c.num_experts}, k={c.top_k}, D={c.hidden}, I={c.intermediate}, shared={c.shared}, "
                f"rank {self.world.rank} of {self.world.size}, precision={self.precision}, impl={self.impl}")


class MoEBlock(nn.Module):
    """A :class:`Router` and a :class:`MoE`: ``forward(x [N, D])`` routes every token and runs the layer.

    Keyword arguments go to the MoE, except the router's (``score``, ``renormalize``, ``scale``,
    ``selection_bias``). x may be any float dtype: the layer runs in bf16 and the output comes back in x's dtype.
    """

    def __init__(self, config: MoEConfig, world: EPWorld, *, score: str = "softmax", renormalize: bool = True,
                 scale: float = 1.0, selection_bias: bool = False, device: torch.device | str | None = None,
                 **moe_kwargs):
        super().__init__()
        device = torch.device(device) if device is not None else world.device
        self.router = Router(config.hidden, config.num_experts, config.top_k, score=score, renormalize=renormalize,
                             scale=scale, selection_bias=selection_bias, device=device)
        self.moe = MoE(config, world, device=device, **moe_kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_experts, router_weights = self.router(x)
        return self.moe(x.to(torch.bfloat16), top_experts, router_weights).to(x.dtype)
