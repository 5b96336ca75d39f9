"""The peers' FP8 experts: `torch._scaled_grouped_mm` on row-wise scaled E4M3 operands (torchao's MoE recipe).

Each routed row of the activations gets one FP32 scale (amax / 448 over its K elements), each output column of
an expert's weight one (amax over K). The weights are quantised once per optimizer step
(:func:`quantize_expert_weights`, as megamoe's are), the rows in the pass. On the CPU, where
`_scaled_grouped_mm` has no kernel, :func:`scaled_grouped_mm` computes the same quantised product in FP32 (the
tests' path). Forward only: the FP8 rows of the bench time forward passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
#: `_scaled_grouped_mm` wants every group to start on a multiple of 16 rows.
FP8_GROUP_ALIGN = 16


def rowwise_e4m3(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 values, FP32 scale per row of the last axis): ``t ≈ q * scale[..., None]``; zero rows get scale
    1/448 (any scale reproduces zeros)."""
    amax = t.abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0 / E4M3_MAX)
    q = (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.squeeze(-1)


@dataclass(frozen=True)
class RowwiseExperts:
    """Routed weights in E4M3 with a scale per output column: gate/up `[L, 2I, D]` + `[L, 2I]`, down `[L, D, I]`
    + `[L, D]`."""

    w_gate_up: torch.Tensor
    w_gate_up_scale: torch.Tensor
    w_down: torch.Tensor
    w_down_scale: torch.Tensor


def quantize_expert_weights(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> RowwiseExperts:
    """Both routed weights row-wise along their reduction axis (K = D for gate/up, I for down)."""
    return RowwiseExperts(*_rowwise_by_expert(w_gate_up.detach()), *_rowwise_by_expert(w_down.detach()))


def _rowwise_by_expert(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rowwise_e4m3` of ``w`` `[L, N, K]`, one expert at a time: the FP32 copy of all of kimi-k2's 384
    experts' gate/up weights at once is 42 GiB (an EP 1 bench ran out of memory on it)."""
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(w.shape[:-1], dtype=torch.float32, device=w.device)
    for expert in range(w.shape[0]):
        q[expert], scale[expert] = rowwise_e4m3(w[expert])
    return q, scale


def scaled_grouped_mm(a: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """bf16 `[M, N]`: rows ``[ends[g-1], ends[g])`` of ``a`` `[M, K]` times expert g's ``w_q`` `[N, K]` ᵀ, both in
    E4M3 (a quantised here, a scale per row), FP32 accumulation."""
    a_q, a_scale = rowwise_e4m3(a)
    if a.is_cuda:
        return torch._scaled_grouped_mm(a_q, w_q.transpose(-2, -1), a_scale, w_scale, offs=ends,
                                        out_dtype=torch.bfloat16)
    out = torch.empty(a.shape[0], w_q.shape[1], dtype=torch.bfloat16, device=a.device)
    start = 0
    for g, end in enumerate(ends.tolist()):
        rows = a_q[start:end].float() * a_scale[start:end, None]
        out[start:end] = (rows @ (w_q[g].float() * w_scale[g][:, None]).T).to(torch.bfloat16)
        start = end
    out[start:] = 0
    return out
