"""What every adapter's experts module is: this rank's slice of a layer's E experts, run by megamoe."""

from __future__ import annotations

import torch
from torch import nn

from megamoe.nn.moe import check_impl, run_impl
from megamoe.ops.expert_weights import PackCache
from megamoe.parallel.world import EPWorld
from megamoe.planner import KernelConfig


class ExpertSlice(nn.Module):
    """Experts ``rank*L .. rank*L+L-1`` of ``num_experts`` on ``world`` (L = E / R), and how they run.

    Subclasses hold the weights (in the model's dtype: the master weights) and call :meth:`run` with them.
    """

    def __init__(self, world: EPWorld, num_experts: int, *, precision: str = "bf16", impl: str = "megamoe",
                 max_tokens: int | None = None, kernel_config: KernelConfig | None = None):
        super().__init__()
        check_impl(impl, precision)
        if num_experts % world.size:
            raise ValueError(f"{num_experts} experts do not split over {world.size} ranks: E must be a multiple of "
                             f"the world size")
        L = num_experts // world.size
        self.world, self.num_experts, self.local_experts = world, num_experts, L
        self.first_expert = world.rank * L
        self.precision, self.impl, self.max_tokens, self.kernel_config = precision, impl, max_tokens, kernel_config
        self.weights_q = PackCache()  # FP8: the step's weight pack (megamoe.MoE's docstring)
        self.register_load_state_dict_post_hook(PackCache.after_load)

    @property
    def rows(self) -> slice:
        """This rank's experts among all E (dim 0 of a full ``[E, ...]`` weight)."""
        return slice(self.first_expert, self.first_expert + self.local_experts)

    def run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
            w_down: torch.Tensor) -> torch.Tensor:
        """The layer on ``x [N, D]`` (any float dtype; the output comes back in it), in BF16 through the impl."""
        args = (self.world, x.to(torch.bfloat16), ids.to(torch.int32), weights.to(torch.float32),
                w_gate_up.to(torch.bfloat16), w_down.to(torch.bfloat16))
        out = run_impl(self.impl, args, precision=self.precision, config=self.kernel_config,
                       max_tokens=self.max_tokens, weights=self.weights_q)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.local_experts - 1} of {self.num_experts}, "
                f"rank {self.world.rank} of {self.world.size}, precision={self.precision}, impl={self.impl}")
