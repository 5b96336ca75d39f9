"""The activations the tests run: each kind at a limit small enough that its clamps bite on random inputs."""

from __future__ import annotations

from megamoe.config import SWIGLU, Activation


def clamped(limit: float | None) -> Activation:
    """SwiGLU, clamped at ``limit`` when given."""
    return SWIGLU if limit is None else Activation("swiglu-clamped", limit=limit)


#: The layer tests' kinds (gpt-oss at limit 0.8: its default 7 would never clamp a random input).
CLAMPED, GPT_OSS, GEGLU = clamped(0.8), Activation("gpt-oss", limit=0.8), Activation("geglu")
#: One of each kind, for the kernels' tests.
EVERY_KIND = (SWIGLU, clamped(0.6), GPT_OSS, GEGLU)
