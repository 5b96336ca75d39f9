"""Probe: the kept E4M3 ring's rows and scales NaN-poisoned instead of zero-filled at every training forward."""
import os

import torch
from megamoe.megakernel import kernel as K

_real = K.MegaKernel.training_buffers


def _poisoned(self):
    b = _real(self)
    open(os.environ['MEGAMOE_POISON_PROBE'], 'a').write('x')  # a mark per poisoned pass
    if self.quantized:
        b.ring_x.view(torch.uint8).fill_(0x7F)  # E4M3 NaN
        if b.ring_scale.dtype == torch.uint8:
            b.ring_scale.fill_(0xFF)  # E8M0 NaN
        else:
            b.ring_scale.view(torch.uint8).fill_(0xFF)  # FP32 NaN bytes
    return b


K.MegaKernel.training_buffers = _poisoned
