"""The layer as a differentiable function: :func:`moe`, over torch.library ops with fake implementations."""

from megamoe.autograd.layer import moe

__all__ = ["moe"]
