"""Triton kernels and the device functions (tiles) they inline: jit code only.

Nothing here launches or imports above it (launches live in ``megamoe.ops`` and
``megamoe.megakernel``). Import the submodules directly (``from megamoe.kernels
import quant``); this package imports nothing itself.
"""
