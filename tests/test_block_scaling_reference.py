"""The float64 references of block-scaled FP8 (block_scaling_reference.py) against torch's own float8
casts and against the facts docs/block_scaling.md takes from TransformerEngine's source."""

import math

import pytest
import torch

import block_scaling_reference as ref
from fp8_reference import FP8_DTYPES, all_16bit_patterns


def torch_codes(v64, fp8_dtype):
    """torch's cast of float32 values, saturated, NaN -> 0x7F with the sign."""
    m = torch.finfo(fp8_dtype).max
    codes = v64.float().clamp(-m, m).to(fp8_dtype).view(torch.uint8)
    nan_code = torch.where(torch.signbit(v64), 0xFF, 0x7F).to(torch.uint8)
    return torch.where(v64.isnan(), nan_code, codes)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_encode_matches_torch_casts(fp8_dtype, generator):
    bits = torch.randint(-(2**31), 2**31 - 1, (500_000,), generator=generator, dtype=torch.int64)
    near = torch.ldexp(torch.rand(500_000, generator=generator, dtype=torch.float64) * 4 - 2,
                       torch.randint(-24, 18, (500_000,), generator=generator))
    v = torch.cat([bits.to(torch.int32).view(torch.float32).double(), near.float().double(),
                   all_16bit_patterns(torch.bfloat16).double(), all_16bit_patterns(torch.float16).double()])
    assert torch.equal(ref.fp8_encode(v, fp8_dtype), torch_codes(v, fp8_dtype))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_decode_matches_torch(fp8_dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    mine, theirs = ref.fp8_decode(codes, fp8_dtype), codes.view(fp8_dtype).double()
    assert torch.equal(mine.isnan(), theirs.isnan())
    assert torch.equal(mine[~mine.isnan()], theirs[~theirs.isnan()])


def test_mxfp8_scale_code_facts():
    amax = torch.tensor([448.0, 448.0 + 2.0**-15, 224.0, 0.0, math.inf, 3.4e38, 2.0**-140, 2.0**-118],
                        dtype=torch.float64).float().double()
    codes = ref.mxfp8_scale_code(amax, torch.float8_e4m3fn).tolist()
    # 448 -> 2^0; above it -> 2^1 (rounded up); zero -> 2^-127; Inf -> 2^127 (satfinite);
    # v <= 2^-127 -> code 0; v in (2^-127, 2^-126] -> code 1.
    assert codes == [127, 128, 126, 0, 254, 127 + 120, 0, 1]
    assert ref.mxfp8_scale_code(torch.tensor([57344.0], dtype=torch.float64), torch.float8_e5m2).item() == 127


def test_mxfp8_scale_code_is_ceil_log2_where_normal(generator):
    """docs/block_scaling.md: the float32 reciprocal moves no normal v across a power of two."""
    k = torch.arange(-120, 120, dtype=torch.float64)  # 448 * 2^k finite in float32
    centres = (448.0 * torch.pow(2.0, k)).float()
    steps = torch.arange(-6, 7, dtype=torch.int32)
    amax = (centres.view(torch.int32)[:, None] + steps[None, :]).view(torch.float32).flatten()
    amax = torch.cat([amax, torch.rand(100_000, generator=generator).mul(448).float()]).double()
    codes = ref.mxfp8_scale_code(amax, torch.float8_e4m3fn).long()
    normal = amax * (1 / 448) >= torch.finfo(torch.float32).smallest_normal
    upper = 448.0 * torch.pow(2.0, (codes - 127).double())
    assert bool(((amax <= upper) & (amax > upper / 2))[normal].all())


def test_float8_block_scale_facts():
    amax = torch.tensor([0.0, math.inf, 7.0, 3.0, 2.0**-140], dtype=torch.float64)
    scale, scale_inv = ref.float8_block_scale(amax, torch.float8_e4m3fn, torch.float32)
    assert scale.tolist() == [1.0, 1.0, 64.0, float(torch.tensor(448 / 3).float()), torch.finfo(torch.float32).max]
    assert scale_inv[2].item() == 1 / 64
    pow2, _ = ref.float8_block_scale(amax, torch.float8_e4m3fn, torch.bfloat16, pow2=True)
    assert pow2.tolist() == [1.0, 1.0, 64.0, 128.0, 2.0**127]
    bf16, _ = ref.float8_block_scale(amax[4:], torch.float8_e4m3fn, torch.bfloat16)
    assert bf16.item() == torch.finfo(torch.bfloat16).max  # TE: the input dtype's largest value
    eps, _ = ref.float8_block_scale(torch.zeros(1, dtype=torch.float64), torch.float8_e4m3fn, torch.float32,
                                    epsilon=0.5)
    assert eps.item() == 896.0


def test_special_blocks():
    """Zero, Inf and NaN blocks as docs/block_scaling.md derives them."""
    x = torch.zeros(3, 32, dtype=torch.float32)
    x[1, 0], x[1, 1] = math.inf, 3e38
    x[2, :] = math.nan
    x[2, 5] = 2.0
    codes, scales = ref.mxfp8_quantize(x, torch.float8_e4m3fn)
    assert scales.flatten().tolist() == [0, 254, ref.mxfp8_scale_code(torch.tensor([2.0], dtype=torch.float64),
                                                                      torch.float8_e4m3fn).item()]
    assert codes[0].eq(0).all() and codes[1, 0] == 0x7E and codes[1, 2:].eq(0).all()
    assert codes[2, 0] == 0x7F and codes[2, 5] == 0x78  # NaN; 2.0 under the scale 2^-7 is 256
    back = ref.mxfp8_dequantize(codes, scales, torch.float8_e4m3fn, torch.float32)
    assert back[1, 0] == math.inf and back[2, 5] == 2.0 and back[2, 0].isnan()
    q, s_inv = ref.float8_block_quantize(x, torch.float8_e4m3fn, block_dim=1)
    assert s_inv.flatten().tolist() == [1.0, 1.0, float(torch.tensor(1 / 224).float())]  # zero, Inf: scale 1
    assert q[1, 0] == q[1, 1] == 0x7E and q[2, 5] == 0x7E and q[2, 0] == 0x7F
