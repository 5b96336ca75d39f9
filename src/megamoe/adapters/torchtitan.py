"""torchtitan: run a model's MoE layers on megamoe, expert parallel over a world.

    model = model_config.build()                                   # a torchtitan model (DeepSeek-V3, Qwen3, ...)
    model = megamoe.adapters.torchtitan.patch(model, world)         # every rank, alike; before parallelize

:func:`patch` replaces the ``routed_experts`` of each torchtitan ``MoE`` (torchtitan.models.common.moe) with
:class:`TitanRoutedExperts`: this rank's slice of the experts (``rank*L .. rank*L+L-1``) run through
:func:`megamoe.moe`, which dispatches, computes and combines in one pass — torchtitan's token dispatcher and its
all-to-alls are not used. torchtitan's router (softmax or sigmoid, node-limited groups, ``route_norm``,
``route_scale``, the load-balancing ``expert_bias_E`` and its token counts) and shared experts stay its own.

The experts run as megamoe's fused ``[gate | up]`` weights: ``w_gate_up [L, 2F, D]`` (torchtitan's w1, then w3)
and ``w_down [L, D, F]`` (w2). ``state_dict()`` writes torchtitan's keys and full shapes
(``routed_experts.inner_experts.w1_EFD`` ...; collective: the slices are gathered), and ``load_state_dict``
takes them back, full or this rank's slice: checkpoints move between patched and unpatched models.

Gradients: the routed experts' cover every rank's tokens; the rest is replicated, its gradients cover this
rank's tokens (reduce them over the ranks as for data parallelism). Apply torchtitan's own expert parallelism
(``parallelize`` with EP > 1) to an unpatched model only: megamoe is the expert parallelism here.
"""

from __future__ import annotations

import torch
from torch import nn

from megamoe.adapters.experts import ExpertSlice
from megamoe.nn.moe import check_impl
from megamoe.parallel.world import EPWorld
from megamoe.planner import KernelConfig
from megamoe.precision import check_precision

#: torchtitan's names of the experts' weights (inner_experts.<name>) and what megamoe holds them as.
TITAN_KEYS = ("w1_EFD", "w3_EFD", "w2_EDF")


class TitanRoutedExperts(ExpertSlice):
    """This rank's slice of a torchtitan ``RoutedExperts``, run by megamoe (built by :func:`patch`).

    ``forward(x [B, L, D], topk_scores [B, L, K], topk_expert_ids [B, L, K], num_local_tokens_per_expert)``
    returns ``[B, L, D]`` in x's dtype (the experts in BF16, their master weights in the model's dtype).
    """

    def __init__(self, routed_experts: nn.Module, world: EPWorld, **options):
        inner = routed_experts.inner_experts
        w1, w2, w3 = (getattr(inner, name) for name in ("w1_EFD", "w2_EDF", "w3_EFD"))
        E, F, D = w1.shape
        if tuple(w3.shape) != (E, F, D) or tuple(w2.shape) != (E, D, F):
            raise ValueError(f"torchtitan experts w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)} "
                             f"are not [E, F, D], [E, F, D], [E, D, F]")
        super().__init__(world, E, **options)
        rows = self.rows
        self.w_gate_up = nn.Parameter(torch.cat([w1.detach()[rows], w3.detach()[rows]], dim=1).to(world.device))
        self.w_down = nn.Parameter(w2.detach()[rows].to(world.device).clone())
        self.register_state_dict_post_hook(_titan_state_dict)
        self.register_load_state_dict_pre_hook(_from_titan_state_dict)

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor, topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor | None = None) -> torch.Tensor:
        del num_local_tokens_per_expert_E  # megamoe counts its own rows
        D, K = x_BLD.shape[-1], topk_expert_ids_BLK.shape[-1]
        out = self.run(x_BLD.reshape(-1, D), topk_expert_ids_BLK.reshape(-1, K), topk_scores_BLK.reshape(-1, K),
                       self.w_gate_up, self.w_down)
        return out.view(x_BLD.shape)


def _titan_state_dict(module: TitanRoutedExperts, state_dict, prefix: str, local_metadata) -> None:
    """state_dict: torchtitan's keys, every rank's slice gathered (collective)."""
    gate_up, down = state_dict.pop(prefix + "w_gate_up"), state_dict.pop(prefix + "w_down")
    if module.world.size > 1:
        gate_up, down = module.world.gather_rows(gate_up), module.world.gather_rows(down)
    w1, w3 = gate_up.chunk(2, dim=1)
    for name, t in zip(TITAN_KEYS, (w1, w3, down)):
        state_dict[f"{prefix}inner_experts.{name}"] = t.contiguous()


def _from_titan_state_dict(module: TitanRoutedExperts, state_dict, prefix: str, local_metadata, strict,
                           missing_keys, unexpected_keys, error_msgs) -> None:
    """load_state_dict: torchtitan's keys (full experts or this rank's slice) become w_gate_up and w_down."""
    keys = [f"{prefix}inner_experts.{name}" for name in TITAN_KEYS]
    if not all(key in state_dict for key in keys):
        return  # megamoe's own keys, or missing ones: load_state_dict reports them
    w1, w3, w2 = (state_dict.pop(key) for key in keys)
    if w1.shape[0] == module.num_experts != module.local_experts:
        w1, w3, w2 = w1[module.rows], w3[module.rows], w2[module.rows]
    state_dict[prefix + "w_gate_up"] = torch.cat([w1, w3], dim=1)
    state_dict[prefix + "w_down"] = w2


def _is_titan_moe(m: nn.Module) -> bool:
    inner = getattr(getattr(m, "routed_experts", None), "inner_experts", None)
    return (type(m).__name__ == "MoE" and type(m).__module__.startswith("torchtitan.")
            and all(isinstance(getattr(inner, name, None), torch.Tensor) for name in TITAN_KEYS))


def patch(model: nn.Module, world: EPWorld, *, precision: str = "bf16", impl: str = "megamoe",
          max_tokens: int | None = None, kernel_config: KernelConfig | None = None) -> nn.Module:
    """Run every torchtitan ``MoE`` of ``model`` on megamoe; returns ``model``.

    Collective: every rank patches a model built alike (the same config and weights) and keeps its slice of the
    experts. Arguments as :func:`megamoe.adapters.hf.patch`. ValueError when the model has no torchtitan MoE
    layer, or it is sharded already (DTensor experts: patch before torchtitan's ``parallelize``).
    """
    check_precision(precision)
    check_impl(impl, precision)
    layers = [m for m in model.modules() if _is_titan_moe(m)]
    if not layers and not any(isinstance(getattr(m, "routed_experts", None), TitanRoutedExperts)
                              for m in model.modules()):
        raise ValueError(f"{type(model).__name__} has no torchtitan MoE layer (torchtitan.models.common.moe.MoE "
                         f"with routed_experts.inner_experts w1_EFD / w2_EDF / w3_EFD)")
    for layer in layers:
        inner = layer.routed_experts.inner_experts
        if any(type(getattr(inner, name)).__name__ == "DTensor" for name in TITAN_KEYS):
            raise ValueError("the torchtitan experts are DTensors (parallelized already): patch the model before "
                             "torchtitan's parallelize; megamoe is its expert parallelism")
        layer.routed_experts = TitanRoutedExperts(layer.routed_experts, world, precision=precision, impl=impl,
                                                  max_tokens=max_tokens, kernel_config=kernel_config)
    return model
