"""The layer as torch modules: :class:`Router`, :class:`MoE`, :class:`MoEBlock`."""

from megamoe.nn.moe import MoE, MoEBlock
from megamoe.nn.router import Router

__all__ = ["MoE", "MoEBlock", "Router"]
