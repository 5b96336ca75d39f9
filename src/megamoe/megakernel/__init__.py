"""The megakernel: one persistent kernel per pass, forward and backward, its buffers, launches and graph replay."""

from megamoe.megakernel.buffers import ForwardContext, LayerBuffers
from megamoe.megakernel.forward import fuse_shared, megamoe_forward
from megamoe.megakernel.kernel import MegaKernel, default_config

__all__ = ["ForwardContext", "LayerBuffers", "MegaKernel", "default_config", "fuse_shared", "megamoe_forward"]
