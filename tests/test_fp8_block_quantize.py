"""Block-scaled FP8 kernels (MXFP8, Float8 block scaling, their dequantize) bit for bit against the
independent float64 references of block_scaling_reference.py.

Every test runs once per instruction-set path of the CPU kernels this machine has (the quantizers
are built for the baseline, x86-64-v3 and x86-64-v4 and picked by te_fuser.kernels.cpu's tier).
"""

import math

import pytest
import torch

import block_scaling_reference as ref
from fp8_reference import FLOAT_DTYPES, FP8_DTYPES, all_16bit_patterns, random_decades
from te_fuser.kernels import cpu
from te_fuser.kernels import fp8_block as k

ISA_PATHS = [tier for tier in ("portable", "avx2", "avx512") if tier in cpu.available_isa()]
SHAPES = [(1, 1), (31, 33), (33, 100), (129, 300), (2, 3, 160), (17, 15), (200, 127), (70, 1060)]


@pytest.fixture(autouse=True, params=ISA_PATHS)
def isa_path(request):
    with cpu.isa(request.param):
        yield request.param


def codes(t):
    return t.view(torch.uint8)


def special_input(shape, dtype, generator):
    """Values over many decades with all-zero, Inf-holding and NaN-holding blocks, tiny blocks whose
    scale v is a float32 subnormal, and whole rows of each."""
    x = random_decades(math.prod(shape), torch.float64, generator, low=-30, high=30).reshape(-1, shape[-1])
    rows, cols = x.shape
    x[::7] = 0.0
    x[:, ::11] = 0.0
    x[3::13, 1::5] = math.inf
    x[5::17, 2::7] = -math.inf
    x[4::9, ::3] = math.nan
    x[6::19] = math.nan
    x[2::23] *= 1e-42  # v = amax / fp8_max below float32's normal range
    return x.to(dtype).reshape(shape)


def every_code(fp8_dtype, dtype, scale_exponent):
    """Rows of 32 whose values are every finite FP8 value times 2^e, each row holding the largest one
    (so a block's scale is exactly 2^e): every code point must come back."""
    values = ref.fp8_decode(torch.arange(256, dtype=torch.int32).to(torch.uint8), fp8_dtype)
    finite = values[torch.isfinite(values)]
    fmax = ref.FP8_GRID[fp8_dtype][2]
    per_row = 31
    padded = torch.cat([finite, finite[: (-len(finite)) % per_row]])
    rows = padded.reshape(-1, per_row)
    x = torch.cat([rows, torch.full((rows.shape[0], 1), fmax, dtype=torch.float64)], dim=1)
    return (x * 2.0**scale_exponent).to(dtype)


def padding_is_zero(scale, rows, cols):
    rest = scale.clone()
    rest[:rows, :cols] = 0
    return bool(rest.eq(0).all())


def check_mxfp8(x, fp8_dtype):
    x2 = x.reshape(-1, x.shape[-1])
    rows, cols = x2.shape
    data, scale, col_data, col_scale = k.mxfp8_quantize(x, fp8_dtype, rowwise=True, columnwise=True)
    assert data.shape == x.shape and col_data.shape == x.shape and data.dtype == fp8_dtype
    assert tuple(scale.shape) == k.mxfp8_scale_shape(x.shape, False) and scale.dtype == torch.uint8
    assert tuple(col_scale.shape) == k.mxfp8_scale_shape(x.shape, True)
    want, want_scale = ref.mxfp8_quantize(x2, fp8_dtype)
    want_col, want_col_scale = ref.mxfp8_quantize(x2, fp8_dtype, columnwise=True)
    assert torch.equal(codes(data).reshape(rows, cols), want)
    assert torch.equal(codes(col_data).reshape(rows, cols), want_col)
    nb, nrb = -(-cols // 32), -(-rows // 32)
    assert torch.equal(scale[:rows, :nb], want_scale) and torch.equal(col_scale[:nrb, :cols], want_col_scale)
    assert padding_is_zero(scale, rows, nb) and padding_is_zero(col_scale, nrb, cols)
    return data, scale, col_data, col_scale


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_mxfp8_bit_exact(generator, shape, dtype, fp8_dtype):
    check_mxfp8(special_input(shape, dtype, generator), fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("e", [0, -20, 25, -126])
def test_mxfp8_every_code_point(fp8_dtype, e):
    x = every_code(fp8_dtype, torch.float32, e)
    data, _, _, _ = check_mxfp8(x, fp8_dtype)
    if e > -120:  # the block's scale is 2^e, so each value is its own code
        assert torch.equal(codes(data), ref.fp8_encode(x.double() / 2.0**e, fp8_dtype))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mxfp8_every_16bit_value(dtype, fp8_dtype):
    check_mxfp8(all_16bit_patterns(dtype).reshape(-1, 256), fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_mxfp8_scale_code_edges(generator, fp8_dtype):
    """Blocks whose amax / fp8_max lands on each edge of the E8M0 rounding: a power of two (kept), one
    ulp above it (rounded up), 2^-127 (code 0, kept) and just above it, 2^-149, the float32 maximum and
    Inf. Each amax heads a block rowwise and a block columnwise (the block's other elements smaller)."""
    fp8_max = 448.0 if fp8_dtype == torch.float8_e4m3fn else 57344.0
    targets = [2.0**e for e in (-149, -130, -127, -126, -125, -60, 0, 1, 100, 127)]
    amaxes = []
    for v in targets:
        a = torch.tensor(v * fp8_max, dtype=torch.float64).float()  # amax * rcp is v where it rounds so
        amaxes += [a, torch.nextafter(a, torch.tensor(math.inf)), torch.nextafter(a, torch.tensor(0.0))]
    amaxes += [torch.tensor(torch.finfo(torch.float32).max), torch.tensor(math.inf)]
    amax = torch.stack(amaxes).float()
    n = amax.numel()
    x = (torch.rand(32 * n, 64, generator=generator) * 0.5 + 0.25) * amax.repeat_interleave(32)[:, None]
    x[torch.isnan(x)] = 0.0
    x[::32, ::32] = amax.repeat_interleave(1)[:, None]  # each 32-row group's first row: the amax itself
    check_mxfp8(x, fp8_dtype)
    check_mxfp8(x.t().contiguous(), fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_mxfp8_dequantize(generator, dtype, fp8_dtype):
    x = special_input((129, 300), torch.float32, generator)
    data, scale, col_data, col_scale = k.mxfp8_quantize(x, fp8_dtype, True, True)
    for columnwise, d, s in ((False, data, scale), (True, col_data, col_scale)):
        block = (32, 1) if columnwise else (1, 32)
        got = k.block_dequantize(d, s, *block, dtype=dtype)
        want = ref.mxfp8_dequantize(codes(d), s, fp8_dtype, dtype, columnwise)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def check_block(x, fp8_dtype, block_dim, eps, pow2):
    x2 = x.reshape(-1, x.shape[-1])
    rows, cols = x2.shape
    data, s_inv, data_t, s_inv_t = k.fp8_block_quantize(x, fp8_dtype, block_dim, eps, pow2, True, True)
    assert data.shape == x.shape and data_t.shape == (x.shape[-1], *x.shape[:-1])
    assert tuple(s_inv.shape) == k.fp8_block_scale_shape(x.shape, block_dim, False)
    assert tuple(s_inv_t.shape) == k.fp8_block_scale_shape(x.shape, block_dim, True)
    want, want_s = ref.float8_block_quantize(x2, fp8_dtype, block_dim, eps, pow2)
    want_t, want_s_t = ref.float8_block_quantize(x2, fp8_dtype, block_dim, eps, pow2, columnwise=True)
    assert torch.equal(codes(data).reshape(rows, cols), want)
    assert torch.equal(codes(data_t).reshape(cols, rows), want_t)
    rb, cb = -(-rows // 128), -(-cols // 128)
    if block_dim == 1:  # TE keeps the 1D scales transposed: [column block][row]
        got_s, got_s_t = s_inv[:cb, :rows].t(), s_inv_t[:rb, :cols].t()
    else:
        got_s, got_s_t = s_inv[:rb, :cb], s_inv_t[:cb, :rb]
    assert torch.equal(got_s.double(), want_s) and torch.equal(got_s_t.double(), want_s_t)
    if block_dim == 1:
        assert padding_is_zero(s_inv, cb, rows) and padding_is_zero(s_inv_t, rb, cols)
    else:
        assert padding_is_zero(s_inv, rb, cb) and padding_is_zero(s_inv_t, cb, rb)
    return data, s_inv, data_t, s_inv_t


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (127, 129), (300, 200), (2, 3, 160)])
def test_float8_block_bit_exact(generator, shape, dtype, fp8_dtype, block_dim, pow2):
    check_block(special_input(shape, dtype, generator), fp8_dtype, block_dim, 0.0, pow2)


@pytest.mark.parametrize("eps", [1e-3, 2.0**-130, 1e30])
@pytest.mark.parametrize("block_dim", [1, 2])
def test_float8_block_amax_epsilon(generator, block_dim, eps):
    check_block(special_input((130, 260), torch.bfloat16, generator), torch.float8_e4m3fn, block_dim, eps, True)


@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float8_block_every_16bit_value(dtype, block_dim):
    check_block(all_16bit_patterns(dtype).reshape(256, 256), torch.float8_e4m3fn, block_dim, 0.0, False)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_float8_block_every_code_point(fp8_dtype):
    """With scale 1 (amax = fp8_max in every 1x128 tile) each FP8 value is its own code."""
    x = every_code(fp8_dtype, torch.float32, 0).flatten()
    x = torch.cat([x, x.new_full(((-len(x)) % 127,), ref.FP8_GRID[fp8_dtype][2])]).reshape(-1, 127)
    x = torch.cat([x, x.new_full((x.shape[0], 1), ref.FP8_GRID[fp8_dtype][2])], dim=1)
    data, s_inv, _, _ = check_block(x, fp8_dtype, 1, 0.0, False)
    assert torch.equal(codes(data), ref.fp8_encode(x.double(), fp8_dtype))


@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_float8_block_dequantize(generator, dtype, block_dim):
    x = special_input((300, 200), torch.float32, generator)
    data, s_inv, data_t, s_inv_t = k.fp8_block_quantize(x, torch.float8_e5m2, block_dim, 0.0, False, True, True)
    block = (1, 128) if block_dim == 1 else (128, 128)
    for d, s in ((data, s_inv), (data_t, s_inv_t)):
        got = k.block_dequantize(d, s, *block, scale_transposed=block_dim == 1, dtype=dtype)
        rows, cols = d.shape
        unpadded = s[: -(-cols // 128), :rows].t() if block_dim == 1 else s[: -(-rows // 128), : -(-cols // 128)]
        want = ref.float8_block_dequantize(codes(d), unpadded.double(), torch.float8_e5m2, dtype, block_dim)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_usages_and_fake_kernels():
    x = torch.randn(3, 40, 96)
    data, scale, col_data, col_scale = k.mxfp8_quantize(x, torch.float8_e4m3fn, rowwise=False, columnwise=True)
    assert data is None and scale is None and col_data.shape == x.shape
    meta = x.to("meta")
    for real, fake in zip(k.fp8_block_quantize(x, torch.float8_e4m3fn, 2, 0.0, True, True, True),
                          k.fp8_block_quantize(meta, torch.float8_e4m3fn, 2, 0.0, True, True, True)):
        assert real.shape == fake.shape and real.dtype == fake.dtype
    for real, fake in zip(k.mxfp8_quantize(x, torch.float8_e5m2, True, True),
                          k.mxfp8_quantize(meta, torch.float8_e5m2, True, True)):
        assert real.shape == fake.shape and real.dtype == fake.dtype


def test_bad_arguments_name_themselves():
    x = torch.randn(64, 64)
    with pytest.raises(TypeError, match="x must have dtype"):
        k.mxfp8_quantize(x.double(), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8_dtype"):
        k.mxfp8_quantize(x, torch.float16)
    with pytest.raises(ValueError, match="x must be contiguous"):
        k.mxfp8_quantize(x.t(), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="rowwise and columnwise"):
        k.fp8_block_quantize(x, torch.float8_e4m3fn, 1, rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="block_dim"):
        k.fp8_block_quantize(x, torch.float8_e4m3fn, 3)
    with pytest.raises(ValueError, match="amax_epsilon"):
        k.fp8_block_quantize(x, torch.float8_e4m3fn, 1, amax_epsilon=-1.0)
    data, scale, _, _ = k.mxfp8_quantize(x, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="does not cover"):
        k.block_dequantize(data, scale[:, :1].contiguous(), 1, 32)
    with pytest.raises(TypeError, match="scale must have dtype"):
        k.block_dequantize(data, scale.float().double(), 1, 32)
    with pytest.raises(ValueError, match="block_rows"):
        k.block_dequantize(data, scale, 0, 32)
