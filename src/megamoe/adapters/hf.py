"""HuggingFace transformers: run a model's sparse MoE blocks on megamoe, expert parallel over a world.

    model = AutoModelForCausalLM.from_config(config)        # or from_pretrained(...)
    model = megamoe.adapters.hf.patch(model, world)          # every rank, alike

:func:`patch` replaces the ``experts`` of each supported block (:data:`BLOCKS`: Qwen3-MoE, DeepSeek-V3,
Qwen2-MoE, Mixtral, OLMoE, GLM-4.5; gpt-oss through :mod:`megamoe.adapters.hf_gpt_oss`, which maps its
interleaved, transposed, biased experts and its activation) with :class:`ExpertParallelExperts`, which holds this
rank's slice of the
experts (experts ``rank*L .. rank*L+L-1``) and runs them through :func:`megamoe.moe`. Everything else stays the
model's own code: its router (softmax or sigmoid, top-k, ``norm_topk_prob``, ``routed_scaling_factor``,
DeepSeek-V3's and GLM-4.5's grouped top-k and ``e_score_correction_bias``), its shared experts and their gates,
Mixtral's jitter. So the routing is exactly the model's, and the experts compute what transformers' experts
compute, in BF16. Llama-4's ``Llama4TextMoe`` scales each expert's input (not its output) by the router score;
:mod:`megamoe.adapters.hf_llama4` replaces the block with one that maps that exactly onto megamoe's layer.

Training: the routed experts' gradients cover every rank's tokens routed to them (complete); every other
parameter is replicated and its gradient covers this rank's tokens: reduce those over the world (DDP, FSDP over
the data dimension, or an all-reduce) as for any data-parallel weight.

Checkpoints: ``state_dict()`` of a patched model has the unpatched model's keys and shapes — each
``gate_up_proj`` / ``down_proj`` gathered to all E experts (collective: every rank calls it) — and
``load_state_dict`` takes either the full experts (each rank keeps its slice) or this rank's slice. So
``save_pretrained`` writes a checkpoint the unpatched model loads, and a patched model loads a HF checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from megamoe.adapters import hf_gpt_oss
from megamoe.adapters.hf_experts import ExpertParallelExperts, activation_problem
from megamoe.nn.moe import check_impl
from megamoe.parallel.world import EPWorld
from megamoe.planner import KernelConfig
from megamoe.precision import check_precision

#: The transformers blocks whose experts are patched (class names): each calls ``self.experts(x [N, D],
#: top_k_index [N, k], top_k_weights [N, k])`` and adds ``top_k_weights[j] * expert_j(x)``, on experts holding
#: ``gate_up_proj [E, 2I, D]`` (gate rows, then up) and ``down_proj [E, D, I]`` with a SiLU gate: megamoe's layout.
BLOCKS = ("Qwen3MoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "MixtralSparseMoeBlock", "DeepseekV3MoE",
          "OlmoeSparseMoeBlock", "Glm4MoeMoE")

#: The transformers blocks replaced whole (class names): Llama-4's (:mod:`megamoe.adapters.hf_llama4`).
REPLACED_BLOCKS = ("Llama4TextMoe",)

#: The transformers blocks whose experts are patched in their own layout (class names): gpt-oss's
#: (:mod:`megamoe.adapters.hf_gpt_oss`: interleaved gate / up, transposed, biased, its own activation).
MAPPED_BLOCKS = ("GptOssMLP",)


def _check_experts(name: str, experts: nn.Module) -> None:
    """ValueError unless ``experts`` is the layout megamoe runs (SwiGLU, [gate | up], not transposed, no bias, no
    norm after each expert)."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        raise ValueError(f"{name}: its experts have no gate_up_proj / down_proj tensors")
    layout = {"has_bias": False, "is_transposed": False, "is_concatenated": True, "has_gate": True,
              "has_post_expert_norm": False}
    off = [f"{key}={getattr(experts, key)!r}" for key, want in layout.items()
           if getattr(experts, key, want) != want]
    problem = " ".join([activation_problem(experts)] + off).strip()
    if problem:
        raise ValueError(f"{name}: megamoe runs SwiGLU experts stored [gate | up] without bias; these have "
                         f"{problem}")
    E, two_i, D = gate_up.shape
    if tuple(down.shape) != (E, D, two_i // 2) or two_i % 2:
        raise ValueError(f"{name}: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
                         f"[E, 2I, D] and [E, D, I]")


def patch(model: nn.Module, world: EPWorld, *, precision: str = "bf16", impl: str = "megamoe",
          max_tokens: int | None = None, kernel_config: KernelConfig | None = None) -> nn.Module:
    """Run every supported sparse MoE block of ``model`` (:data:`BLOCKS`, :data:`REPLACED_BLOCKS`,
    :data:`MAPPED_BLOCKS`) on megamoe;
    returns ``model`` (or, when ``model`` is itself a Llama-4 block, its replacement).

    Collective: every rank of ``world`` patches a model built alike (the same config and weights): each keeps
    its slice of every block's experts. The model moves nothing else (put it on ``world.device`` as usual).

    Args:
        model: a transformers model (any module holding supported blocks).
        world: the expert-parallel group; E must be a multiple of its size.
        precision: the routed experts' precision (``bf16``, ``fp8-block``, ``mxfp8``: every one trains; the FP8
            ones keep their weight pack per optimizer step, as :class:`megamoe.MoE`).
        impl: ``megamoe`` (default), or for comparisons ``reference`` (FP32 math over the EP group) or
            ``nccl-torch`` (all-to-all + grouped GEMM), as :class:`megamoe.MoE` (:data:`megamoe.nn.moe.IMPLS`).
        max_tokens: the largest tokens per rank a forward sees (batch x sequence); None finds it every call (an
            all-reduce: a host sync).
        kernel_config: the megakernel's knobs (default: the planner's).

    Raises ValueError when the model has no supported block, or a block's experts are not SwiGLU in the
    ``[gate | up]`` layout (Llama-4, gpt-oss: their own layouts), or E is not a multiple of the world size.
    """
    from megamoe.adapters import hf_llama4  # it imports this module

    check_precision(precision)
    check_impl(impl, precision)
    options = {"precision": precision, "impl": impl, "max_tokens": max_tokens, "kernel_config": kernel_config}
    supported = BLOCKS + REPLACED_BLOCKS + MAPPED_BLOCKS
    blocks = [(name, m) for name, m in model.named_modules() if type(m).__name__ in supported]
    if not blocks and not any(isinstance(m, ExpertParallelExperts) for m in model.modules()):
        found = sorted({type(m).__name__ for m in model.modules() if "moe" in type(m).__name__.lower()})
        raise ValueError(f"{type(model).__name__} has no MoE block megamoe patches (it patches {', '.join(supported)}"
                         f"{'; found ' + ', '.join(found) if found else ''})")
    for name, block in blocks:
        label = name or type(block).__name__
        if type(block).__name__ == hf_llama4.BLOCK:
            hf_llama4.check_experts(label, block.experts)
            twin = hf_llama4.Llama4ExpertParallelMoe(block, world, **options)
            if not name:
                return twin
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, twin)
            continue
        if isinstance(block.experts, ExpertParallelExperts):
            continue  # patched already
        if type(block).__name__ == hf_gpt_oss.BLOCK:
            hf_gpt_oss.check_experts(label, block.experts)
            block.experts = hf_gpt_oss.GptOssExpertParallelExperts(block.experts, world, **options)
            continue
        _check_experts(label, block.experts)
        block.experts = ExpertParallelExperts(block.experts, world, **options)
    return model
