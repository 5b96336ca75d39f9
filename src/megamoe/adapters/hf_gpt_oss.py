"""gpt-oss's ``GptOssMLP`` on megamoe (used by :func:`megamoe.adapters.hf.patch`).

The block keeps its own router (``GptOssTopKRouter``: a biased linear, top-k logits, softmax over those k) and
calls ``self.experts(x [N, D], router_indices [N, k], routing_weights [N, k])``, adding ``w_j * expert_j(x)``:
megamoe's layer. Its experts differ from megamoe's layout in three ways, each mapped once at patch time:

- ``gate_up_proj [E, D, 2I]`` is stored transposed with gate and up columns *interleaved* (gate ``2c``, up
  ``2c + 1``), and ``gate_up_proj_bias [E, 2I]`` likewise: megamoe holds ``[L, 2I, D]`` and ``[L, 2I]`` with the I
  gate rows first, then the I up rows;
- ``down_proj [E, I, D]`` is transposed: megamoe holds ``[L, D, I]``; ``down_proj_bias [E, D]`` is megamoe's
  ``b_down``;
- the activation is clamped SwiGLU with ``(up + 1)`` and ``sigmoid(alpha * gate)``: :class:`megamoe.Activation`
  kind ``gpt-oss`` at the config's ``swiglu_limit`` and ``swiglu_alpha``.

``state_dict`` / ``load_state_dict`` speak gpt-oss's own layout (all E experts gathered, columns interleaved and
transposed back; load also takes this rank's slice in that layout), so a patched model saves a checkpoint the
unpatched model loads and loads the model's own.
"""

from __future__ import annotations

import torch
from torch import nn

from megamoe.adapters.hf_experts import ExpertParallelExperts
from megamoe.config import Activation
from megamoe.parallel.world import EPWorld

#: The transformers class this module patches.
BLOCK = "GptOssMLP"


def check_experts(name: str, experts: nn.Module) -> None:
    """ValueError unless ``experts`` is a ``GptOssExperts`` layout megamoe runs (``[E, D, 2I]`` interleaved,
    ``[E, I, D]``, biases ``[E, 2I]`` and ``[E, D]``)."""
    tensors = [getattr(experts, n, None) for n in ("gate_up_proj", "down_proj", "gate_up_proj_bias",
                                                    "down_proj_bias")]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError(f"{name}: its experts have no gate_up_proj / down_proj tensors and their biases")
    gate_up, down, b_gate_up, b_down = tensors
    E, D, two_i = gate_up.shape
    if (tuple(down.shape) != (E, two_i // 2, D) or two_i % 2 or tuple(b_gate_up.shape) != (E, two_i)
            or tuple(b_down.shape) != (E, D)):
        raise ValueError(f"{name}: gate_up_proj {tuple(gate_up.shape)}, down_proj {tuple(down.shape)} and their biases "
                         f"{tuple(b_gate_up.shape)}, {tuple(b_down.shape)} are not gpt-oss's [E, D, 2I], [E, I, D], "
                         f"[E, 2I], [E, D]")


def activation_of(experts: nn.Module) -> Activation:
    """The experts' activation: kind gpt-oss at their ``limit`` and ``alpha``."""
    return Activation("gpt-oss", limit=float(experts.limit), alpha=float(experts.alpha))


def split_columns(t: torch.Tensor) -> torch.Tensor:
    """Interleaved gate / up along the last dim (gate ``2c``, up ``2c + 1``) -> the I gate, then the I up."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def interleave_columns(t: torch.Tensor) -> torch.Tensor:
    """:func:`split_columns`'s inverse: the I gate then the I up along the last dim -> interleaved."""
    gate, up = t.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


class GptOssExpertParallelExperts(ExpertParallelExperts):
    """This rank's slice of a ``GptOssExperts``, run by megamoe: ``gate_up_proj [L, 2I, D]`` and ``down_proj
    [L, D, I]`` in megamoe's layout (gate rows first), ``gate_up_proj_bias [L, 2I]`` (gate first) and
    ``down_proj_bias [L, D]``, all in the model's dtype; ``forward(x [N, D], ids [N, k], weights [N, k])`` returns
    ``sum_j w_j expert_{ids_j}(x)`` in x's dtype (the experts run in BF16)."""

    def __init__(self, experts: nn.Module, world: EPWorld, **options):
        super().__init__(experts, world, transposed=True, activation=activation_of(experts), **options)
        with torch.no_grad():  # gpt-oss's interleaved [gate, up] pairs -> megamoe's gate rows, then up rows
            self.gate_up_proj.copy_(split_columns(self.gate_up_proj.transpose(1, 2)).transpose(1, 2))

        def mine(b: torch.Tensor, split: bool) -> nn.Parameter:
            rows = b.detach()[self.rows]
            return nn.Parameter((split_columns(rows) if split else rows).to(world.device).clone(),
                                requires_grad=b.requires_grad)

        self.gate_up_proj_bias = mine(experts.gate_up_proj_bias, True)
        self.down_proj_bias = mine(experts.down_proj_bias, False)
        # after the base class's hooks (gathered and transposed to gpt-oss's [E, D, 2I]; sliced and transposed to
        # [L, 2I, D]): the columns interleaved, the biases gathered / sliced
        self.register_state_dict_post_hook(_interleave)
        self.register_load_state_dict_pre_hook(_split)

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        return self.run(hidden_states, router_indices, routing_weights, self.gate_up_proj, self.down_proj,
                        b_gate_up=self.gate_up_proj_bias, b_down=self.down_proj_bias)


def _interleave(module: GptOssExpertParallelExperts, state_dict, prefix: str, local_metadata) -> None:
    """state_dict: gate_up_proj's columns interleaved again; the biases gathered (collective), gate_up's
    interleaved."""
    key = prefix + "gate_up_proj"
    if key in state_dict:
        state_dict[key] = interleave_columns(state_dict[key]).contiguous()
    for name, split in (("gate_up_proj_bias", True), ("down_proj_bias", False)):
        key = prefix + name
        if key in state_dict:
            t = module.gathered(state_dict[key])
            state_dict[key] = interleave_columns(t).contiguous() if split else t


def _split(module: GptOssExpertParallelExperts, state_dict, prefix: str, local_metadata, strict, missing_keys,
           unexpected_keys, error_msgs) -> None:
    """load_state_dict: gate_up_proj (sliced and transposed to ``[L, 2I, D]`` already) and the biases (all E or this
    rank's L, in gpt-oss's layout) to megamoe's gate-then-up rows."""
    key = prefix + "gate_up_proj"
    t = state_dict.get(key)
    if t is not None and t.dim() == 3:
        state_dict[key] = split_columns(t.transpose(1, 2)).transpose(1, 2)
    for name, split in (("gate_up_proj_bias", True), ("down_proj_bias", False)):
        key = prefix + name
        t = state_dict.get(key)
        if t is not None and t.dim() == 2:  # missing or odd: load_state_dict reports it
            t = module.sliced(t)
            state_dict[key] = split_columns(t) if split else t
