"""megamoe.kernels.convert: float32 -> bfloat16 through the bits rounds as torch (and the GPU) do."""

import torch
import triton
import triton.language as tl

from megamoe.kernels.convert import bf16_to_f32, f32_to_bf16


@triton.jit
def _round_trip_kernel(x_ptr, out_ptr, back_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    y = f32_to_bf16(tl.load(x_ptr + offs, mask=ok))
    tl.store(out_ptr + offs, y, mask=ok)
    tl.store(back_ptr + offs, bf16_to_f32(y), mask=ok)


def _values() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    bits = torch.randint(-(2**31), 2**31 - 1, (4096,), generator=g, dtype=torch.int64).to(torch.int32)
    ties = (torch.randint(0, 2**15, (512,), generator=g, dtype=torch.int32) << 16) | 0x8000  # exactly halfway
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.4e38, -3.4e38, 1e-40, -1e-45,
                             2.0**-126, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8], dtype=torch.float32)
    return torch.cat([bits.view(torch.float32), ties.view(torch.float32), -ties.view(torch.float32), specials])


def test_f32_to_bf16_gives_torchs_bits_and_keeps_nans_quiet():
    x = _values()
    out = torch.full(x.shape, 7.0, dtype=torch.bfloat16)
    back = torch.full(x.shape, 7.0)
    _round_trip_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, back, x.numel(), BLOCK=1024)
    want = x.bfloat16()
    nan = x.isnan()
    assert torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16))
    got_nan = out[nan].view(torch.int16).int() & 0xFFFF
    assert out[nan].isnan().all() and ((got_nan & 0x40) != 0).all()  # quiet
    assert torch.equal(got_nan >> 15, (x[nan].view(torch.int32) >> 31) & 1)  # the sign kept
    assert torch.equal(back[~nan], want[~nan].float()) and back[nan].isnan().all()
