"""The routed experts' E4M3 weights, made once per optimizer step for the forward and the backward.

Quantising the routed weights costs a pass over all of them (kimi-k2 at EP 2: 17 GB of BF16 read, 8.5 GB of
E4M3 written per rank, ~8.5 ms on an H200), while they change only at an optimizer step.
:func:`quantize_experts` runs that pass once; every forward until the next step takes the result
(``experts_q=``), and with ``backward=True`` every backward too: the dgrads read the weights transposed (FP8
wgmma takes K-major operands only), so the pack holds those as well.

- fp8-block: a 128x128 block's amax does not depend on the orientation, so the transposed weights are the
  forward pack's bytes and scales transposed (a copy, no second quantisation);
- mxfp8: the transposes are quantised again from the BF16 masters along their own last dim, the dgrads' K
  (the MX definition's scale axis is each GEMM's reduction axis).
- mxfp8 run as BF16 kernels (``megamoe.ops.experts_mxfp8.AS_BF16``): the pack also holds the weights rounded to the
  MXFP8 grid along each GEMM's reduction axis, bf16 in the masters' layout (:class:`RoundedWeights`: one bf16 copy of
  the routed weights per axis, the forward's two and with ``backward`` the dgrads' two, in place of the E4M3
  transposes).

The pack remembers which tensors it came from and at which version, so a pass given weights modified in place
since (an optimizer step) refuses the stale pack instead of computing with old weights. Writes through
``w.data`` bypass the version counter and are not seen: quantise again after them. :class:`PackCache` is the
owner's side of that: a module holding the weights keeps one and asks it for the current pack each pass; it
also counts ``torch.optim`` steps, since a parameter re-gathered by FSDP2 keeps version 0.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from megamoe.ops.experts_mxfp8 import runs_as_bf16
from megamoe.ops.quant import mx_round_weights, quantize_weights
from megamoe.precision import FORMATS, check_precision


def _stamp(w: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """What identifies a weight tensor's current values: storage address, in-place version, shape."""
    return w.data_ptr(), w._version, tuple(w.shape)


@dataclass(frozen=True)
class TransposedWeights:
    """E4M3 ``w_gate_upᵀ [L, D, 2I]`` and ``w_downᵀ [L, I, D]`` with their scales: the dgrads' B operands,
    K-major (fp8-block: fp32 per 128x128 block; mxfp8: E8M0 per 32 along the last dim)."""

    w_gate_up_t: torch.Tensor
    w_gate_up_t_scale: torch.Tensor
    w_down_t: torch.Tensor
    w_down_t_scale: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.w_gate_up_t, self.w_gate_up_t_scale, self.w_down_t, self.w_down_t_scale]


def transposed_weights(w_gate_up: torch.Tensor, w_down: torch.Tensor, fmt: str = "fp8-block") -> TransposedWeights:
    """The dgrads' weights quantised from the BF16 masters in ``fmt`` (one quantiser launch each; mxfp8's
    blocks run along the transposes' last dim, the dgrads' K)."""
    with torch.no_grad():
        gu, gu_s = quantize_weights(w_gate_up.detach().transpose(1, 2), fmt)
        dn, dn_s = quantize_weights(w_down.detach().transpose(1, 2), fmt)
    return TransposedWeights(gu, gu_s, dn, dn_s)


@dataclass(frozen=True)
class RoundedWeights:
    """The routed weights rounded to the MXFP8 grid along each GEMM's reduction axis, bf16 in the masters' layout
    (exact: ``megamoe.ops.quant.mx_round_weights``), for MXFP8 run as the BF16 expert kernels.

    Attributes:
        gate_up_along_d: `[L, 2I, D]`, 32-blocks along D (gate/up's K); down_along_i: `[L, D, I]`, along I (down's).
        down_along_d: `[L, D, I]`, along D (dact's K); gate_up_along_2i: `[L, 2I, D]`, along 2I (dx's K). None
            without the backward's.
    """

    gate_up_along_d: torch.Tensor
    down_along_i: torch.Tensor
    down_along_d: torch.Tensor | None = None
    gate_up_along_2i: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.gate_up_along_d, self.down_along_i, self.down_along_d, self.gate_up_along_2i)
                if t is not None]

    @property
    def backward(self) -> bool:
        """Whether the dgrads' weights are here."""
        return self.down_along_d is not None


def rounded_weights(w_gate_up: torch.Tensor, w_down: torch.Tensor, *, backward: bool = False) -> RoundedWeights:
    """:class:`RoundedWeights` of the BF16 masters: one ``mx_round_weights`` launch per tensor and axis."""
    with torch.no_grad():
        gu, dn = w_gate_up.detach(), w_down.detach()
        if not backward:
            return RoundedWeights(mx_round_weights(gu, -1), mx_round_weights(dn, -1))
        return RoundedWeights(mx_round_weights(gu, -1), mx_round_weights(dn, -1), mx_round_weights(dn, -2),
                              mx_round_weights(gu, -2))


@dataclass(frozen=True)
class QuantizedExperts:
    """E4M3 routed-expert weights and their scales, as the megakernel reads them.

    Attributes:
        precision: ``mxfp8`` (E8M0 scales per 32 along each GEMM's reduction axis) or ``fp8-block`` (fp32
            scales per 128x128 block).
        w_gate_up, w_gate_up_scale: E4M3 `[L, 2I, D]` and its scales.
        w_down, w_down_scale: E4M3 `[L, D, I]` and its scales.
        source: the stamps of the BF16 weights they were made from (see ``check_source``).
        transposed: the backward's dgrad weights (``quantize_experts(..., backward=True)``), or None (a backward
            given this pack makes them for itself).
        rounded: mxfp8 run as BF16 kernels (``megamoe.ops.experts_mxfp8.AS_BF16``): the weights rounded to the
            grid, bf16 (with ``backward`` the dgrads' too, and then no ``transposed``); None otherwise.
    """

    precision: str
    w_gate_up: torch.Tensor
    w_gate_up_scale: torch.Tensor
    w_down: torch.Tensor
    w_down_scale: torch.Tensor
    source: tuple
    transposed: TransposedWeights | None = None
    rounded: RoundedWeights | None = None

    def made_from(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
        """Whether this pack was made from these very tensors, unchanged since."""
        return self.source == (_stamp(w_gate_up), _stamp(w_down))

    def check_source(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, precision: str) -> None:
        """ValueError unless this pack was made from these very tensors, unchanged since, in ``precision``."""
        if self.precision != precision:
            raise ValueError(f"experts_q holds {self.precision} weights but the pass runs {precision}")
        if not self.made_from(w_gate_up, w_down):
            raise ValueError("experts_q was not made from these w_gate_up / w_down, or they changed since "
                             "(an optimizer step): quantize_experts them again")

    def tensors(self) -> list[torch.Tensor]:
        """The pack as a flat list (4 tensors, 8 with the transposed weights; then the bf16 rounded weights, 2 or
        4, if any): how the layer's custom ops carry it; :meth:`from_tensors` takes it back."""
        return [self.w_gate_up, self.w_gate_up_scale, self.w_down, self.w_down_scale] + (
            self.transposed.tensors() if self.transposed is not None else []) + (
            self.rounded.tensors() if self.rounded is not None else [])

    @staticmethod
    def from_tensors(precision: str, tensors: list[torch.Tensor], w_gate_up: torch.Tensor,
                     w_down: torch.Tensor) -> QuantizedExperts | None:
        """The pack of :meth:`tensors` (None for an empty list), stamped as made from ``w_gate_up`` and
        ``w_down`` (the caller checked it against them before flattening it)."""
        if not tensors:
            return None
        rest = list(tensors[4:])
        transposed = None
        if len(rest) >= 4 and rest[0].dtype == torch.float8_e4m3fn:  # the E4M3 transposes (bf16: rounded weights)
            transposed, rest = TransposedWeights(*rest[:4]), rest[4:]
        if len(tensors) < 4 or len(rest) not in (0, 2, 4) or any(t.dtype != torch.bfloat16 for t in rest):
            raise ValueError(f"a flattened pack has 4 or 8 tensors (with the E4M3 transposes), then 0, 2 or 4 bf16 "
                             f"rounded weights; got {len(tensors)}: {[str(t.dtype) for t in tensors]}")
        rounded = RoundedWeights(*rest) if rest else None
        return QuantizedExperts(precision, *tensors[:4], (_stamp(w_gate_up), _stamp(w_down)), transposed, rounded)

    def has_backward(self) -> bool:
        """Whether the pack holds what a backward reads: the E4M3 transposes, or (run as BF16) the rounded
        dgrad weights."""
        return self.rounded.backward if self.rounded is not None else self.transposed is not None

    def rounded_weights(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, *,
                        backward: bool = False) -> RoundedWeights:
        """The bf16 rounded weights (with ``backward``, the dgrads' too): the pack's own, or made now from the
        masters (a pack made with ``AS_BF16`` off)."""
        if self.rounded is not None and (self.rounded.backward or not backward):
            return self.rounded
        return rounded_weights(w_gate_up, w_down, backward=backward)

    def backward_weights(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> TransposedWeights:
        """The dgrads' weights: the pack's own, or made now (fp8-block from this pack, mxfp8 from the masters)."""
        if self.transposed is not None:
            return self.transposed
        if self.precision == "fp8-block":
            return _transposed_pack(self)
        return transposed_weights(w_gate_up, w_down, self.precision)


def _transposed_pack(q: QuantizedExperts) -> TransposedWeights:
    """fp8-block's dgrad weights from its forward pack: the same 128x128 blocks, transposed (copied into fresh
    tensors with canonical strides: ``contiguous()`` keeps a size-1 dim's stride)."""
    t = lambda a: torch.empty_like(a.transpose(1, 2), memory_format=torch.contiguous_format).copy_(  # noqa: E731
        a.transpose(1, 2))
    return TransposedWeights(t(q.w_gate_up), t(q.w_gate_up_scale), t(q.w_down), t(q.w_down_scale))


def quantize_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor, precision: str, *,
                     backward: bool = False) -> QuantizedExperts:
    """Quantise the routed experts' weights (`[L, 2I, D]`, `[L, D, I]`, BF16) for ``precision``: one launch
    per tensor, bit for bit what the megakernel would quantise in its pass; with ``backward`` also the dgrads'
    transposed weights (the module docstring). The pack holds half the BF16 weights' bytes (the same again with
    ``backward``; plus ~1-3 % of scales) until it is dropped; quantising again before dropping the old pack
    needs room for both. mxfp8 with ``megamoe.ops.experts_mxfp8.AS_BF16``: also the weights rounded to the grid
    (:class:`RoundedWeights`, the BF16 weights' bytes again, twice with ``backward``), and no E4M3 transposes."""
    check_precision(precision, FORMATS)
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be a bfloat16 [L, rows, cols] tensor, got "
                             f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
    with torch.no_grad():
        gate_up, gate_up_scale = quantize_weights(w_gate_up.detach(), precision)
        down, down_scale = quantize_weights(w_down.detach(), precision)
    q = QuantizedExperts(precision, gate_up, gate_up_scale, down, down_scale, (_stamp(w_gate_up), _stamp(w_down)))
    if runs_as_bf16(precision):
        return replace(q, rounded=rounded_weights(w_gate_up, w_down, backward=backward))
    return replace(q, transposed=q.backward_weights(w_gate_up, w_down)) if backward else q


class PackCache:
    """One layer's current pack, owned by the module that holds the weights: :meth:`get` returns it while the
    weights are unchanged and quantises them again after an optimizer step (a ``torch.optim`` step, or the
    weights' version or address moved) or when a backward needs the transposed weights the cached pack lacks.
    The old pack is dropped before the new one is made, so at most one pack lives per layer. Weights written
    any other way (through ``w.data``, an optimizer outside ``torch.optim``) need :meth:`clear` after.

    Each cache registers its own torch optimizer-step hook, which drops its pack (the stamps alone cannot see a
    step under a wrapper such as FSDP2, which gathers the weights into a reused parameter whose version stays 0
    and whose address the allocator may hand out again); the hook holds the cache weakly and goes with it. A copy
    (``copy.deepcopy``, pickling) is a new empty cache with its own hook."""

    def __init__(self) -> None:
        self.pack: QuantizedExperts | None = None
        cache = weakref.ref(self)

        def drop_pack(optimizer, args, kwargs) -> None:
            if (alive := cache()) is not None:
                alive.pack = None

        weakref.finalize(self, register_optimizer_step_post_hook(drop_pack).remove)

    def __reduce__(self):
        return PackCache, ()

    def clear(self) -> None:
        """Drop the pack: the next :meth:`get` quantises the weights again."""
        self.pack = None

    @staticmethod
    def after_load(module, incompatible_keys) -> None:
        """A ``load_state_dict`` post-hook for a module holding a cache as ``weights_q``: the loaded weights may
        sit where the old ones did (FSDP2's gathered parameters), so the pack goes."""
        module.weights_q.clear()

    def get(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, precision: str, *,
            backward: bool) -> QuantizedExperts:
        q = self.pack
        if (q is None or q.precision != precision or not q.made_from(w_gate_up, w_down)
                or (q.rounded is not None) != runs_as_bf16(precision) or (backward and not q.has_backward())):
            self.pack = None
            self.pack = quantize_experts(w_gate_up, w_down, precision, backward=backward)
        return self.pack
