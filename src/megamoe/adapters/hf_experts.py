"""The experts module :mod:`megamoe.adapters.hf` puts into a transformers MoE block: this rank's slice of the
experts run by megamoe, checkpointed in the model's own layout; and the check that experts gate with SiLU. Both the
patched blocks (:mod:`megamoe.adapters.hf`) and Llama-4's replaced one (:mod:`megamoe.adapters.hf_llama4`) build on
it."""

from __future__ import annotations

import torch
from torch import nn

from megamoe.adapters.experts import ExpertSlice
from megamoe.parallel.world import EPWorld


class ExpertParallelExperts(ExpertSlice):
    """This rank's slice of a transformers experts module, run by megamoe (built by :func:`patch`).

    Parameters ``gate_up_proj [L, 2I, D]`` and ``down_proj [L, D, I]`` (megamoe's layout) keep the model's dtype
    (the master weights); the layer runs them in BF16 (a cast per call when the model is not BF16) and returns
    x's dtype. ``transposed``: the model stores them transposed (Llama-4's ``[E, D, 2I]`` and ``[E, I, D]``):
    they are transposed once here, and ``state_dict`` / ``load_state_dict`` speak the model's layout.
    """

    def __init__(self, experts: nn.Module, world: EPWorld, *, transposed: bool = False, **options):
        gate_up, down = experts.gate_up_proj, experts.down_proj
        super().__init__(world, gate_up.shape[0], **options)
        self.transposed = transposed

        def mine(w: torch.Tensor) -> nn.Parameter:
            rows = w.detach()[self.rows]
            rows = rows.transpose(1, 2) if transposed else rows
            return nn.Parameter(rows.to(world.device).clone(memory_format=torch.contiguous_format),
                                requires_grad=w.requires_grad)

        self.gate_up_proj, self.down_proj = mine(gate_up), mine(down)
        self.register_state_dict_post_hook(_gather_experts)
        self.register_load_state_dict_pre_hook(_slice_experts)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.run(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)

    def gathered(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's ``[L, ...]`` slice of an expert tensor gathered into all E experts (collective)."""
        return t if self.world.size == 1 else self.world.gather_rows(t)

    def sliced(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a loaded expert tensor: all E experts' sliced, a slice of L as it is."""
        return t[self.rows] if t.shape[0] == self.num_experts != self.local_experts else t


def _gather_experts(module: ExpertParallelExperts, state_dict, prefix: str, local_metadata) -> None:
    """state_dict: every rank's slice gathered into the full ``[E, ...]`` tensors (collective), in the model's
    layout."""
    for name in ("gate_up_proj", "down_proj"):
        key = prefix + name
        if key in state_dict:
            t = module.gathered(state_dict[key])
            state_dict[key] = t.transpose(1, 2).contiguous() if module.transposed else t


def _slice_experts(module: ExpertParallelExperts, state_dict, prefix: str, local_metadata, strict, missing_keys,
                   unexpected_keys, error_msgs) -> None:
    """load_state_dict: full ``[E, ...]`` experts in the model's layout become this rank's slice; a slice of L
    loads as it is (transposed to megamoe's layout when the model's is transposed)."""
    for name in ("gate_up_proj", "down_proj"):
        key = prefix + name
        t = state_dict.get(key)
        if t is None or t.dim() != 3:
            continue  # missing or odd: load_state_dict reports it
        t = module.sliced(t)
        state_dict[key] = t.transpose(1, 2) if module.transposed else t


def activation_problem(experts: nn.Module) -> str:
    """Why ``experts`` do not gate with SiLU (their config's ``hidden_act``, their ``act_fn``), or ``''``."""
    act = getattr(getattr(experts, "config", None), "hidden_act", "silu")
    if act != "silu":
        return f"hidden_act={act!r}"
    fn = getattr(experts, "act_fn", None)
    if fn is not None and type(fn).__name__ not in ("SiLU", "SiLUActivation"):
        return f"act_fn={type(fn).__name__}"
    return ""
