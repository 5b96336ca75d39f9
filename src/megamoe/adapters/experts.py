"""What every adapter's experts module is: this rank's slice of a layer's E experts, run by megamoe."""

from __future__ import annotations

import torch
from torch import nn

from megamoe.config import SWIGLU, Activation
from megamoe.inputs import MoEInputs
from megamoe.nn.moe import check_impl, run_impl
from megamoe.ops.expert_weights import PackCache
from megamoe.parallel.world import EPWorld
from megamoe.planner import KernelConfig


class ExpertSlice(nn.Module):
    """Experts ``rank*L .. rank*L+L-1`` of ``num_experts`` on ``world`` (L = E / R), and how they run.

    Subclasses hold the weights (in the model's dtype: the master weights) and call :meth:`run` with them.
    ``activation``: the experts' (SwiGLU unless the model's are another kind, gpt-oss's).
    """

    def __init__(self, world: EPWorld, num_experts: int, *, precision: str = "bf16", impl: str = "megamoe",
                 max_tokens: int | None = None, kernel_config: KernelConfig | None = None,
                 activation: Activation = SWIGLU):
        super().__init__()
        check_impl(impl, precision)
        if num_experts % world.size:
            raise ValueError(f"{num_experts} experts do not split over {world.size} ranks: E must be a multiple of "
                             f"the world size")
        L = num_experts // world.size
        self.world, self.num_experts, self.local_experts = world, num_experts, L
        self.first_expert = world.rank * L
        self.precision, self.impl, self.max_tokens, self.kernel_config = precision, impl, max_tokens, kernel_config
        self.activation = activation
        self.weights_q = PackCache()  # FP8: the step's weight pack (megamoe.MoE's docstring)
        self.register_load_state_dict_post_hook(PackCache.after_load)

    @property
    def rows(self) -> slice:
        """This rank's experts among all E (dim 0 of a full ``[E, ...]`` weight)."""
        return slice(self.first_expert, self.first_expert + self.local_experts)

    def run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
            w_down: torch.Tensor, b_gate_up: torch.Tensor | None = None,
            b_down: torch.Tensor | None = None) -> torch.Tensor:
        """The layer on ``x [N, D]`` (any float dtype; the output comes back in it), in BF16 through the impl;
        ``b_gate_up`` `[L, 2I]`, ``b_down`` `[L, D]`: the experts' optional biases."""
        bf16 = lambda t: None if t is None else t.to(torch.bfloat16)  # noqa: E731
        inputs = MoEInputs(bf16(x), ids.to(torch.int32), weights.to(torch.float32), bf16(w_gate_up), bf16(w_down),
                           (), self.activation, bf16(b_gate_up), bf16(b_down))
        out = run_impl(self.impl, self.world, inputs, precision=self.precision, config=self.kernel_config,
                       max_tokens=self.max_tokens, weights=self.weights_q)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.local_experts - 1} of {self.num_experts}, "
                f"rank {self.world.rank} of {self.world.size}, precision={self.precision}, impl={self.impl}")
