"""The model trained by `megamoe train`: a HuggingFace Qwen3-MoE decoder built from a config (nothing
downloaded), its sparse MoE blocks made expert parallel by :func:`megamoe.adapters.hf.patch`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TrainPreset:
    """A decoder's shape, the batch it trains on (per rank, per step), and the run's default length and rate."""

    name: str
    layers: int
    hidden: int
    num_experts: int
    top_k: int
    moe_intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    sequence: int
    batch: int
    lr: float  # AdamW's learning rate unless the run sets one
    steps: int  # optimizer steps unless the run sets them

    @property
    def tokens_per_rank(self) -> int:
        return self.batch * self.sequence


PRESETS = {
    # 3-6 s per megamoe step on 2 CPU cores under the Triton interpreter (the default run: 1-2 minutes);
    # megamoe's CPU kernels take hidden a multiple of 64 and the experts' intermediate a multiple of 32.
    "cpu": TrainPreset("cpu", layers=2, hidden=64, num_experts=8, top_k=2, moe_intermediate=32, heads=2, kv_heads=1,
                       head_dim=32, vocab=128, sequence=32, batch=2, lr=1e-2, steps=12),
    # Qwen3-30B-A3B's layer shape (8 of its 48 layers, its vocabulary) for two H200s: 8192 tokens per GPU per step.
    "h200x2": TrainPreset("h200x2", layers=8, hidden=2048, num_experts=128, top_k=8, moe_intermediate=768, heads=32,
                          kv_heads=4, head_dim=128, vocab=151936, sequence=4096, batch=2, lr=3e-4, steps=50),
}


def get_preset(name: str) -> TrainPreset:
    """The preset called ``name`` (ValueError naming the known ones otherwise)."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {name!r}")
    return PRESETS[name]


def qwen3_moe_config(preset: TrainPreset, *, attn_implementation: str = "eager"):
    """The transformers ``Qwen3MoeConfig`` of ``preset``: every layer sparse, no load-balancing loss (the loss
    is the language model's alone, the same quantity for every implementation)."""
    import transformers  # heavy: only where a model is built

    return transformers.Qwen3MoeConfig(
        vocab_size=preset.vocab, hidden_size=preset.hidden, num_hidden_layers=preset.layers,
        num_experts=preset.num_experts, num_experts_per_tok=preset.top_k,
        moe_intermediate_size=preset.moe_intermediate, intermediate_size=4 * preset.moe_intermediate,
        num_attention_heads=preset.heads, num_key_value_heads=preset.kv_heads, head_dim=preset.head_dim,
        max_position_embeddings=preset.sequence, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        output_router_logits=False, use_cache=False, tie_word_embeddings=False,
        attn_implementation=attn_implementation)


def build_model(preset: TrainPreset, world, impl: str, seed: int) -> torch.nn.Module:
    """The preset's model on ``world.device``, FP32 master weights drawn from ``seed`` (the same on every rank
    and for every impl), its MoE blocks run by ``impl`` with this rank's slice of the experts."""
    import transformers

    from megamoe.adapters.hf import patch

    # eager attention is exact and safe on the CPU; on GPUs it would keep [heads, S, S] scores per layer
    attention = "sdpa" if world.is_cuda else "eager"
    config = qwen3_moe_config(preset, attn_implementation=attention)
    torch.manual_seed(seed)
    with torch.device(world.device):  # drawn where it runs: no host copy of the full experts
        model = transformers.Qwen3MoeForCausalLM(config)
    model = patch(model.float().train(), world, impl=impl, max_tokens=preset.tokens_per_rank)
    return model
