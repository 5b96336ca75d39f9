"""megamoe: an expert-parallel Mixture-of-Experts layer for training, one persistent GPU kernel per pass.

What a user calls (loaded on first use, so that ``TRITON_INTERPRET`` can still be set before any kernel is):

    init_world, launch, EPWorld     the expert-parallel world (megamoe.parallel.world)
    MoEConfig, PRESETS, preset      a layer's shape (megamoe.config)
    Activation                      the experts' activation: swiglu, swiglu-clamped, gpt-oss, geglu
    KernelConfig, plan              the megakernel's knobs and the planner (megamoe.planner)
    moe                             the layer as a differentiable function (megamoe.autograd)
    MoEInputs                       the layer's inputs as one bundle, validated once (megamoe.inputs)
    quantize_experts                FP8 routed weights, once per optimizer step (megamoe.ops.expert_weights)
    MoE, MoEBlock, Router           the layer as modules (megamoe.nn)
    megamoe_forward                 the layer's forward pass alone, no autograd (megamoe.megakernel)
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "EPWorld": "megamoe.parallel.world",
    "init_world": "megamoe.parallel.world",
    "launch": "megamoe.parallel.world",
    "Activation": "megamoe.config",
    "MoEConfig": "megamoe.config",
    "PRESETS": "megamoe.config",
    "preset": "megamoe.config",
    "KernelConfig": "megamoe.planner",
    "plan": "megamoe.planner",
    "megamoe_forward": "megamoe.megakernel",
    "moe": "megamoe.autograd",
    "MoEInputs": "megamoe.inputs",
    "quantize_experts": "megamoe.ops.expert_weights",
    "MoE": "megamoe.nn",
    "MoEBlock": "megamoe.nn",
    "Router": "megamoe.nn",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'megamoe' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
