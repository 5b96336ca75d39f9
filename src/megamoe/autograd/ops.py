"""The layer's forward and backward as torch.library custom ops, with fake implementations and autograd.

``megamoe::layer_forward`` runs one megakernel pass and returns, beside the output, what the backward reads
as plain tensors (the ring's pre-activation h, the shared experts' pre-activation, with FP8 the ring's E4M3
x, the pull schedule): they are fresh tensors the autograd graph keeps, so each call's context is its own
and lives exactly as long as its graph. ``megamoe::layer_backward`` takes them back with the upstream
gradient. Their fake implementations give every output's shape from the arguments alone (the kernel's config
is the planner's, a pure function of the shape), so ``torch.compile(fullgraph=True)`` traces a model through
them. Outside torch.compile ``megamoe.moe`` runs the same two functions through :class:`EagerLayer`
(:func:`run_layer`), without the custom-op dispatch around each call.

Arguments that are not tensors: ``world`` an int handle (:mod:`megamoe.autograd.worlds`), ``max_tokens`` the
group's largest token count, ``precision``, ``config`` the KernelConfig as "num_sms,comm_sms,minibatch,
ring_rows,tile_m,tile_n,backward_comm_sms,backward_minibatch,overlap,backward_ring_rows" (an empty field for None;
"" for the planner's),
``check`` (read the kernels' error words: host syncs), ``fused_backward`` (the backward megakernel, or the
standalone kernels composed: the same bits), ``activation`` the :class:`~megamoe.config.Activation`'s text form.
``experts_q``, the FP8 weight pack flattened, is a list of tensors the autograd context keeps for the backward.
``b_gate_up`` and ``b_down`` are the routed experts' optional biases (None: none); the backward returns their
gradients, empty `[0]` tensors where there is no bias.
The autograd glue reads the forward's inputs by name (:class:`LayerInputs`, held against the op's schema), and the
backward's kept state (:class:`KeptState`) likewise.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megamoe.autograd.worlds import world_of
from megamoe.config import Activation
from megamoe.megakernel.saved import SavedForward
from megamoe.megakernel.forward import contiguous_biases, fuse_shared, layer_kernel
from megamoe.megakernel.kernel import default_config
from megamoe.megakernel.buffers import scale_dtype
from megamoe.ops.expert_weights import QuantizedExperts
from megamoe.planner import KernelConfig, LayerShape
from megamoe.precision import SCALE_BLOCK
from megamoe.routing.schedule import PullSchedule

Tensor = torch.Tensor


def config_string(config: KernelConfig | None) -> str:
    """``config`` as the ops take it ("" for the planner's)."""
    if config is None:
        return ""
    values = [config.num_sms, config.comm_sms, config.minibatch, config.ring_rows, config.tile_m, config.tile_n,
              config.backward_comm_sms, config.backward_minibatch, int(config.overlap), config.backward_ring_rows]
    return ",".join("" if v is None else str(v) for v in values)


def _config(text: str) -> KernelConfig | None:
    if not text:
        return None
    *values, overlap, ring = (int(v) if v else None for v in text.split(","))
    return KernelConfig(*values, overlap=bool(overlap), backward_ring_rows=ring)


def _shape(world, x: Tensor, top_experts: Tensor, w_gate_up: Tensor, shared_down: list[Tensor],
           max_tokens: int) -> LayerShape:
    L, two_i, d = w_gate_up.shape
    return LayerShape(world.size, max_tokens, d, two_i // 2, L, top_experts.shape[1],
                      sum(dn.shape[1] for dn in shared_down))


def _layer_forward(x: Tensor, top_experts: Tensor, router_weights: Tensor, w_gate_up: Tensor, w_down: Tensor,
                   b_gate_up: Tensor | None, b_down: Tensor | None, shared_gate_up: list[Tensor], shared_down: list[Tensor], activation: str, world: int,
                   max_tokens: int, precision: str, config: str, check: bool,
                   fused_backward: bool, experts_q: list[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                           Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                           Tensor]:
    """(out, h, shared_h, ring_x, ring_scale, src_rank, src_index, tokens_per_expert, counts, offsets, num_rows):
    the backward keeps the ring's pre-activation h; with an FP8 precision also the ring's E4M3 x and scales,
    which the gate/up wgrad re-quantises along the tokens (BF16 pulls x again: ring_x and ring_scale are
    `[0, 0]`; the ring's rows and act are the kernel's scratch, read within the pass). ``experts_q``: the step's weight pack
    flattened (``QuantizedExperts.tensors``, checked by the caller), or [] to quantise the weights here."""
    w = world_of(world)
    shape = _shape(w, x, top_experts, w_gate_up, shared_down, max_tokens)
    kernel = layer_kernel(w, shape, _config(config), precision)
    fused = fuse_shared(list(zip(shared_gate_up, shared_down)))
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    out, ctx = kernel.forward(x.contiguous(), top_experts, router_weights, w_gate_up, w_down, fused,
                              Activation.parse(activation),
                              experts_q=QuantizedExperts.from_tensors(precision, experts_q, w_gate_up, w_down),
                              buffers=kernel.training_buffers(), check=check, validated=True,
                              **contiguous_biases(b_gate_up, b_down))
    b, s = ctx.buffers, ctx.schedule
    shared_h = b.shared_h if b.shared_h is not None else x.new_empty(0, 0, dtype=torch.bfloat16)
    ring_x, ring_scale = (b.ring_x, b.ring_scale) if precision != "bf16" else (
        x.new_empty(0, 0, dtype=torch.bfloat16), x.new_empty(0, 0, dtype=torch.bfloat16))  # two: returns never alias
    # the schedule may live in a replayed graph's memory: the context gets its own copy
    return (out, b.h, shared_h, ring_x, ring_scale, s.src_rank.clone(), s.src_index.clone(),
            s.tokens_per_expert.clone(), s.counts.clone(), s.offsets.clone(), s.num_rows.clone())


layer_forward = torch.library.custom_op("megamoe::layer_forward", mutates_args=())(_layer_forward)


@layer_forward.register_fake
def _(x, top_experts, router_weights, w_gate_up, w_down, b_gate_up, b_down, shared_gate_up, shared_down, activation,
      world, max_tokens, precision, config, check, fused_backward, experts_q):
    w = world_of(world)
    shape = _shape(w, x, top_experts, w_gate_up, shared_down, max_tokens)
    c = _config(config) or default_config(w, shape, precision)
    rows, D, I, Is, L = c.ring_rows, shape.hidden, shape.intermediate, shape.shared_intermediate, shape.experts_per_rank
    i32 = dict(dtype=torch.int32)
    shared_h = x.new_empty(max(max_tokens, 1), 2 * Is, dtype=torch.bfloat16) if Is else x.new_empty(
        0, 0, dtype=torch.bfloat16)
    if precision == "bf16":
        ring_x, ring_scale = x.new_empty(0, 0, dtype=torch.bfloat16), x.new_empty(0, 0, dtype=torch.bfloat16)
    else:
        ring_x = x.new_empty(rows, D, dtype=torch.float8_e4m3fn)
        ring_scale = x.new_empty(rows, D // SCALE_BLOCK[precision], dtype=scale_dtype(precision))
    return (x.new_empty(x.shape[0], D, dtype=torch.bfloat16), x.new_empty(rows, 2 * I, dtype=torch.bfloat16),
            shared_h, ring_x, ring_scale, x.new_empty(shape.capacity, **i32),
            x.new_empty(shape.capacity, **i32), x.new_empty(L, **i32), x.new_empty(L, shape.num_ranks, **i32),
            x.new_empty(L, **i32), x.new_empty((), **i32))


def _layer_backward(d_out: Tensor, x: Tensor, top_experts: Tensor, router_weights: Tensor, w_gate_up: Tensor,
                    w_down: Tensor, b_gate_up: Tensor | None, b_down: Tensor | None, shared_gate_up: list[Tensor],
                    shared_down: list[Tensor], h: Tensor,
                    shared_h: Tensor, ring_x: Tensor, ring_scale: Tensor, src_rank: Tensor, src_index: Tensor,
                    tokens_per_expert: Tensor, counts: Tensor, offsets: Tensor, num_rows: Tensor,
                    activation: str, world: int,
                    max_tokens: int, precision: str, config: str, check: bool,
                    fused_backward: bool, experts_q: list[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                            Tensor, list[Tensor], list[Tensor]]:
    """(d_x, d_router_weights, d_w_gate_up, d_w_down, d_b_gate_up, d_b_down, [d shared gate_up], [d shared down]),
    a bias's gradient empty `[0]` without it; ``experts_q`` the forward's (its transposed weights, when the pack
    holds them, are the dgrads')."""
    w = world_of(world)
    shape = _shape(w, x, top_experts, w_gate_up, shared_down, max_tokens)
    kernel = layer_kernel(w, shape, _config(config), precision)
    schedule = PullSchedule(tokens_per_expert, counts, offsets, src_rank, src_index, num_rows, src_rank.shape[0],
                            shape.num_ranks, shape.experts_per_rank, shape.top_k, 1)
    fused = fuse_shared(list(zip(shared_gate_up, shared_down)))
    ring = (ring_x, ring_scale) if precision != "bf16" else (None, None)
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    q = QuantizedExperts.from_tensors(precision, experts_q, w_gate_up, w_down)
    g = kernel.backward(SavedForward(h, shared_h, schedule, *ring, q), d_out.to(torch.bfloat16), x.contiguous(),
                        top_experts, router_weights.contiguous(), w_gate_up, w_down, fused,
                        Activation.parse(activation), check=check, fused=fused_backward, validated=True,
                        **contiguous_biases(b_gate_up, b_down))
    d_gate_up, d_down = _unfuse_shared(g.shared_gate_up, g.shared_down, shared_gate_up, shared_down)
    return (g.x, g.router_weights, g.w_gate_up, g.w_down, _or_empty(g.b_gate_up, x), _or_empty(g.b_down, x),
            d_gate_up, d_down)


layer_backward = torch.library.custom_op("megamoe::layer_backward", mutates_args=())(_layer_backward)


def _or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    """``t``, or an empty `[0]` tensor for a bias the layer has not (an op's outputs cannot be None)."""
    return t if t is not None else like.new_empty(0, dtype=torch.bfloat16)


@layer_backward.register_fake
def _(d_out, x, top_experts, router_weights, w_gate_up, w_down, b_gate_up, b_down, shared_gate_up, shared_down, h,
      shared_h, ring_x, ring_scale, src_rank, src_index, tokens_per_expert, counts, offsets, num_rows, activation,
      world, max_tokens, precision, config, check, fused_backward, experts_q):
    biases = [torch.empty_like(b) if b is not None else x.new_empty(0, dtype=torch.bfloat16)
              for b in (b_gate_up, b_down)]
    return (torch.empty_like(x, dtype=torch.bfloat16), torch.empty_like(router_weights), torch.empty_like(w_gate_up),
            torch.empty_like(w_down), *biases, [torch.empty_like(t) for t in shared_gate_up],
            [torch.empty_like(t) for t in shared_down])


def _unfuse_shared(d_gate_up, d_down, shared_gate_up, shared_down) -> tuple[list[Tensor], list[Tensor]]:
    """The fused shared FFN's gradients split back per shared expert (gate rows, up rows, down columns)."""
    if not shared_gate_up:
        return [], []
    sizes = [dn.shape[1] for dn in shared_down]
    total, gates, ups, downs, start = sum(sizes), [], [], [], 0
    for size in sizes:
        gates.append(d_gate_up[start: start + size])
        ups.append(d_gate_up[total + start: total + start + size])
        downs.append(d_down[:, start: start + size])
        start += size
    return ([torch.cat([g, u]).to(gu.dtype) for g, u, gu in zip(gates, ups, shared_gate_up)],
            [d.contiguous().to(dn.dtype) for d, dn in zip(downs, shared_down)])


class LayerInputs(NamedTuple):
    """``megamoe::layer_forward``'s arguments by name (the same order: checked against its schema below)."""

    x: Tensor
    top_experts: Tensor
    router_weights: Tensor
    w_gate_up: Tensor
    w_down: Tensor
    b_gate_up: Tensor | None
    b_down: Tensor | None
    shared_gate_up: list[Tensor]
    shared_down: list[Tensor]
    activation: str
    world: int
    max_tokens: int
    precision: str
    config: str
    check: bool
    fused_backward: bool
    experts_q: list[Tensor]


class KeptState(NamedTuple):
    """What ``megamoe::layer_forward`` returns beside its output, for the backward (its outputs 1..)."""

    h: Tensor
    shared_h: Tensor
    ring_x: Tensor
    ring_scale: Tensor
    src_rank: Tensor
    src_index: Tensor
    tokens_per_expert: Tensor
    counts: Tensor
    offsets: Tensor
    num_rows: Tensor


#: The options the backward takes from the forward unchanged (layer_backward's keyword arguments).
_OPTIONS = ("activation", "world", "max_tokens", "precision", "config", "check", "fused_backward")


def _check_schemas() -> None:
    """The named tuples against the ops' schemas, at import: a reordered or renamed argument fails here."""
    forward = [a.name for a in torch.ops.megamoe.layer_forward.default._schema.arguments]
    backward = [a.name for a in torch.ops.megamoe.layer_backward.default._schema.arguments]
    if forward != list(LayerInputs._fields):
        raise AssertionError(f"LayerInputs {LayerInputs._fields} differ from layer_forward's schema {forward}")
    want = ["d_out", *LayerInputs._fields[:9], *KeptState._fields, *_OPTIONS, "experts_q"]
    if backward != want:
        raise AssertionError(f"layer_backward's schema {backward} differs from {want}")


_check_schemas()


def _setup_context(ctx, inputs, output) -> None:
    i = LayerInputs(*inputs)
    ctx.counts = len(i.shared_gate_up), len(i.experts_q)
    ctx.options = {name: getattr(i, name) for name in _OPTIONS}
    ctx.save_for_backward(i.x, i.top_experts, i.router_weights, i.w_gate_up, i.w_down, i.b_gate_up, i.b_down,
                          *i.shared_gate_up, *i.shared_down, *i.experts_q, *output[1:])
    ctx.mark_non_differentiable(*output[1:])
    # the kept outputs get no gradient: without this autograd hands the backward a zero tensor of each (the ring's
    # h: 199 MiB for qwen3-30b-a3b at 8192 tokens, 528 MiB for kimi-k2), allocated and filled per layer
    ctx.set_materialize_grads(False)


def _backward(ctx, d_out, *unused):
    return tuple(_gradients(ctx, d_out, layer_backward, LayerInputs(*ctx.needs_input_grad)).values())


def _gradients(ctx, d_out, backward, need: LayerInputs) -> dict:
    """The gradients of :class:`LayerInputs` by name from ``backward`` (the op, or its implementation), ``need``
    saying which inputs asked for one."""
    saved = ctx.saved_tensors
    x, top_experts, router_weights, w_gate_up, w_down, b_gate_up, b_down = saved[:7]
    if d_out is None:  # the output did not reach the loss (grads are not materialised)
        d_out = torch.zeros(x.shape[0], w_gate_up.shape[2], dtype=torch.bfloat16, device=x.device)
    s, q = ctx.counts
    shared_gate_up, shared_down = list(saved[7: 7 + s]), list(saved[7 + s: 7 + 2 * s])
    experts_q, state = list(saved[7 + 2 * s: 7 + 2 * s + q]), KeptState(*saved[7 + 2 * s + q:])
    d_x, d_rw, d_gu, d_dn, d_bgu, d_bdn, d_sgu, d_sdn = backward(
        d_out=d_out.contiguous(), x=x, top_experts=top_experts, router_weights=router_weights, w_gate_up=w_gate_up,
        w_down=w_down, b_gate_up=b_gate_up, b_down=b_down, shared_gate_up=shared_gate_up, shared_down=shared_down,
        **state._asdict(), **ctx.options, experts_q=experts_q)
    keep = lambda g, name: g if getattr(need, name) else None  # noqa: E731
    grads = dict.fromkeys(LayerInputs._fields)
    grads.update(x=keep(d_x, "x"), router_weights=keep(d_rw, "router_weights"), w_gate_up=keep(d_gu, "w_gate_up"),
                 w_down=keep(d_dn, "w_down"), b_gate_up=keep(d_bgu, "b_gate_up") if b_gate_up is not None else None,
                 b_down=keep(d_bdn, "b_down") if b_down is not None else None,
                 shared_gate_up=[g if n else None for g, n in zip(d_sgu, need.shared_gate_up)],
                 shared_down=[g if n else None for g, n in zip(d_sdn, need.shared_down)], experts_q=[None] * q)
    return grads


layer_forward.register_autograd(_backward, setup_context=_setup_context)


class EagerLayer(torch.autograd.Function):
    """The layer's forward and backward outside ``torch.compile``: the ops' own implementations and autograd glue,
    without the dispatcher's custom-op path around them (pytree, redispatch, the autograd wrapper): on a 2-core CPU
    an op of this signature took 434 against 68 us a call, and ``megamoe.moe``'s call to its stage went 415 -> 251
    us, ``backward()`` to the backward's stage 494 -> 372 us (host time the GPU waits on at a pass's start when the
    host is not ahead). The same bits: the same functions run. ``apply(LayerInputs)`` with the tensors flattened
    (autograd sees no tensor in a list)."""

    @staticmethod
    def forward(ctx, counts: tuple[int, int], options: dict, *tensors):
        i = _unflatten(counts, options, tensors)
        out = _layer_forward(*i)
        _setup_context(ctx, i, out)
        return out

    @staticmethod
    def backward(ctx, d_out, *unused):
        s, q = ctx.counts
        flat = ctx.needs_input_grad[2:]
        need = LayerInputs(*flat[:7], list(flat[7: 7 + s]), list(flat[7 + s: 7 + 2 * s]), *[False] * 7,
                           list(flat[7 + 2 * s:]))
        g = _gradients(ctx, d_out, _layer_backward, need)
        return (None, None, *_flatten(LayerInputs(**g))[2])


def _flatten(i: LayerInputs) -> tuple[tuple[int, int], dict, list]:
    """``EagerLayer.apply``'s arguments: (shared experts, pack tensors), the options, every tensor in order."""
    tensors = [i.x, i.top_experts, i.router_weights, i.w_gate_up, i.w_down, i.b_gate_up, i.b_down,
               *i.shared_gate_up, *i.shared_down, *i.experts_q]
    return (len(i.shared_gate_up), len(i.experts_q)), {name: getattr(i, name) for name in _OPTIONS}, tensors


def _unflatten(counts: tuple[int, int], options: dict, tensors) -> LayerInputs:
    s, q = counts
    return LayerInputs(*tensors[:7], list(tensors[7: 7 + s]), list(tensors[7 + s: 7 + 2 * s]), **options,
                       experts_q=list(tensors[7 + 2 * s: 7 + 2 * s + q]))


def run_layer(i: LayerInputs) -> Tensor:
    """The layer's output, differentiable: ``layer_forward`` under ``torch.compile`` (which traces the op and its
    fake), else :class:`EagerLayer` (the same functions, without the custom-op path's host time)."""
    if torch.compiler.is_compiling():
        return layer_forward(**i._asdict())[0]
    counts, options, tensors = _flatten(i)
    return EagerLayer.apply(counts, options, *tensors)[0]
