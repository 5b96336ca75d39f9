"""The experts' gated activation on FP32 tiles, forward and backward: the one jit copy every expert kernel calls
(Triton and Gluon tiles, BF16 and FP8, the megakernels). ``megamoe.config.Activation`` names the kinds and
``megamoe.reference.layer.activate`` is the torch twin (the same operations in the same order).

For ``h = [gate | up]`` (ACT, a constexpr; ``limit`` and ``alpha`` runtime floats, read only by kinds that use
them):

    SWIGLU          gate * sigmoid(gate) * up
    SWIGLU_CLAMPED  the same after gate <= limit and -limit <= up <= limit
    GPT_OSS         g = min(gate, limit), u = clamp(up, -limit, limit): g * sigmoid(alpha * g) * (u + 1)
    GEGLU           gelu(gate) * up, the exact (erf) GELU: 0.5 * gate * (1 + erf(gate / sqrt(2)))

A clamp passes the gradient inside [min, max] (inclusive), as torch.clamp does.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: ACT values: ``megamoe.config.Activation.kernel_id`` (a test holds the two together).
SWIGLU = tl.constexpr(0)
SWIGLU_CLAMPED = tl.constexpr(1)
GPT_OSS = tl.constexpr(2)
GEGLU = tl.constexpr(3)

_RSQRT2 = tl.constexpr(0.7071067811865476)
_RSQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def activation(gate, up, limit, alpha, ACT: tl.constexpr):
    """The activation of FP32 gate and up tiles."""
    if ACT == SWIGLU_CLAMPED or ACT == GPT_OSS:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    if ACT == GPT_OSS:
        return gate * tl.sigmoid(alpha * gate) * (up + 1.0)
    elif ACT == GEGLU:
        return 0.5 * gate * (1.0 + tl.math.erf(gate * _RSQRT2)) * up
    else:
        return gate * tl.sigmoid(gate) * up


@triton.jit
def activation_bwd(g, gate, up, w, limit, alpha, ACT: tl.constexpr):
    """The backward of a tile from g = dy · w_down (fp32), the saved pre-activation's gate and up halves (fp32)
    and the rows' router weights ``w`` ([BM, 1]): (the rows' router-gradient partial <g, act>, act·w, d_gate,
    d_up). Elementwise and a row sum only, so any layout's tiles call it (the Triton and Gluon dacts)."""
    gate_c, up_c = gate, up
    if ACT == SWIGLU_CLAMPED or ACT == GPT_OSS:
        gate_c = tl.minimum(gate, limit)
        up_c = tl.minimum(tl.maximum(up, -limit), limit)
    if ACT == GPT_OSS:
        sig = tl.sigmoid(alpha * gate_c)
        glu = gate_c * sig
        up_1 = up_c + 1.0
        act = glu * up_1
        d_glu = sig * (1.0 + alpha * gate_c * (1.0 - sig))
    elif ACT == GEGLU:
        cdf = 0.5 * (1.0 + tl.math.erf(gate_c * _RSQRT2))
        glu = gate_c * cdf
        up_1 = up_c
        act = glu * up_1
        d_glu = cdf + gate_c * _RSQRT_2PI * tl.exp(-0.5 * gate_c * gate_c)
    else:
        sig = tl.sigmoid(gate_c)
        glu = gate_c * sig
        up_1 = up_c
        act = glu * up_1
        d_glu = sig * (1.0 + gate_c * (1.0 - sig))
    part = tl.sum(g * act, axis=1)
    d_act = g * w
    d_up = d_act * glu
    d_gate = d_act * up_1 * d_glu
    if ACT == SWIGLU_CLAMPED or ACT == GPT_OSS:
        d_gate = tl.where(gate <= limit, d_gate, 0.0)
        d_up = tl.where((up >= -limit) & (up <= limit), d_up, 0.0)
    return part, act * w, d_gate, d_up
