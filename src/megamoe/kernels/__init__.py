"""Triton kernels: jit device functions (tiles) and their launch wrappers.

Import the submodules directly (``from megamoe.kernels import quant``); this
package imports nothing itself so that CPU-only code never pulls in Triton.
"""
