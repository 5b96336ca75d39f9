"""The host-synchronised unfused forward: the project's standalone kernels launched one after another.

(The sweep tools and output_hashes compare with it. `megamoe bench --impl unfused` is the rebuilt ablation:
megamoe's own steps without overlap, ordered on the device, forward and backward: ``KernelConfig.overlap``.)

Forward only (the megakernel's stages, each its own launch):

1. the pull schedule, built on the device from every rank's routing
   (gathered through the communication workspace);
2. pull-dispatch: each rank pulls the x rows its experts need from the peers'
   symmetric ``x`` buffers (:func:`megamoe.ops.comm.dispatch_pull`);
3. expert FFN on the expert-grouped rows: gate/up + SwiGLU, then down
   (:func:`megamoe.ops.experts.expert_forward`, BF16);
4. push-combine: each expert output row is stored into its home rank's
   ``[N*k, D]`` combine slots (:func:`megamoe.ops.comm.combine_push`);
5. at home, the weighted sum over the k slots of each token with the router
   weights (fixed order j = 0..k-1, FP32 accumulation) plus the dense shared
   experts (:func:`megamoe.reference.expert_ffn` in x's dtype), rounded once
   to x's dtype.

The communication workspace is cached per (group, shape)
(:func:`megamoe.ops.comm.comm_workspace`); its size follows the largest token
count of the group, found with an all-reduce MAX (NOTE: a host sync, accepted
here; the launches also synchronise with ``sync=True`` barriers). Slots of -1
routes are never pushed: this rank's slots are zeroed before the barrier that
opens the push, and the weighted sum also masks them, so nothing from an
earlier call on the same workspace leaks into the output.

There is no autograd: the inputs are read detached under ``torch.no_grad``.
The backward comes with the megakernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megamoe import checks
from megamoe.ops.comm import CommShape, comm_shape, comm_workspace, combine_push, dispatch_pull
from megamoe.config import SWIGLU, Activation, MoEConfig
from megamoe.ops.experts import expert_forward
from megamoe.runtime import interpreting
from megamoe.reference import expert_ffn
from megamoe.parallel.world import EPWorld


def _default_num_sms(world: EPWorld) -> int:
    if world.is_cuda and not interpreting():
        return torch.cuda.get_device_properties(world.device).multi_processor_count
    return 4


@torch.no_grad()
def unfused_moe_forward(
    world: EPWorld,
    x: torch.Tensor,
    top_experts: torch.Tensor,
    router_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    activation: Activation = SWIGLU,
    *,
    num_sms: int | None = None,
) -> torch.Tensor:
    """The MoE layer's forward over ``world`` from standalone kernels (no autograd).

    Arguments as :func:`megamoe.baselines.nccl_torch.nccl_torch_moe`:

    Args:
        world: the EP group (R ranks); collective: every rank calls it.
        x: bf16 `[N, D]` this rank's tokens (N may differ between ranks, 0 included).
        top_experts: int `[N, k]` global expert ids, -1 = no route.
        router_weights: float32 `[N, k]`, applied after the experts.
        w_gate_up: bf16 `[L, 2I, D]` this rank's experts ``rank*L .. rank*L+L-1``; I a multiple of 8.
        w_down: bf16 `[L, D, I]`.
        shared: shared experts ``(w_gate_up [2Is, D], w_down [D, Is])``, replicated.
        activation: optional SwiGLU clamp.
        num_sms: programs of the communication kernels (default: the SM count; 4 on the CPU).

    Returns `[N, D]` in x's dtype (bf16). Raises ValueError on bad inputs.
    Syncs the host (the group's largest N, the id check, the launches' barriers).
    """
    n, d, k, experts_local, inter = checks.check_bf16_layer(world, x, top_experts, router_weights, w_gate_up, w_down,
                                                            shared, activation)
    if num_sms is not None and (not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 1):
        raise ValueError(f"num_sms must be None or a positive int, got {num_sms!r}")

    x, router_weights = x.detach(), router_weights.detach()
    w_gate_up, w_down = w_gate_up.detach(), w_down.detach()
    shared = [(gu.detach(), dn.detach()) for gu, dn in shared]
    num_sms = num_sms or _default_num_sms(world)

    config = MoEConfig(hidden=d, intermediate=inter, num_experts=experts_local * world.size,
                       top_k=min(k, experts_local * world.size))
    shape: CommShape = comm_shape(world, config, n)  # NOTE: all-reduce MAX of N, a host sync
    if shape.top_k != k:  # k > E: legal routing (ids may repeat or be -1); size the slots by k
        shape = CommShape(world.size, shape.max_tokens, d, k, experts_local)

    acc = torch.zeros(n, d, dtype=torch.float32, device=x.device)
    if shape.max_tokens > 0:  # every rank sees the same max: all skip together
        ws = comm_workspace(world, shape)
        ws.stage(x=x)
        # 1. the schedule (gathers every rank's routing; collective)
        schedule = ws.pull_schedule(top_experts)
        # 2. pull-dispatch (barriers on both sides: every x staged, then every pull done)
        routed = dispatch_pull(ws, schedule, num_sms=num_sms)
        # 3. expert FFN over the grouped rows
        y = expert_forward(routed, schedule.tokens_per_expert, schedule.offsets, w_gate_up, w_down,
                           activation=activation).y
        # 4. push-combine; zero this rank's slots first (the opening barrier orders it before any push)
        slots = ws.local("combine")
        slots[: n * k].zero_()
        slots = combine_push(ws, schedule, y, num_sms=num_sms)[: n * k].view(n, k, d)
        # 5. weighted sum over k in fixed order, FP32, -1 routes masked
        valid = top_experts >= 0
        weights = torch.where(valid, router_weights, 0.0)
        for j in range(k):
            row = torch.where(valid[:, j, None], slots[:, j].float(), 0.0)
            acc += weights[:, j, None] * row
    for gate_up, down in shared:
        acc += expert_ffn(x, gate_up, down, activation).float()
    return acc.to(x.dtype)
