"""`impl=megamoe`: the MoE layer's forward over an expert-parallel world, one megakernel pass per call.

:func:`megamoe_forward` validates the layer's arguments, keeps one
:class:`~megamoe.megakernel.kernel.MegaKernel` per layer shape on the world and
runs its pass; several shared experts run as one (:func:`fuse_shared`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megamoe import checks
from megamoe.config import SWIGLU, Activation
from megamoe.inputs import MoEInputs, gather_inputs
from megamoe.parallel.world import EPWorld
from megamoe.megakernel.kernel import MegaKernel
from megamoe.ops.expert_weights import QuantizedExperts
from megamoe.planner import KernelConfig, LayerShape
from megamoe.planner.tuning import Tuning
from megamoe.precision import check_precision


def fuse_shared(shared: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One (w_gate_up [2*sum Is, D], w_down [D, sum Is]) FFN equal to the sum of the shared experts."""
    if not shared:
        return None
    if len(shared) == 1:
        return shared[0][0].contiguous(), shared[0][1].contiguous()
    gates = [gu[: gu.shape[0] // 2] for gu, _ in shared]
    ups = [gu[gu.shape[0] // 2:] for gu, _ in shared]
    return torch.cat(gates + ups).contiguous(), torch.cat([dn for _, dn in shared], dim=1).contiguous()


def megamoe_forward(
    world: EPWorld,
    x: torch.Tensor | MoEInputs,
    top_experts: torch.Tensor | None = None,
    router_weights: torch.Tensor | None = None,
    w_gate_up: torch.Tensor | None = None,
    w_down: torch.Tensor | None = None,
    shared: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    activation: Activation = SWIGLU,
    *,
    config: KernelConfig | None = None,
    precision: str = "bf16",
    max_tokens: int | None = None,
    experts_q: QuantizedExperts | None = None,
    check: bool = True,
    check_finite: bool = False,
    num_experts: int | None = None,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    tuning: Tuning | None = None,
) -> torch.Tensor:
    """The MoE layer's forward over ``world`` as one megakernel per pass, without autograd (``megamoe.moe`` trains).

    Args:
        world: the EP group (R ranks); collective: every rank calls it.
        x, top_experts, router_weights, w_gate_up, w_down, shared, activation, b_gate_up, b_down: the layer's
            inputs (:class:`megamoe.MoEInputs`, every tensor bfloat16 but the ids and router weights), one by one
            or as one ``MoEInputs`` in place of ``x``.
        config: the kernel's knobs (default: ``megamoe plan``'s for this shape and device).
        precision: ``bf16``, ``mxfp8`` or ``fp8-block`` (routed experts; each rank quantises its tokens
            once while staging them, weights as ``experts_q`` says; the shared expert stays BF16).
        max_tokens: the group's largest token count (default: found with an all-reduce MAX, a host sync).
        experts_q: FP8 precisions: ``quantize_experts(w_gate_up, w_down, precision)``, made once per optimizer
            step and passed to every forward until then (ValueError if the weights changed in place since,
            as their version counter tells: writes through ``.data`` are not seen); None quantises the
            weights inside every pass (a pass over all of them).
        check: validate the expert ids and read the kernel's error word after the pass (host syncs).
            With ``max_tokens`` given and ``check=False`` the pass never waits for the GPU.
        check_finite: raise ValueError naming the first token whose x or router weights are not finite (a host
            sync). Without it such a token's output row is non-finite, as in the reference.
        num_experts: E over all ranks, when the caller knows it: ValueError unless the ranks' weights hold E
            between them.
        tuning: overrides of the planner's tuning rules (:class:`~megamoe.planner.tuning.Tuning`: the routed
            tiles, the ring depth, the communication copy tile), for experiments; None: the planner's.

    Returns bf16 `[N, D]`. Raises ValueError on bad inputs or configs, RuntimeError when a wait timed out.
    The kernel of each shape is kept on the world (``world.resources``; ``world.close()`` frees it), one
    config and precision at a time. Nothing of a pass is kept for a backward (its layer buffers are the
    kernel's scratch set, rewritten by the next call): training goes through ``MegaKernel.forward`` with a
    layer's own buffers. On a GPU each pass's device work replays from a CUDA graph once the same weights and
    token count come back (one graph per set of weights: each MoE layer of a model gets its own). For
    CUDA-graph capture of whole passes use :class:`MegaKernel` directly with ``check=False``.
    """
    check_precision(precision)
    inputs = gather_inputs(x, top_experts, router_weights, w_gate_up, w_down, shared, activation, b_gate_up, b_down)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs.tensors()):
        raise ValueError("megamoe_forward computes no gradients, and an input or weight here requires grad: use "
                         "megamoe.moe (or megamoe.MoE) to train, or call this under torch.no_grad()")
    with torch.no_grad():
        return _forward(world, inputs, config, precision, max_tokens, experts_q, check, check_finite, num_experts,
                        tuning)


def _forward(world, inputs: MoEInputs, config, precision, max_tokens, experts_q, check, check_finite,
             num_experts, tuning) -> torch.Tensor:
    dims = inputs.validate(dtypes="bf16", world=world, num_experts=num_experts, check_ids=check, finite=check_finite)
    n = dims.tokens
    if max_tokens is None:
        max_tokens = world.largest(n)  # NOTE: host sync
    checks.check_max_tokens(max_tokens, n)
    i = inputs
    fused = fuse_shared([(gu.detach(), dn.detach()) for gu, dn in i.shared])
    shape = LayerShape(world.size, max_tokens, dims.hidden, dims.intermediate, dims.experts, dims.top_k,
                       0 if fused is None else fused[1].shape[1])
    kernel = layer_kernel(world, shape, config, precision, tuning)
    # experts_q stands for the weights (never read then): keep the tensors it was made from, for its check
    weights = [w.detach() if experts_q is not None else w.detach().contiguous() for w in (i.w_gate_up, i.w_down)]
    out, _ = kernel.forward(i.x.detach().contiguous(), i.top_experts.detach(), i.router_weights.detach(), *weights,
                            fused, i.activation, experts_q=experts_q, buffers=kernel.scratch_buffers(), check=check,
                            validated=True, **contiguous_biases(i.b_gate_up, i.b_down))
    return out


def contiguous_biases(b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None) -> dict:
    """The expert biases as the kernels read them (detached, contiguous; None stays None), by keyword."""
    return {name: None if b is None else b.detach().contiguous()
            for name, b in (("b_gate_up", b_gate_up), ("b_down", b_down))}


def layer_kernel(world: EPWorld, shape: LayerShape, config: KernelConfig | None, precision: str,
                 tuning: Tuning | None = None) -> MegaKernel:
    """The MegaKernel of ``shape`` kept on ``world`` for ``precision`` and overlap mode (shared by megamoe_forward
    and megamoe.moe): those coexist (a bench interleaves them), while another config or tuning of the same
    replaces its kernel, buffers first (a sweep over configs holds one kernel's memory at a time)."""
    overlap = not isinstance(config, KernelConfig) or config.overlap  # a bad config: MegaKernel says so
    return world.resources.get(("megakernel", shape, precision, overlap),
                               lambda: MegaKernel(world, shape, config, precision=precision, tuning=tuning),
                               version=(config, tuning))
