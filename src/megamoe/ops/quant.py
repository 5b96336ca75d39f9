"""MXFP8 and FP8-block quantisation launches.

:func:`quantize_activations` and :func:`quantize_weights` launch
``megamoe.kernels.quant.quantize_kernel`` (bit for bit the definitions of
:mod:`megamoe.reference.formats`, which are their torch twins), one program
per tile; :class:`QuantConfig` pins a tile. The routed experts' weights, quantised
once per optimizer step, are :mod:`megamoe.ops.expert_weights`' packs.

One launch (``_prepare``) serves every caller -- both formats, both block axes, transposed outputs, a fused
row gather and E4M3 inputs re-quantised (the FP8 backward's token-axis operands), and the MXFP8 grid rounding to
bf16 (:func:`mx_round_activations`, :func:`mx_round_weights`) -- and the sm_90 build check builds from the same
function (``planned_launch``). It stays one file past 450 lines so that the launch and its checks stay private to
one module rather than imported across two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from megamoe.checks import check_tensors, describe
from megamoe.kernels.quant import quantize_kernel
from megamoe.precision import FORMATS, FP8_BLOCK, MX_BLOCK
from megamoe.reference.formats import check_quant_input, check_rounding, normalize_dim
from megamoe.runtime import interpreting


@dataclass(frozen=True)
class QuantConfig:
    """Tile shape and code path of one quantisation launch.

    Attributes:
        block_m: BLOCK_M, tile rows per program; a power of two, a multiple
            of the block's rows.
        block_k: BLOCK_K, tile columns per program; a power of two, a
            multiple of the block's columns.
        num_warps: warps per program (ignored by the interpreter).
        soft_e4m3: None picks the hardware E4M3 conversion when compiled and
            the software rounding under TRITON_INTERPRET=1; True pins the
            software rounding; False the hardware one (refused under the
            interpreter, whose fp8 cast is not round-to-nearest-even).
    """

    block_m: int
    block_k: int
    num_warps: int = 8
    soft_e4m3: bool | None = None

    def __post_init__(self) -> None:
        for name in ("block_m", "block_k", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value & (value - 1):
                raise ValueError(f"QuantConfig.{name} must be a power of two, got {value!r}")
        if self.soft_e4m3 not in (None, True, False):
            raise ValueError(f"QuantConfig.soft_e4m3 must be None, True or False, got {self.soft_e4m3!r}")


def default_config(block: tuple[int, int]) -> QuantConfig:
    """The tile for ``block`` (rows, cols).

    The fastest tile of the H200 sweep (benchmarks/quant_bench.py; bf16 [16384, 7168] activations,
    [32, 4096, 7168] weights, % of the 4252 GB/s copy ceiling). Rowwise blocks: 16 x 512, 4 warps
    (each warp owns whole rows: the block max is in-thread plus two shuffles). Columnwise blocks
    run across rows, and a tile whose warps split a block (every tile here with > 1 warp) reduces
    through shared memory (4-6 CTA barriers, ``BLOCK_K x warps`` partials): fewer warps per block
    was faster on the GPU (32 x 128 w2 71 % vs 32 x 256 w4 48 %, w8 29 %). One-warp tiles (the
    block max in-thread plus shuffles, no barrier) win for 32-row blocks; each columnwise default
    is the tile best for both output layouts (row-major and transposed), 2026-11-29 sweep in
    benchmarks/results/2026-11-29-quant-defaults.
    """
    br, bc = block
    if (br, bc) == (1, MX_BLOCK):
        return QuantConfig(block_m=16, block_k=512, num_warps=4)  # 93 % (32 x 512 w8: 91.5 %)
    if (br, bc) == (MX_BLOCK, 1):
        return QuantConfig(block_m=64, block_k=64, num_warps=1)  # 80 %, transposed 71.5 % (32 x 128 w2: 71 / 66 %)
    if (br, bc) == (1, FP8_BLOCK):
        return QuantConfig(block_m=16, block_k=512, num_warps=4)  # 83 %
    if (br, bc) == (FP8_BLOCK, 1):
        return QuantConfig(block_m=128, block_k=64, num_warps=2)  # 65 %, transposed 82 % (w4: 63 / 61 %)
    return QuantConfig(block_m=128, block_k=128, num_warps=8)  # 128x128 weights: 90 %


def soft_e4m3_default() -> bool:
    """The ``SOFT_E4M3`` a launcher passes: True under TRITON_INTERPRET=1, False compiled."""
    return interpreting()


def _resolve_soft(config: QuantConfig) -> bool:
    if config.soft_e4m3 is None:
        return soft_e4m3_default()
    if not config.soft_e4m3 and interpreting():
        raise ValueError(
            "QuantConfig(soft_e4m3=False) asks for the hardware E4M3 conversion, which the "
            "Triton interpreter does not round to nearest even; use None or True under TRITON_INTERPRET=1"
        )
    return config.soft_e4m3


def _check_config(config: object, block: tuple[int, int]) -> QuantConfig:
    if config is None:
        return default_config(block)
    if not isinstance(config, QuantConfig):
        raise ValueError(f"config must be a QuantConfig or None, got {type(config).__name__}")
    br, bc = block
    if config.block_m % br or config.block_k % bc:
        raise ValueError(
            f"config tile [{config.block_m}, {config.block_k}] must hold whole {br}x{bc} blocks"
        )
    return config


def _check_device(t: torch.Tensor, name: str) -> None:
    if t.device.type != "cuda" and not interpreting():
        raise ValueError(f"{name} must be a CUDA tensor (or set TRITON_INTERPRET=1 on the CPU), got {t.device}")


def _fmt_block(fmt: object, axis: int, weights: bool) -> tuple[bool, tuple[int, int]]:
    """(is mxfp8, block rows x cols) for a format and the axis (0 rows, 1 cols) blocks run along."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if fmt == "mxfp8":
        return True, ((MX_BLOCK, 1) if axis == 0 else (1, MX_BLOCK))
    if weights:
        return False, (FP8_BLOCK, FP8_BLOCK)
    return False, ((FP8_BLOCK, 1) if axis == 0 else (1, FP8_BLOCK))


def _prepare(
    x_BMK: torch.Tensor,
    mx: bool,
    block: tuple[int, int],
    rounding: str,
    transpose: bool,
    config: QuantConfig,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    copy: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    scale_transpose: bool | None = None,
    src_scale: torch.Tensor | None = None,
    rounded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
    """Outputs and the ``quantize_kernel`` launch ``(grid, args, kwargs)`` (None when empty) for
    quantising each ``[M, K]`` matrix of ``x_BMK``: ``data [B, M, K]`` and ``scale [B, M/br, K/bc]``
    (their last two dims swapped, contiguous, when ``transpose``), or ``out`` (not transposed) when given;
    ``copy`` (like ``x_BMK``) also receives x unchanged; ``rows`` (one matrix) gathers the rows quantised
    (M = its length); ``scale_transpose`` False keeps the scales ``[M/br, K/bc]`` beside transposed data;
    ``src_scale`` (one matrix) makes ``x_BMK`` E4M3 rows with these scales along K, dequantised on load.
    ``rounded`` (mxfp8, not transposed): ``data`` is bf16 ``[B, M, K]``, x rounded to the MXFP8 grid (the
    kernel's ROUND; ``out`` then ``(data, None)``), and ``scale`` an unused placeholder.
    Works on meta tensors too, which is how ``compile_sm90`` builds exactly the kernel a launch would run."""
    nb, m, k = x_BMK.shape
    if rows is not None:
        m = rows.shape[0]
    br, bc = block
    scale_t = transpose if scale_transpose is None else scale_transpose
    for i, (size, b) in enumerate(((m, br), (k, bc))):
        if size % b:
            side = "rows" if i == 0 else "cols"
            raise ValueError(f"{side}={size} of shape {tuple(x_BMK.shape)} is not a multiple of the block {block}")
    if nb > 65535:
        raise ValueError(f"at most 65535 matrices per launch, got {nb}")
    dev = x_BMK.device
    scale_dtype = torch.uint8 if mx else torch.float32
    if rounded:  # bf16 values on the grid, no scales
        if not mx or transpose:
            raise ValueError("rounding to the grid is mxfp8's, untransposed")
        data = data_v = out[0] if out is not None else torch.empty(nb, m, k, dtype=torch.bfloat16, device=dev)
        scale = scale_v = torch.empty(1, 1, 1, dtype=torch.uint8, device=dev)  # never written
    elif out is not None:
        data, scale = out
        data_v, scale_v = data, scale
    elif transpose:
        data = torch.empty(nb, k, m, dtype=torch.float8_e4m3fn, device=dev)
        data_v = data.transpose(1, 2)
        if scale_t:
            scale = torch.empty(nb, k // bc, m // br, dtype=scale_dtype, device=dev)
            scale_v = scale.transpose(1, 2)
        else:
            scale = scale_v = torch.empty(nb, m // br, k // bc, dtype=scale_dtype, device=dev)
    else:
        data = torch.empty(nb, m, k, dtype=torch.float8_e4m3fn, device=dev)
        scale = torch.empty(nb, m // br, k // bc, dtype=scale_dtype, device=dev)
        data_v, scale_v = data, scale
    if data.numel() == 0:
        return data, scale, None
    bm, bk = config.block_m, config.block_k
    src = x_BMK if src_scale is None else x_BMK.view(torch.uint8)  # E4M3 rows are read as bytes
    copy_v = src if copy is None else copy
    for name, t in (("x", x_BMK), ("data", data_v), ("copy", copy_v)):
        if bm * abs(t.stride(1)) + bk * abs(t.stride(2)) >= 2**31:
            raise ValueError(f"{name} strides {t.stride()} overflow int32 tile offsets for tile [{bm}, {bk}]")
    data_u8 = data_v if rounded else data_v.view(torch.uint8)
    grid = (triton.cdiv(m, bm) * triton.cdiv(k, bk), nb)
    # NOTE: with one matrix its batch strides are passed as 0: Triton then knows they are
    # multiples of 16, which the 16-byte vectorisation of every tile offset depends on.
    strides = [list(t.stride()) for t in (x_BMK, data_u8, scale_v, copy_v)]
    if nb == 1:
        for st in strides:
            st[0] = 0
    args = (src, data_u8, scale_v, copy_v, m, k, *strides[0], *strides[1], *strides[2], *strides[3],
            x_BMK if rows is None else rows, x_BMK if src_scale is None else src_scale,
            0 if src_scale is None else src_scale.stride(0))
    kwargs = dict(
        COPY=copy is not None,
        GATHER=rows is not None,
        SRC_BLOCK=0 if src_scale is None else k // src_scale.shape[-1],
        MX=mx,
        BLOCK_R=br,
        BLOCK_C=bc,
        RCEIL=rounding == "rceil",
        SOFT_E4M3=_resolve_soft(config),
        BLOCK_M=bm,
        BLOCK_K=bk,
        num_warps=config.num_warps,
        ROUND=rounded,
    )
    return data, scale, (grid, args, kwargs)


def _launch(
    x_BMK: torch.Tensor,
    mx: bool,
    block: tuple[int, int],
    rounding: str,
    transpose: bool,
    config: QuantConfig,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    copy: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    scale_transpose: bool | None = None,
    src_scale: torch.Tensor | None = None,
    rounded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each ``[M, K]`` matrix of ``x_BMK`` (see ``_prepare``)."""
    data, scale, launch = _prepare(x_BMK, mx, block, rounding, transpose, config, out, copy, rows, scale_transpose,
                                   src_scale, rounded)
    if launch is not None:
        grid, args, kwargs = launch
        quantize_kernel[grid](*args, **kwargs)
    return data, scale


#: The scales E4M3 rows may come with (``x_scale``): dtype -> (format, elements per scale along K).
SCALE_FORMATS = {torch.float32: ("fp8-block", FP8_BLOCK), torch.uint8: ("mxfp8", MX_BLOCK)}


def _check_activation(x: torch.Tensor, x_scale: torch.Tensor | None, rows: torch.Tensor | None,
                      scale_formats: dict) -> None:
    """The activation quantisers' one validation: ``x`` 2-D on a usable device (E4M3 rows contiguous along K
    with ``x_scale``, a dtype of ``scale_formats``), ``rows`` a 1-D int64 index on x's device."""
    if x_scale is None:
        check_quant_input(x)
    elif not isinstance(x, torch.Tensor) or x.dtype != torch.float8_e4m3fn:
        raise ValueError(f"with x_scale, x must be float8_e4m3fn, got {describe(x)}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    _check_device(x, "x")
    if x_scale is not None:
        fmt, src_block = scale_formats.get(getattr(x_scale, "dtype", None), (None, 0))
        if fmt is None or x.shape[1] % src_block or x.stride(1) != 1:
            kinds = " or ".join(f"{str(dtype).removeprefix('torch.')} ({name})"
                                for dtype, (name, _) in scale_formats.items())
            raise ValueError(f"x_scale must be {kinds} scales of x's rows along K (x contiguous along K), got "
                             f"{describe(x_scale)} for x {describe(x)}")
        check_tensors((("x_scale", x_scale, (x.shape[0], x.shape[1] // src_block), x_scale.dtype),), x.device)
    if rows is not None:
        if not isinstance(rows, torch.Tensor) or rows.dim() != 1:
            raise ValueError(f"rows must be a 1-D int64 tensor, got {describe(rows)}")
        check_tensors((("rows", rows, tuple(rows.shape), torch.int64),), x.device)


def quantize_activations(
    x: torch.Tensor,
    fmt: str,
    axis: int = 1,
    *,
    rounding: str = "floor",
    transpose: bool = False,
    config: QuantConfig | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    copy: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    scale_transpose: bool | None = None,
    x_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D activation ``x [M, K]`` with blocks along ``axis``.

    Args:
        x: float32/bfloat16/float16 ``[M, K]``, any strides; CUDA (or CPU
            under TRITON_INTERPRET=1).
        fmt: ``"mxfp8"`` (32-blocks, E8M0 scales) or ``"fp8-block"``
            (128-blocks, float32 scales).
        axis: the axis the blocks run along, the GEMM's reduction axis: 1
            (or -1) rowwise, 0 (or -2) columnwise; that dim must be a
            multiple of the block (32 or 128).
        rounding: mxfp8's exponent rule, ``"floor"`` or ``"rceil"``;
            fp8-block accepts only the default.
        transpose: return ``data.T`` and ``scale.T`` (contiguous ``[K, M]``
            and its scales) instead -- the K-major operand a GEMM reducing
            over M wants; the kernel writes them directly.
        config: tile shape and E4M3 path; None picks ``default_config``.
        out: ``(data, scale)`` to write into instead of new tensors (contiguous, on x's device, the shapes
            and dtypes returned otherwise; not with ``transpose``).
        copy: a contiguous tensor like x (shape, dtype, device) that also receives x unchanged, from the
            same read of x (a staging copy for free); must not overlap x.
        rows: int64 ``[M']`` on x's device: quantise these rows of x, in this order, a zero row where an
            entry is negative (a gather fused into the read; ``M'`` takes M's place everywhere); entries
            must be below x's rows. Not with ``out`` or ``copy``.
        scale_transpose: with ``transpose``, False keeps the scales ``[M/br, K/bc]`` (a K step's scales
            contiguous along the output's rows); None: as ``transpose``.
        x_scale: x is float8_e4m3fn rows already quantised along K with these scales (float32
            ``[M, K/128]``, fp8-block's, or uint8 E8M0 ``[M, K/32]``, mxfp8's): they are dequantised on load
            (``formats``' dequantise: one float32 rounding) and quantised again in ``fmt`` along ``axis``.
            Not with ``copy``.

    Returns:
        ``(data, scale)`` (``out`` when given) equal bit for bit to ``megamoe.reference.formats``:
        ``mxfp8_quantize(x, dim=axis, rounding=rounding)`` or
        ``fp8_block_quantize(x, block=(1, 128) or (128, 1))``.
    """
    if x_scale is not None and copy is not None:
        raise ValueError("x_scale is not supported with copy")
    if rows is not None and (out is not None or copy is not None):
        raise ValueError("rows is not supported with out or copy")
    _check_activation(x, x_scale, rows, SCALE_FORMATS)
    ax = normalize_dim(axis, 2, "axis")
    check_rounding(rounding)
    mx, block = _fmt_block(fmt, ax, weights=False)
    if not mx and rounding != "floor":
        raise ValueError(f"rounding={rounding!r} applies to mxfp8 only; fp8-block scales are amax / 448")
    if not isinstance(transpose, bool):
        raise ValueError(f"transpose must be a bool, got {transpose!r}")
    cfg = _check_config(config, block)
    if out is not None:
        if transpose:
            raise ValueError("out is not supported with transpose=True")
        (m, k), (br, bc) = x.shape, block
        if not isinstance(out, tuple) or len(out) != 2:
            raise ValueError("out must be a (data, scale) pair of tensors")
        check_tensors((("out data", out[0], (m, k), torch.float8_e4m3fn),
                       ("out scale", out[1], (m // br, k // bc), torch.uint8 if mx else torch.float32)), x.device)
        out = (out[0].unsqueeze(0), out[1].unsqueeze(0))
    if copy is not None:
        check_tensors((("copy", copy, tuple(x.shape), x.dtype),), x.device)
        copy = copy.unsqueeze(0)
    if scale_transpose is not None and not (isinstance(scale_transpose, bool) and transpose):
        raise ValueError(f"scale_transpose applies with transpose=True and is a bool, got {scale_transpose!r}")
    data, scale = _launch(x.unsqueeze(0), mx, block, rounding, transpose, cfg, out, copy, rows, scale_transpose,
                          x_scale)
    return data.squeeze(0), scale.squeeze(0)


def _weight_axis(w: torch.Tensor, axis: int) -> int:
    """``axis`` of a weight matrix ``[rows, cols]`` or stack ``[E, rows, cols]`` as a non-negative dim, after checking
    ``w`` (the weight quantisers' one validation)."""
    check_quant_input(w, "w")
    if w.dim() not in (2, 3):
        raise ValueError(f"w must be [rows, cols] or [E, rows, cols], got shape {tuple(w.shape)}")
    _check_device(w, "w")
    ax = normalize_dim(axis, w.dim(), "axis")
    if ax < w.dim() - 2:
        raise ValueError(f"axis={axis} must name rows or cols (-2 or -1) of w with shape {tuple(w.shape)}")
    return ax


def quantize_weights(
    w: torch.Tensor,
    fmt: str,
    *,
    axis: int = -1,
    rounding: str = "floor",
    config: QuantConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight matrix ``[rows, cols]`` or all experts of a stack ``[E, rows, cols]`` in one launch.

    Args:
        w: float32/bfloat16/float16, 2-D or 3-D, any strides; CUDA (or CPU
            under TRITON_INTERPRET=1).
        fmt: ``"mxfp8"`` or ``"fp8-block"``.
        axis: mxfp8 only: the dim the 32-blocks run along, -1 (cols, e.g. D of
            ``w_gate_up [E, 2I, D]`` for the forward GEMM) or -2 (rows, for
            dgrad). fp8-block uses 128x128 blocks, which serve both GEMMs;
            ``axis`` must still name one of the last two dims.
        rounding: mxfp8's exponent rule (``"floor"`` or ``"rceil"``).
        config: tile shape and E4M3 path; None picks ``default_config``.

    Returns:
        ``(data, scale)`` equal bit for bit to
        ``mxfp8_quantize(w, dim=axis, rounding=rounding)`` or
        ``fp8_block_quantize(w, block=(128, 128))``.
    """
    ax = _weight_axis(w, axis)
    check_rounding(rounding)
    mx, block = _fmt_block(fmt, ax - (w.dim() - 2), weights=True)
    if not mx and rounding != "floor":
        raise ValueError(f"rounding={rounding!r} applies to mxfp8 only; fp8-block scales are amax / 448")
    cfg = _check_config(config, block)
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    data, scale = _launch(w3, mx, block, rounding, False, cfg)
    if w.dim() == 2:
        return data.squeeze(0), scale.squeeze(0)
    return data, scale


def mx_round_activations(
    x: torch.Tensor,
    axis: int = 1,
    *,
    rows: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: QuantConfig | None = None,
) -> torch.Tensor:
    """A 2-D activation ``x [M, K]`` rounded to the MXFP8 grid along ``axis``, as bf16: the values
    ``mxfp8_dequantize(*mxfp8_quantize(x, dim=axis), dim=axis, dtype=torch.bfloat16)`` gives, bit for bit (the
    MXFP8 expert kernels' operands, which run as BF16 operands with ``megamoe.ops.experts_mxfp8.AS_BF16``). One
    ``quantize_kernel`` launch (ROUND): one read of x, one bf16 write, no scales.

    Args:
        x: float32/bfloat16/float16 ``[M, K]``, or float8_e4m3fn rows with ``x_scale`` (as
            :func:`quantize_activations`: dequantised on load, then rounded along ``axis``; along 1, the rows' own
            axis, that is their dequantised values).
        axis: 1 (rowwise, 32-blocks along K) or 0 (along M).
        rows: int64 ``[M']``: round these rows of x in this order, a zero row where an entry is negative (as
            :func:`quantize_activations`; the wgrads' token blocks of each expert, ``experts_fp8_bwd.token_blocks``).
        out: bf16 ``[M (or M'), K]`` contiguous to write into (None: a new tensor).
        config: tile shape (None: ``default_config``); its ``soft_e4m3`` only picks the bf16 conversion (the
            rounding itself is float32 arithmetic either way).
    """
    _check_activation(x, x_scale, rows, {torch.uint8: ("mxfp8", MX_BLOCK)})
    mx, block = _fmt_block("mxfp8", normalize_dim(axis, 2, "axis"), weights=False)
    cfg = _check_config(config, block)
    m = x.shape[0] if rows is None else rows.shape[0]
    if out is not None:
        check_tensors((("out", out, (m, x.shape[1]), torch.bfloat16),), x.device)
        if not out.is_contiguous():
            raise ValueError(f"out must be contiguous, got strides {out.stride()}")
        out = (out.unsqueeze(0), None)
    data, _ = _launch(x.unsqueeze(0), mx, block, "floor", False, cfg, out, None, rows, None, x_scale, rounded=True)
    return data.squeeze(0)


def mx_round_weights(w: torch.Tensor, axis: int = -1, *, config: QuantConfig | None = None) -> torch.Tensor:
    """A weight matrix ``[rows, cols]`` or a stack ``[E, rows, cols]`` rounded to the MXFP8 grid along ``axis`` (-1
    cols, -2 rows), as bf16 in its own layout (one launch): bit for bit
    ``mxfp8_dequantize(*mxfp8_quantize(w, dim=axis), dim=axis, dtype=torch.bfloat16)``; exact (the weights' scale
    bytes are never below 3 but for blocks with amax < 2**-116)."""
    ax = _weight_axis(w, axis)
    mx, block = _fmt_block("mxfp8", ax - (w.dim() - 2), weights=True)
    cfg = _check_config(config, block)
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    data, _ = _launch(w3, mx, block, "floor", False, cfg, rounded=True)
    return data if w.dim() == 3 else data.squeeze(0)


def planned_launch(shape: tuple[int, ...], fmt: str, axis: int, *, weights: bool = False, transpose: bool = False,
                   rounding: str = "floor", config: QuantConfig | None = None,
                   dtype: torch.dtype = torch.bfloat16, rows: int | None = None,
                   scale_transpose: bool | None = None, src_fmt: str | None = None,
                   rounded: bool = False) -> tuple[tuple, dict, int]:
    """``(args, kwargs, num_warps)`` of the ``quantize_kernel`` launch that ``quantize_weights`` (``weights``)
    or ``quantize_activations`` makes for a tensor of ``shape`` (gathering ``rows`` rows when given; from E4M3
    rows quantised along K in ``src_fmt`` when given; ``rounded``: ``mx_round_weights`` / ``mx_round_activations``'
    instead), built on meta tensors (no memory, no GPU): what the sm_90 build check (``megamoe.tools.sm90``)
    compiles."""
    x = torch.empty(shape, dtype=torch.float8_e4m3fn if src_fmt else dtype, device="meta")
    src_scale = None
    if src_fmt:
        src_mx, (_, src_block) = _fmt_block(src_fmt, 1, weights=False)
        src_scale = torch.empty(shape[0], shape[1] // src_block, dtype=torch.uint8 if src_mx else torch.float32,
                                device="meta")
    if weights:
        ax = normalize_dim(axis, x.dim(), "axis")
        mx, block = _fmt_block(fmt, ax - (x.dim() - 2), weights=True)
        x3 = x if x.dim() == 3 else x.unsqueeze(0)
    else:
        mx, block = _fmt_block(fmt, normalize_dim(axis, 2, "axis"), weights=False)
        x3 = x.unsqueeze(0)
    cfg = _check_config(config, block)
    gather = None if rows is None else torch.empty(rows, dtype=torch.int64, device="meta")
    _, _, launch = _prepare(x3, mx, block, rounding, transpose, cfg, rows=gather, scale_transpose=scale_transpose,
                            src_scale=src_scale, rounded=rounded)
    if launch is None:
        raise ValueError(f"an empty tensor {shape} launches nothing")
    _, args, kwargs = launch
    return args, kwargs, cfg.num_warps


def block_of(fmt: str, axis: int, weights: bool = False) -> tuple[int, int]:
    """The scale block ``(rows, cols)`` of ``fmt`` quantised along ``axis`` (of the last two dims)."""
    return _fmt_block(fmt, axis, weights)[1]

