"""MXFP8 / FP8-block quantisation: definitions, torch functions and Triton kernels.

Three implementations must agree bit for bit: an independent float64/numpy
oracle written from the formats' rules (``_oracle_*`` below), the pure-torch
functions of ``megamoe.formats`` and the Triton kernels of
``megamoe.kernels.quant`` (the interpreter on the CPU, compiled on a GPU).
Inputs hit every rule on purpose: random blocks, tiny and huge magnitudes,
float32 and bf16 subnormals, all-zero blocks (with -0.0), NaN / +inf / -inf
blocks, exact round-to-nearest-even ties after scaling (normal and subnormal
E4M3), values at and just past +-448 after scaling, and the rceil boundary
(mantissa exactly 1.75).
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from megamoe.precision import E4M3_MAX, FP8_BLOCK_AMAX_FLOOR
from megamoe.reference.formats import fp8_block_dequantize, fp8_block_quantize, mxfp8_dequantize, mxfp8_quantize
from megamoe.ops.quant import QuantConfig, default_config, quantize_activations, quantize_weights
from megamoe.runtime import interpreting

from sm90 import sm90_report  # tests/sm90.py

DTYPES = (torch.float32, torch.bfloat16)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------- the oracle

_E4M3 = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()  # bits 0..127
_E4M3_FINITE = {float(v): b for b, v in enumerate(_E4M3[:0x7F])}


def _floor_log2(a: np.ndarray) -> np.ndarray:
    """floor(log2 a) exactly for a > 0 (frexp: a = m * 2**ex, m in [0.5, 1))."""
    return np.frexp(a)[1].astype(np.int64) - 1


def _oracle_e4m3(y: np.ndarray) -> np.ndarray:
    """uint8 bits of E4M3_rne(clamp(y, +-448)) for finite float64 y."""
    a = np.minimum(np.abs(y), E4M3_MAX)
    e = np.maximum(_floor_log2(np.where(a > 0, a, 1.0)), -6)
    q = np.ldexp(1.0, e - 3)
    r = np.minimum(np.round(a / q) * q, E4M3_MAX)  # np.round: half to even
    bits = np.array([_E4M3_FINITE[v] for v in r.ravel()], dtype=np.uint8).reshape(y.shape)
    return bits | np.where(np.signbit(y), 0x80, 0).astype(np.uint8)


def _blocks(x: torch.Tensor, dim: int, n: int) -> np.ndarray:
    """float64 [nblocks, n]: blocks of n along dim (x moved so that dim is last)."""
    return x.double().movedim(dim, -1).reshape(-1, n).numpy()


def _unblocks(b: np.ndarray, like: torch.Tensor, dim: int) -> torch.Tensor:
    shape = like.movedim(dim, -1).shape
    return torch.from_numpy(np.ascontiguousarray(b)).reshape(shape).movedim(-1, dim)


def _oracle_mxfp8(x: torch.Tensor, dim: int, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(data bits uint8, scale uint8) from the OCP rule, block by block, in float64."""
    xb = _blocks(x, dim, 32)
    bad = ~np.isfinite(xb).all(axis=1)
    amax = np.where(bad, 0.0, np.abs(np.where(np.isfinite(xb), xb, 0.0)).max(axis=1))
    e = np.full(amax.shape, -127, dtype=np.int64)
    nz = amax > 0
    if rounding == "floor":
        e[nz] = _floor_log2(amax[nz]) - 8
    else:  # smallest e with amax <= 448 * 2**e
        cand = _floor_log2(np.where(nz, amax, 1.0)) - 9
        for _ in range(3):
            cand = np.where(amax > np.ldexp(E4M3_MAX, cand), cand + 1, cand)
        e[nz] = cand[nz]
    e = np.clip(e, -127, 127)
    y = np.where(bad[:, None], 0.0, xb) * np.ldexp(1.0, -e)[:, None]
    data = np.where(bad[:, None], 0x7F, _oracle_e4m3(y)).astype(np.uint8)
    scale = np.where(bad, 255, e + 127).astype(np.uint8)
    sx = x.movedim(dim, -1)
    return _unblocks(data, x, dim), torch.from_numpy(scale).reshape(*sx.shape[:-1], -1).movedim(-1, dim)


def _oracle_fp8_block(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(data bits uint8, scale float32) from the recipe's rule, in float64 with explicit float32 roundings."""
    br, bc = block
    *lead, r, c = x.shape
    xb = x.double().reshape(-1, r // br, br, c // bc, bc).numpy()
    fin = np.isfinite(xb)
    bad = ~fin.all(axis=(2, 4))
    amax = np.abs(np.where(fin, xb, 0.0)).max(axis=(2, 4))
    amax = np.maximum(amax, FP8_BLOCK_AMAX_FLOOR)
    scale = (amax / E4M3_MAX).astype(np.float32)  # float64 then float32: correctly rounded
    inv = (E4M3_MAX / amax).astype(np.float32).astype(np.float64)
    y = (np.where(fin, xb, 0.0) * inv[:, :, None, :, None]).astype(np.float32).astype(np.float64)
    data = np.where(bad[:, :, None, :, None], 0x7F, _oracle_e4m3(y)).astype(np.uint8)
    scale = np.where(bad, np.float32("nan"), scale)
    return torch.from_numpy(data).reshape(x.shape), torch.from_numpy(scale).reshape(*lead, r // br, c // bc)


# -------------------------------------------------------------------- inputs


def _ties(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """n values that are exact E4M3 midpoints after division by 2**k (normal and subnormal bands)."""
    e = rng.integers(-6, 9, n)
    m = np.where(e == -6, rng.integers(0, 16, n), rng.integers(8, 16, n))
    return np.ldexp(m + 0.5, e - 3 + k) * rng.choice([-1.0, 1.0], n)


def _special_block(kind: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """One block of n float64 values (exactly float32) of the given kind."""
    k = int(rng.integers(-12, 12))
    v = rng.standard_normal(n)
    if kind == 0:  # plain random, random magnitude
        v = v * 2.0 ** int(rng.integers(-30, 30))
    elif kind == 1:  # float32 subnormals only (bf16 keeps some of them)
        v = np.ldexp(np.round(v * 2**10), -149 + 3)
    elif kind == 2:  # a normal amax with subnormal and tiny neighbours
        v = v * 2.0**-120
        v[: n // 2] = np.ldexp(np.round(v[: n // 2] * 2**140), -149)
    elif kind == 3:  # huge: near the float32 maximum
        v = rng.uniform(-1, 1, n) * 3.3e38
    elif kind == 4:  # all zero, some negative zeros
        v = np.where(rng.random(n) < 0.5, -0.0, 0.0)
    elif kind in (5, 6, 7):  # NaN, +inf, -inf somewhere
        v[int(rng.integers(n))] = (np.nan, np.inf, -np.inf)[kind - 5]
    elif kind == 8:  # mxfp8 floor: amax in [256, 512) * 2**k so e = k; ties and values past 448
        v = _ties(rng, n, k)
        v[0] = 256 * 2.0**k
        edges = np.array([448, 449, 450, 456, 464, 472, 479, 480, 496, 511.75]) * 2.0**k
        v[1 : 1 + min(len(edges), n - 1)] = (edges * rng.choice([-1.0, 1.0], len(edges)))[: n - 1]
    elif kind == 9:  # rceil boundary: amax = 448 * 2**k, or one float32 ulp above
        v = _ties(rng, n, k - 1)
        v[0] = 448 * 2.0**k * (1 + (2.0**-23 if rng.random() < 0.5 else 0.0))
    elif kind == 10:  # fp8-block: amax = 448 * 2**k makes the reciprocal exact, so ties survive
        v = _ties(rng, n, k - 1)
        v[0] = -448 * 2.0**k
    elif kind == 11:  # E4M3 subnormal ties (m + 1/2) * 2**-9, and values that round to zero
        v = np.ldexp(rng.integers(0, 8, n) + 0.5, -9 + k) * rng.choice([-1.0, 1.0], n)
        v[1:4] = np.array([2.0**-10, 2.0**-11, 1.5 * 2.0**-10]) * 2.0**k
        v[0] = 256 * 2.0**k
    return v.astype(np.float32).astype(np.float64)


N_KINDS = 12


def special(rows: int, cols: int, block: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, cols] with blocks of `block` along cols cycling through every kind."""
    rng = np.random.default_rng(seed)
    nb = cols // block
    out = np.empty((rows, nb, block))
    for i in range(rows):
        for j in range(nb):
            out[i, j] = _special_block((i * nb + j + seed) % N_KINDS, block, rng)
    return torch.from_numpy(out.reshape(rows, cols)).float().to(dtype)


def special_tiles(batch: int, rows: int, cols: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """[batch, rows, cols] whose 128x128 tiles each hold one kind."""
    rng = np.random.default_rng(seed)
    out = np.empty((batch, rows, cols))
    t = seed
    for b in range(batch):
        for i in range(0, rows, 128):
            for j in range(0, cols, 128):
                out[b, i : i + 128, j : j + 128] = _special_block(t % N_KINDS, 128 * 128, rng).reshape(128, 128)
                t += 1
    return torch.from_numpy(out).float().to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so that NaN == NaN and -0 != +0."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).cpu()


def assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    for g, w, what in zip(got, want, ("data", "scale")):
        assert tuple(g.shape) == tuple(w.shape), f"{what} shape {tuple(g.shape)} != {tuple(w.shape)}"
        diff = (bits(g) != bits(w)).nonzero()
        assert diff.numel() == 0, f"{what}: {diff.shape[0]} of {g.numel()} differ, first at {diff[0].tolist()}"


# ----------------------------------------------- torch functions vs the oracle


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
@pytest.mark.parametrize("dim", [1, 0])
def test_mxfp8_torch_matches_definition(dtype, rounding, dim):
    x = special(64, 256, 32, seed=dim, dtype=dtype)
    if dim == 0:
        x = x.T.contiguous()
    data, scale = mxfp8_quantize(x, dim=dim, rounding=rounding)
    assert data.dtype == torch.float8_e4m3fn and scale.dtype == torch.uint8
    assert_same((data, scale), _oracle_mxfp8(x, dim, rounding))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [(1, 128), (128, 1)])
def test_fp8_block_torch_matches_definition(dtype, block):
    x = special(64, 256, 128, seed=3, dtype=dtype)
    if block == (128, 1):
        x = x.T.contiguous()
    data, scale = fp8_block_quantize(x, block)
    assert data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert_same((data, scale), _oracle_fp8_block(x, block))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_block_weights_torch_matches_definition(dtype):
    w = special_tiles(2, 256, 384, seed=0, dtype=dtype)
    assert_same(fp8_block_quantize(w, (128, 128)), _oracle_fp8_block(w, (128, 128)))


def test_every_bf16_value_rounds_to_nearest_even():
    """Blocks [256, v, ...] have e = 0, so data = E4M3(v) for every finite bf16 |v| < 512."""
    v = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    v = v[v < 512]
    v = torch.cat([v, -v])
    v = torch.cat([v, torch.zeros((-v.numel()) % 31 + 31 * ((-(v.numel() // 31 + 1)) % 8))])
    x = torch.cat([torch.full((v.numel() // 31, 1), 256.0), v.view(-1, 31)], dim=1).bfloat16().view(-1, 256)
    want = _oracle_mxfp8(x, 1, "floor")
    assert (want[1] == 127).all()
    assert_same(mxfp8_quantize(x), want)
    assert_same(quantize_activations(x.to(DEVICE), "mxfp8", 1), want)


def test_special_blocks_get_the_documented_scales():
    x = torch.zeros(3, 128)
    x[1, 7] = float("nan")
    x[2, 0] = float("-inf")
    data, scale = mxfp8_quantize(x)
    assert scale[0].tolist() == [0] * 4  # all-zero block: e = -127
    assert scale[1].tolist() == [255, 0, 0, 0] and scale[2].tolist() == [255, 0, 0, 0]
    assert (bits(data)[1, :32] == 0x7F).all() and (bits(data)[2, :32] == 0x7F).all()
    assert (mxfp8_dequantize(data, scale)[0] == 0).all()
    data, scale = fp8_block_quantize(x)
    assert scale[0].item() == 2.0**-126  # zero block: the smallest normal float32, never 0
    assert scale[1].isnan().all() and scale[2].isnan().all()
    assert (bits(data)[1:] == 0x7F).all()
    assert (fp8_block_dequantize(data, scale)[0] == 0).all()
    assert fp8_block_dequantize(data, scale)[1:].isnan().all()


# ---------------------------------------------------------- round trips


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mxfp8_dequantize_is_exact_and_within_bound(rounding):
    x = special(64, 256, 32, seed=5, dtype=torch.float32)
    data, scale = mxfp8_quantize(x, rounding=rounding)
    out = mxfp8_dequantize(data, scale)
    s = scale.double().repeat_interleave(32, dim=1)
    exact = data.double() * torch.pow(2.0, s - 127)
    exact[s == 255] = float("nan")
    assert torch.equal(bits(out), bits(exact.float()))
    assert torch.equal(bits(mxfp8_dequantize(data, scale, dtype=torch.bfloat16)), bits(out.bfloat16()))
    # Relative error for elements that are normal E4M3 after scaling: 2**-4 from rounding, up to
    # 2**-3 where floor saturates a value in (448, 512) * 2**e.
    y = x.double() / torch.pow(2.0, s - 127)
    normal = torch.isfinite(x) & (s != 255) & (y.abs() >= 2.0**-6)
    # rceil may round |x| > 1.9375 * 2**127 up to 2**128, a value of the format that float32 cannot hold.
    overflow = normal & torch.isinf(out)
    assert (x[overflow].abs() > 1.9375 * 2.0**127).all()
    normal &= ~overflow
    rel = ((out.double() - x.double()).abs() / x.double().abs())[normal]
    assert normal.sum() > 1000
    assert rel.max() <= 2.0**-3
    if rounding == "rceil":
        assert rel.max() <= 2.0**-4
    else:
        assert rel[(y.abs() <= E4M3_MAX)[normal]].max() <= 2.0**-4


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_fp8_block_dequantize_is_exact_and_within_bound(block):
    if block == (128, 128):
        x = special_tiles(1, 128, 512, seed=7, dtype=torch.float32)[0]
    else:
        x = special(64, 256, 128, seed=2, dtype=torch.float32)
    data, scale = fp8_block_quantize(x, block)
    out = fp8_block_dequantize(data, scale, block)
    s = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    assert torch.equal(bits(out), bits((data.double() * s.double()).float()))
    # elements that are normal E4M3 after scaling (x / scale >= 2**-6, with a margin for inv's rounding)
    normal = torch.isfinite(x) & ~s.isnan() & (x.double().abs() / s.double() >= 2.0**-6 * 1.01)
    rel = ((out.double() - x.double()).abs() / x.double().abs())[normal]
    assert normal.sum() > 1000
    assert rel.max() <= 2.0**-4 * (1 + 2.0**-10)


def test_columnwise_is_rowwise_of_the_transpose():
    x = special(64, 256, 32, seed=7, dtype=torch.bfloat16)
    d0, s0 = mxfp8_quantize(x.T, dim=0)
    d1, s1 = mxfp8_quantize(x, dim=1)
    assert_same((d0.T, s0.T), (d1, s1))
    x = special(64, 256, 128, seed=8, dtype=torch.bfloat16)
    d0, s0 = fp8_block_quantize(x.T.contiguous(), (128, 1))
    assert_same((d0.T, s0.T), fp8_block_quantize(x, (1, 128)))


# ------------------------------------------------------ Triton vs torch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp8-rceil", "fp8-block"])
def test_quantize_activations_matches_torch(fmt, axis, dtype):
    block = 128 if fmt == "fp8-block" else 32
    x = special(64, 256, block, seed=axis + 10, dtype=dtype)
    if axis == 0:
        x = x.T.contiguous()  # [256, 64]: blocks along rows
    rounding = "rceil" if fmt == "mxfp8-rceil" else "floor"
    kernel_fmt = "fp8-block" if fmt == "fp8-block" else "mxfp8"
    if fmt == "fp8-block":
        want = fp8_block_quantize(x, (1, 128) if axis == 1 else (128, 1))
    else:
        want = mxfp8_quantize(x, dim=axis, rounding=rounding)
    assert_same(quantize_activations(x.to(DEVICE), kernel_fmt, axis, rounding=rounding), want)
    t = quantize_activations(x.to(DEVICE), kernel_fmt, axis, rounding=rounding, transpose=True)
    assert_same(t, (want[0].T, want[1].T))
    assert t[0].is_contiguous() and t[1].is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_weights_matches_torch(dtype):
    w = special_tiles(2, 256, 384, seed=4, dtype=dtype).to(DEVICE)
    assert_same(quantize_weights(w, "fp8-block"), fp8_block_quantize(w.cpu(), (128, 128)))
    for axis in (-1, -2):
        for rounding in ("floor", "rceil"):
            want = mxfp8_quantize(w.cpu(), dim=axis, rounding=rounding)
            assert_same(quantize_weights(w, "mxfp8", axis=axis, rounding=rounding), want)
    assert_same(quantize_weights(w[1], "mxfp8"), mxfp8_quantize(w[1].cpu()))


@pytest.mark.parametrize(
    "fmt, axis, configs",
    [
        ("mxfp8", 1, [QuantConfig(32, 32), QuantConfig(16, 128), QuantConfig(64, 512)]),
        ("mxfp8", 0, [QuantConfig(32, 16), QuantConfig(64, 64), QuantConfig(128, 256)]),
        ("fp8-block", 1, [QuantConfig(8, 128), QuantConfig(64, 256)]),
        ("fp8-block", 0, [QuantConfig(128, 16), QuantConfig(256, 64)]),
    ],
)
def test_tile_shape_does_not_change_the_result(fmt, axis, configs):
    """Every tile shape gives the torch bits, with partial tiles in both dims and strided views."""
    block = 128 if fmt == "fp8-block" else 32
    if axis == 1:
        x = special(40, 512, block, seed=12, dtype=torch.bfloat16)[:, 128:]  # [40, 384], offset rows
    else:
        x = special(96, 384, block, seed=13, dtype=torch.bfloat16).T  # [384, 96], column-major
    want = mxfp8_quantize(x, dim=axis) if fmt == "mxfp8" else fp8_block_quantize(x, (1, 128) if axis else (128, 1))
    for cfg in configs:
        assert_same(quantize_activations(x.to(DEVICE), fmt, axis, config=cfg), want)


def _gpu_test_config(fmt: str, axis: int, soft: bool | None) -> QuantConfig:
    """The explicit tile of test_compiled_kernels_match_torch_on_gpu."""
    return QuantConfig(128, 128 if axis == 0 and fmt == "fp8-block" else 256, soft_e4m3=soft)


@pytest.mark.parametrize("soft", [True, None])  # None: the hardware E4M3 path when compiled
@pytest.mark.parametrize("fmt", ["mxfp8", "fp8-block"])
@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("transpose", [False, True])
def test_gpu_test_tiles_match_torch(fmt, axis, transpose, soft):
    """The GPU test's tiles (128x256, 128x128) with the software E4M3 path, transposed or not.

    On an H200 the software path of mxfp8 rowwise 128x256 ->T wrote 0xFC for ~20% of the data: a
    ptxas miscompile (see test_sm90_builds_are_sane), which the interpreter cannot show; this covers
    the same tiles, layouts and strides, and the build check below is what catches the miscompile.
    """
    x = torch.cat([special(128, 768, 128, seed=20, dtype=torch.bfloat16),
                   (torch.randn(128, 768, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()])
    x = x.to(DEVICE)  # [256, 768]: 2 x 3 tiles of 128 x 256
    if fmt == "mxfp8":
        want = mxfp8_quantize(x.cpu(), dim=axis)
    else:
        want = fp8_block_quantize(x.cpu(), (1, 128) if axis else (128, 1))
    if transpose:
        want = (want[0].T, want[1].T)
    got = quantize_activations(x, fmt, axis, transpose=transpose, config=_gpu_test_config(fmt, axis, soft))
    assert_same(got, want)
    assert got[0].is_contiguous() and got[1].is_contiguous()


@pytest.mark.parametrize("block", [(1, 32), (32, 1), (1, 128), (128, 1), (128, 128)])
def test_default_tiles_match_torch(block):
    """Each default tile, transposed output too, with partial tiles along both dims."""
    cfg = default_config(block)
    br, bc = block
    if block == (128, 128):
        w = special_tiles(2, 384, 384, seed=32, dtype=torch.bfloat16).to(DEVICE)
        assert_same(quantize_weights(w, "fp8-block"), fp8_block_quantize(w.cpu(), block))
        return
    fmt = "mxfp8" if 32 in block else "fp8-block"
    axis = 1 if br == 1 else 0
    n = max(br, bc)  # the block; the other dim gets a partial tile
    if axis == 1:  # [2.x tiles of rows, 2 tiles + one block of cols]
        x = special(2 * cfg.block_m + 3, 2 * cfg.block_k + n, n, seed=31, dtype=torch.bfloat16)
    else:
        x = special(2 * cfg.block_k + 5, 2 * cfg.block_m + n, n, seed=31, dtype=torch.bfloat16).T
    x = x.contiguous().to(DEVICE)
    want = mxfp8_quantize(x.cpu(), dim=axis) if fmt == "mxfp8" else fp8_block_quantize(x.cpu(), block)
    assert_same(quantize_activations(x, fmt, axis), want)
    assert_same(quantize_activations(x, fmt, axis, transpose=True), (want[0].T, want[1].T))


def test_sm90_builds_are_sane():
    """Every tile the GPU test and quant_bench use, compiled for sm_90 on the CPU (ptxas, no GPU).

    No SASS may read R1, the stack pointer, for a value the PTX defines (``suspect``): these
    kernels have no stack, and such reads are how ptxas 12.8 miscompiled the old software E4M3
    path (``fp8 | sign`` on bytes, packed by LLVM into 16-bit halves) for transposed stores -- the
    H200 failure of the GPU test (0xFC, byte 1 of the stack pointer, in ~20% of the data). Also:
    no local memory, and the data leaves in 16-byte stores.
    """
    report = list(sm90_report("quant").values())
    assert len(report) >= 30
    bad = [r for r in report if r["suspect"] or r["local_memory"] or r["data_stores_16b"] == 0]
    assert not bad, bad


def test_float16_inputs():
    """fp16 (subnormals from 2**-24, overflow of the huge kinds to inf) through all three implementations."""
    x = special(64, 256, 128, seed=16, dtype=torch.float16)
    want = mxfp8_quantize(x)
    assert_same(want, _oracle_mxfp8(x, 1, "floor"))
    assert_same(quantize_activations(x.to(DEVICE), "mxfp8", 1), want)
    want = fp8_block_quantize(x)
    assert_same(want, _oracle_fp8_block(x, (1, 128)))
    assert_same(quantize_activations(x.to(DEVICE), "fp8-block", 1), want)


def test_software_e4m3_path_pinned():
    x = special(8, 256, 32, seed=14, dtype=torch.float32).to(DEVICE)
    cfg = QuantConfig(8, 256, soft_e4m3=True)
    assert_same(quantize_activations(x, "mxfp8", 1, config=cfg), mxfp8_quantize(x.cpu()))


def test_empty_and_single_row():
    x = torch.zeros(0, 64, device=DEVICE)
    d, s = quantize_activations(x, "mxfp8", 1)
    assert d.shape == (0, 64) and s.shape == (0, 2)
    assert mxfp8_quantize(x.cpu())[1].shape == (0, 2)
    x = special(1, 128, 32, seed=15, dtype=torch.float32)
    assert_same(quantize_activations(x.to(DEVICE), "mxfp8", -1), mxfp8_quantize(x))
    assert_same(quantize_activations(x.to(DEVICE), "fp8-block", -1), fp8_block_quantize(x))


# ------------------------------------------------------------ bad arguments

_F8 = torch.zeros(4, 64).to(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "call",
    [
        lambda: mxfp8_quantize(torch.zeros(4, 48)),  # 48 is not a multiple of 32
        lambda: mxfp8_quantize(torch.zeros(40, 64), dim=0),
        lambda: mxfp8_quantize(torch.zeros(4, 64), dim=2),
        lambda: mxfp8_quantize(torch.zeros(4, 64, dtype=torch.float64)),
        lambda: mxfp8_quantize(torch.zeros(4, 64, dtype=torch.int32)),
        lambda: mxfp8_quantize(torch.zeros(4, 64), rounding="ceil"),
        lambda: mxfp8_quantize([0.0] * 32),
        lambda: mxfp8_dequantize(torch.zeros(4, 64), torch.zeros(4, 2, dtype=torch.uint8)),
        lambda: mxfp8_dequantize(_F8, torch.zeros(4, 3, dtype=torch.uint8)),
        lambda: mxfp8_dequantize(_F8, torch.zeros(4, 2)),
        lambda: mxfp8_dequantize(_F8, torch.zeros(4, 2, dtype=torch.uint8), dim=0),
        lambda: mxfp8_dequantize(_F8, torch.zeros(4, 2, dtype=torch.uint8), dtype=torch.int32),
        lambda: fp8_block_quantize(torch.zeros(4, 192)),  # 192 is not a multiple of 128
        lambda: fp8_block_quantize(torch.zeros(64, 128), (128, 1)),
        lambda: fp8_block_quantize(torch.zeros(2, 64, 256), (128, 128)),
        lambda: fp8_block_quantize(torch.zeros(128, 128), (64, 64)),
        lambda: fp8_block_quantize(torch.zeros(128)),
        lambda: fp8_block_quantize(torch.zeros(4, 128, dtype=torch.float8_e4m3fn)),
        lambda: fp8_block_dequantize(_F8[:, :128].contiguous(), torch.zeros(4, 2)),
        lambda: fp8_block_dequantize(_F8[:, :128].contiguous(), torch.zeros(4, 1, dtype=torch.float64)),
        lambda: fp8_block_dequantize(_F8[:, :128].contiguous(), torch.zeros(4, 1), block=(128, 128)),
    ],
)
def test_torch_functions_reject_bad_arguments(call):
    with pytest.raises(ValueError):
        call()


@pytest.mark.parametrize(
    "call",
    [
        lambda x: quantize_activations(x[:, :48], "mxfp8", 1),
        lambda x: quantize_activations(x, "mxfp8", 0),  # 40 rows
        lambda x: quantize_activations(x, "fp8-block", 0),
        lambda x: quantize_activations(x[:, :192], "fp8-block", 1),
        lambda x: quantize_activations(x, "nvfp4", 1),
        lambda x: quantize_activations(x, "mxfp8", 2),
        lambda x: quantize_activations(x[None], "mxfp8", 1),
        lambda x: quantize_activations(x.double(), "mxfp8", 1),
        lambda x: quantize_activations(x, "fp8-block", 1, rounding="rceil"),
        lambda x: quantize_activations(x, "mxfp8", 1, rounding="up"),
        lambda x: quantize_activations(x, "mxfp8", 1, transpose=1),
        lambda x: quantize_activations(x, "mxfp8", 1, config=(32, 256)),
        lambda x: quantize_activations(x, "mxfp8", 1, config=QuantConfig(32, 16)),  # tile narrower than a block
        lambda x: quantize_activations(x, "fp8-block", 1, config=QuantConfig(32, 64)),
        lambda x: quantize_weights(x, "fp8-block"),  # 40 rows
        lambda x: quantize_weights(x[None, None], "mxfp8"),
        lambda x: quantize_weights(x[None], "mxfp8", axis=0),
        lambda x: quantize_weights(x[:, :48], "mxfp8", axis=-1),
        lambda x: QuantConfig(48, 256),
        lambda x: QuantConfig(32, 256, num_warps=0),
        lambda x: QuantConfig(32, 256, soft_e4m3="yes"),
    ],
)
def test_kernel_wrappers_reject_bad_arguments(call):
    x = torch.zeros(40, 256, device=DEVICE)
    with pytest.raises(ValueError):
        call(x)


@pytest.mark.skipif(not interpreting(), reason="only the interpreter refuses the hardware E4M3 path")
def test_interpreter_refuses_hardware_e4m3():
    with pytest.raises(ValueError, match="interpreter"):
        quantize_activations(torch.zeros(32, 64), "mxfp8", 1, config=QuantConfig(32, 64, soft_e4m3=False))


# --------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("soft", [False, True])
def test_compiled_kernels_match_torch_on_gpu(soft):
    """Compiled kernels (hardware cvt or software rounding) vs the torch functions, larger tensors."""
    torch.manual_seed(0)
    x = torch.randn(4096, 7168, device="cuda", dtype=torch.bfloat16) * 3
    x[:1024] = special(1024, 7168, 128, seed=20, dtype=torch.bfloat16).cuda()
    w = torch.randn(4, 1024, 2048, device="cuda") * 0.02
    w[0] = special_tiles(1, 1024, 2048, seed=21, dtype=torch.float32)[0].cuda()
    for fmt in ("mxfp8", "fp8-block"):
        for axis in (1, 0):
            for t in (False, True):
                cfg = QuantConfig(128, 128 if axis == 0 and fmt == "fp8-block" else 256, soft_e4m3=soft)
                got = quantize_activations(x, fmt, axis, transpose=t, config=cfg)
                got_default = quantize_activations(x, fmt, axis, transpose=t)
                if fmt == "mxfp8":
                    want = mxfp8_quantize(x, dim=axis)
                else:
                    want = fp8_block_quantize(x, (1, 128) if axis else (128, 1))
                if t:
                    want = (want[0].T, want[1].T)
                assert_same(got, want)
                assert_same(got_default, want)
    assert_same(quantize_weights(w, "fp8-block"), fp8_block_quantize(w, (128, 128)))
    for axis in (-1, -2):
        assert_same(quantize_weights(w, "mxfp8", axis=axis, rounding="rceil"), mxfp8_quantize(w, axis, "rceil"))


@pytest.mark.parametrize("fmt, torch_twin", [("mxfp8", mxfp8_quantize), ("fp8-block", fp8_block_quantize)])
def test_quantize_activations_into_out(fmt, torch_twin):
    """``out=`` writes the same bits into the given (poisoned) tensors and returns them; bad outs are refused."""
    x = special(32, 256, 32, seed=17, dtype=torch.bfloat16).to(DEVICE)
    want = torch_twin(x.cpu())
    data = torch.full(tuple(want[0].shape), float("nan"), device=DEVICE).to(torch.float8_e4m3fn)
    scale = torch.full(tuple(want[1].shape), 255 if want[1].dtype == torch.uint8 else float("nan"),
                       dtype=want[1].dtype, device=DEVICE)
    got = quantize_activations(x, fmt, 1, out=(data, scale))
    assert got[0].data_ptr() == data.data_ptr() and got[1].data_ptr() == scale.data_ptr()
    assert_same((data, scale), want)
    for bad, message in (((data[:, :128], scale), "out data"), ((data, scale.float() if fmt == "mxfp8" else
                                                                scale.double()), "out scale")):
        with pytest.raises(ValueError, match=message):
            quantize_activations(x, fmt, 1, out=bad)
    with pytest.raises(ValueError, match="transpose"):
        quantize_activations(x, fmt, 1, transpose=True, out=(data, scale))


@pytest.mark.parametrize("fmt, torch_twin", [("mxfp8", mxfp8_quantize), ("fp8-block", fp8_block_quantize)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_activations_copies_x(fmt, torch_twin, dtype):
    """``copy=`` receives x bit for bit (into a NaN-poisoned tensor) and the quantised outputs do not change; a
    copy of another shape, dtype or layout is refused."""
    x = special(48, 256, 32, seed=23, dtype=dtype).to(DEVICE)
    want = torch_twin(x.cpu())
    copy = torch.full((48, 256), float("nan"), dtype=dtype, device=DEVICE)
    assert_same(quantize_activations(x, fmt, 1, copy=copy), want)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(copy.view(bits).cpu(), x.view(bits).cpu())
    for bad in (copy[:40], copy.to(torch.float16), torch.empty(256, 48, dtype=dtype, device=DEVICE).T):
        with pytest.raises(ValueError, match="copy"):
            quantize_activations(x, fmt, 1, copy=bad)


@pytest.mark.parametrize("fmt", ["mxfp8", "fp8-block"])
@pytest.mark.parametrize("axis", [0, 1])
def test_quantize_activations_gathers_rows(fmt, axis):
    """``rows=`` quantises those rows of x in order, a zero row for each negative entry: the bits of quantising
    the gathered copy, with and without ``transpose`` and with the scales kept untransposed; bad rows are
    refused."""
    x = special(96, 256, 128, seed=29, dtype=torch.bfloat16).to(DEVICE)
    g = torch.Generator().manual_seed(5)
    rows = torch.randint(-1, 96, (256,), generator=g)
    rows[:7] = -1
    gathered = torch.where((rows >= 0)[:, None], x.cpu()[rows.clamp(min=0)], 0.0)
    want = quantize_activations(gathered.to(DEVICE), fmt, axis)
    rows = rows.to(DEVICE)
    assert_same(quantize_activations(x, fmt, axis, rows=rows), want)
    data, scale = quantize_activations(x, fmt, axis, rows=rows, transpose=True, scale_transpose=False)
    assert data.is_contiguous() and scale.is_contiguous()
    assert_same((data.T, scale), want)
    bads = [(rows.int(), "int64"), (rows[None], "1-D")] + [(rows[:200], "multiple")] * (axis == 0)
    for bad, message in bads:
        with pytest.raises(ValueError, match=message):
            quantize_activations(x, fmt, axis, rows=bad)
    with pytest.raises(ValueError, match="copy"):
        quantize_activations(x, fmt, axis, rows=rows, copy=torch.empty_like(x))
    with pytest.raises(ValueError, match="scale_transpose"):
        quantize_activations(x, fmt, axis, scale_transpose=False)


@pytest.mark.parametrize("src_fmt", ["mxfp8", "fp8-block"])
@pytest.mark.parametrize("fmt", ["mxfp8", "fp8-block"])
def test_quantize_activations_requantises_e4m3_rows(src_fmt, fmt):
    """``x_scale=``: E4M3 rows quantised along K are dequantised on load (``formats``' dequantise) and quantised
    again along the rows, gathered or not, transposed or not: the bits of quantising the dequantised copy."""
    x = special(128, 256, 128, seed=31, dtype=torch.bfloat16)
    if src_fmt == "mxfp8":
        q, s = mxfp8_quantize(x, dim=1)
        dequant = mxfp8_dequantize(q, s, dim=1)
    else:
        q, s = fp8_block_quantize(x, (1, 128))
        dequant = fp8_block_dequantize(q, s, (1, 128))
    rows = torch.randint(-1, 128, (256,), generator=torch.Generator().manual_seed(9))
    gathered = torch.where((rows >= 0)[:, None], dequant[rows.clamp(min=0)], 0.0)
    q, s, rows = q.to(DEVICE), s.to(DEVICE), rows.to(DEVICE)
    assert_same(quantize_activations(q, fmt, 0, x_scale=s), quantize_activations(dequant.to(DEVICE), fmt, 0))
    want = quantize_activations(gathered.to(DEVICE), fmt, 0)
    data, scale = quantize_activations(q, fmt, 0, x_scale=s, rows=rows, transpose=True, scale_transpose=False)
    assert_same((data.T, scale), want)
    for bad_x, bad_s in ((x.to(DEVICE), s), (q, s[:, :1]), (q, s.double())):
        with pytest.raises(ValueError, match="x_scale|float8"):
            quantize_activations(bad_x, fmt, 0, x_scale=bad_s)
