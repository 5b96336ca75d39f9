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
from megamoe.parallel.world import EPWorld
from megamoe.megakernel.kernel import MegaKernel
from megamoe.ops.expert_weights import QuantizedExperts
from megamoe.planner import KernelConfig, LayerShape
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
    x: torch.Tensor,
    top_experts: torch.Tensor,
    router_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
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
) -> torch.Tensor:
    """The MoE layer's forward over ``world`` as one megakernel per pass, without autograd (``megamoe.moe`` trains).

    Args:
        world: the EP group (R ranks); collective: every rank calls it.
        x: bf16 `[N, D]` this rank's tokens (N may differ between ranks, 0 included).
        top_experts: int `[N, k]` global expert ids, -1 = no route.
        router_weights: float32 `[N, k]`, applied after the experts.
        w_gate_up: bf16 `[L, 2I, D]` this rank's experts ``rank*L .. rank*L+L-1``; I a multiple of 8.
        w_down: bf16 `[L, D, I]`.
        shared: shared experts ``(w_gate_up [2Is, D], w_down [D, Is])``, replicated.
        activation: the experts' activation (:class:`megamoe.Activation`; default SwiGLU).
        b_gate_up: bf16 `[L, 2I]`, b_down: bf16 `[L, D]`: this rank's experts' optional biases (gpt-oss), added
            to gate/up before the activation and to each expert's output, on the experts' rank.

    Args:
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

    Returns bf16 `[N, D]`. Raises ValueError on bad inputs or configs, RuntimeError when a wait timed out.
    The kernel of each shape is kept on the world (``world.resources``; ``world.close()`` frees it), one
    config and precision at a time. Nothing of a pass is kept for a backward (its layer buffers are the
    kernel's scratch set, rewritten by the next call): training goes through ``MegaKernel.forward`` with a
    layer's own buffers. On a GPU each pass's device work replays from a CUDA graph once the same weights and
    token count come back (one graph per set of weights: each MoE layer of a model gets its own). For
    CUDA-graph capture of whole passes use :class:`MegaKernel` directly with ``check=False``.
    """
    check_precision(precision)
    tensors = [x, router_weights, w_gate_up, w_down, b_gate_up, b_down,
               *(t for pair in shared if isinstance(pair, (tuple, list)) for t in pair)]
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        raise ValueError("megamoe_forward computes no gradients, and an input or weight here requires grad: use "
                         "megamoe.moe (or megamoe.MoE) to train, or call this under torch.no_grad()")
    with torch.no_grad():
        return _forward(world, x, top_experts, router_weights, w_gate_up, w_down, shared, activation, config,
                        precision, max_tokens, experts_q, check, check_finite, num_experts, b_gate_up, b_down)


def _forward(world, x, top_experts, router_weights, w_gate_up, w_down, shared, activation, config, precision,
             max_tokens, experts_q, check, check_finite, num_experts, b_gate_up, b_down) -> torch.Tensor:
    n, d, k, experts, inter = checks.check_bf16_layer(world, x, top_experts, router_weights, w_gate_up, w_down,
                                                      shared, activation, check_ids=check, num_experts=num_experts)
    if check_finite:
        checks.check_finite(x, router_weights)
    if max_tokens is None:
        max_tokens = world.largest(n)  # NOTE: host sync
    if not isinstance(max_tokens, int) or max_tokens < n:
        raise ValueError(f"max_tokens must be an int >= this rank's tokens ({n}), got {max_tokens!r}")
    fused = fuse_shared([(gu.detach(), dn.detach()) for gu, dn in shared])
    if fused is not None and fused[0].dtype != torch.bfloat16:
        raise ValueError(f"shared expert weights must be bfloat16, got {fused[0].dtype}")
    shape = LayerShape(world.size, max_tokens, d, inter, experts, k, 0 if fused is None else fused[1].shape[1])
    kernel = layer_kernel(world, shape, config, precision)
    # experts_q stands for the weights (never read then): keep the tensors it was made from, for its check
    weights = [w.detach() if experts_q is not None else w.detach().contiguous() for w in (w_gate_up, w_down)]
    out, _ = kernel.forward(x.detach().contiguous(), top_experts.detach(), router_weights.detach(), *weights,
                            fused, activation, experts_q=experts_q, buffers=kernel.scratch_buffers(), check=check,
                            **contiguous_biases(b_gate_up, b_down))
    return out


def contiguous_biases(b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None) -> dict:
    """The expert biases as the kernels read them (detached, contiguous; None stays None), by keyword."""
    return {name: None if b is None else b.detach().contiguous()
            for name, b in (("b_gate_up", b_gate_up), ("b_down", b_down))}


def layer_kernel(world: EPWorld, shape: LayerShape, config: KernelConfig | None, precision: str) -> MegaKernel:
    """The MegaKernel of ``shape`` kept on ``world`` for ``precision`` and overlap mode (shared by megamoe_forward
    and megamoe.moe): those coexist (a bench interleaves them), while another config of the same replaces its
    kernel, buffers first (a sweep over configs holds one kernel's memory at a time)."""
    overlap = not isinstance(config, KernelConfig) or config.overlap  # a bad config: MegaKernel says so
    return world.resources.get(("megakernel", shape, precision, overlap),
                               lambda: MegaKernel(world, shape, config, precision=precision), version=config)
