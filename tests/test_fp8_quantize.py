"""FP8 quantizer kernels against torch's own float8 casts and plain-Python formulas.

Every test runs once per instruction-set path of the CPU kernels that this machine has
(te_fuser.kernels.cpu caps the tier): the quantizer has a portable path, an AVX2 one and an
AVX-512 one, which the higher tiers also take.
"""

import pytest
import torch

from te_fuser.kernels import cpu
from te_fuser.kernels import fp8 as k
from fp8_reference import (
    FLOAT_DTYPES, FP8_DTYPES, all_16bit_patterns, edge_values, fp8_max, random_decades,
    reference_amax, reference_quantize,
)


ISA_PATHS = [tier for tier in ("portable", "avx2", "avx512") if tier in cpu.available_isa()]
CHUNK = 1 << 16  # elements per task of the CPU binding (kGrainElements)


@pytest.fixture(autouse=True, params=ISA_PATHS)
def isa_path(request):
    """The CPU kernels' tier for the test; CUDA tests run once, under the highest one."""
    if "device" in request.fixturenames and request.getfixturevalue("device").type != "cpu":
        if request.param != ISA_PATHS[-1]:
            pytest.skip("the tier applies to the CPU kernels only")
    with cpu.isa(request.param):
        assert cpu.current_isa() == request.param
        yield request.param


def as_bytes(t):
    return t.view(torch.uint8)


def quantize(x, scale, fp8_dtype):
    amax = torch.zeros(1, device=x.device)
    data = k.quantize(x, scale, amax, fp8_dtype)
    return data, amax


def scales(generator):
    """1, a power of two, and a random non-power-of-two scale."""
    return [1.0, 2.0**-7, float(torch.empty(1).uniform_(0.1, 10.0, generator=generator))]


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_encoding_bit_exact_random_and_edges(device, generator, dtype, fp8_dtype):
    x = torch.cat([random_decades(100_003, dtype, generator), edge_values(fp8_dtype, dtype)]).to(device)
    for s in scales(generator):
        scale = torch.tensor([s], device=device)
        data, _ = quantize(x, scale, fp8_dtype)
        assert data.dtype == fp8_dtype and data.shape == x.shape
        torch.testing.assert_close(as_bytes(data), as_bytes(reference_quantize(x, scale, fp8_dtype)), rtol=0, atol=0)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_encoding_bit_exact_every_16bit_value(device, dtype, fp8_dtype):
    x = all_16bit_patterns(dtype).to(device)
    for s in (1.0, 0.5, 3.0):
        scale = torch.tensor([s], device=device)
        data, _ = quantize(x, scale, fp8_dtype)
        torch.testing.assert_close(as_bytes(data), as_bytes(reference_quantize(x, scale, fp8_dtype)), rtol=0, atol=0)


# The AVX2 path has two encoders: a fast one for positive finite scales (for E4M3 at least 2^-118,
# so that scale * 2^-8 is a normal float) and a generic one for the rest. These scales take each
# side of every boundary; no infinite or NaN scale, where torch's NaN sign rules are its own.
ENCODER_SCALES = [2.0**-118, 2.0**-118 * (1 - 2.0**-24), 2.0**-140, 1e30, 3.4e38, -1.7, -(2.0**-7), 0.0, -0.0]


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_encoding_bit_exact_scales_of_both_encoders(device, generator, dtype, fp8_dtype):
    if dtype == torch.float32:
        bits = torch.randint(-(2**31), 2**31 - 1, (100_000,), generator=generator, dtype=torch.int64)
        x = torch.cat([bits.to(torch.int32).view(torch.float32), random_decades(10_007, dtype, generator, -45, 38)])
    else:
        x = all_16bit_patterns(dtype)
    x = torch.cat([x, edge_values(fp8_dtype, dtype)]).to(device)
    for s in ENCODER_SCALES:
        scale = torch.tensor([s], device=device)
        data, amax = quantize(x, scale, fp8_dtype)
        torch.testing.assert_close(as_bytes(data), as_bytes(reference_quantize(x, scale, fp8_dtype)), rtol=0, atol=0,
                                   msg=lambda m: f"scale {s!r}: {m}")
        ref_amax = reference_amax(x)
        assert amax.isnan().item() if ref_amax.isnan() else amax.item() == ref_amax.item()
        n = x.numel() // 96 * 96
        data, data_t = k.cast_transpose(x[:n].view(-1, 96), scale, amax, fp8_dtype)
        expected = reference_quantize(x[:n].view(-1, 96), scale, fp8_dtype)
        torch.testing.assert_close(as_bytes(data), as_bytes(expected), rtol=0, atol=0)
        torch.testing.assert_close(as_bytes(data_t), as_bytes(expected).t(), rtol=0, atol=0)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_encoding_bit_exact_random_float32_bits(device, generator, fp8_dtype):
    """Random bit patterns reach every float32 exponent, float32 subnormals and NaN payloads."""
    bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=generator, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32).to(device)
    scale = torch.ones(1, device=device)
    data, _ = quantize(x, scale, fp8_dtype)
    torch.testing.assert_close(as_bytes(data), as_bytes(reference_quantize(x, scale, fp8_dtype)), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_saturation_inf_and_nan(device, dtype):
    nan_bits = {torch.float32: 0xFFC00000, torch.bfloat16: 0xFFC0, torch.float16: 0xFE00}[dtype]
    negative_nan = torch.tensor([nan_bits], dtype=torch.int64).to(
        {torch.float32: torch.int32}.get(dtype, torch.int16)).view(dtype)
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, 1e4, -1e4], dtype=dtype)
    x[3] = negative_nan[0]
    x = x.to(device)
    data, _ = quantize(x, torch.ones(1, device=device), torch.float8_e4m3fn)
    assert as_bytes(data).tolist() == [0x7E, 0xFE, 0x7F, 0xFF, 0x7E, 0xFE]
    data, _ = quantize(x, torch.ones(1, device=device), torch.float8_e5m2)
    # E5M2 has an Inf, but satfinite gives the largest finite value (0x7B = 57344); 1e4 is in range.
    assert as_bytes(data).tolist()[:4] == [0x7B, 0xFB, 0x7F, 0xFF]
    assert data.float()[4:].tolist() == [10240.0, -10240.0]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_amax_is_max_abs_and_accumulates(device, generator, dtype):
    x = random_decades(70_001, dtype, generator, low=-5, high=3).to(device)
    scale = torch.ones(1, device=device)
    amax = torch.zeros(1, device=device)
    k.quantize(x, scale, amax, torch.float8_e4m3fn)
    assert amax.item() == reference_amax(x).item()
    k.quantize(x / 4, scale, amax, torch.float8_e4m3fn)  # a smaller tensor keeps the running max
    assert amax.item() == reference_amax(x).item()
    assert k.compute_amax(x).item() == reference_amax(x).item()


@pytest.mark.parametrize("special", [float("inf"), float("nan")])
def test_amax_sees_inf_and_nan(device, generator, special):
    x = torch.randn(100_000, generator=generator).to(device)
    x[77_777] = special
    amax = k.compute_amax(x)
    if special != special:
        assert amax.isnan().item()
    else:
        assert amax.item() == float("inf")
    quant_amax = torch.zeros(1, device=device)
    k.quantize(x, torch.ones(1, device=device), quant_amax, torch.float8_e5m2)
    torch.testing.assert_close(quant_amax, amax, equal_nan=True)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_dequantize_matches_reference(device, generator, dtype, fp8_dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype)
    random_codes = torch.randint(0, 256, (50_001,), generator=generator, dtype=torch.int32).to(torch.uint8).view(fp8_dtype)
    data = torch.cat([codes, random_codes]).to(device)
    for s_inv in (1.0, 2.0**-10, float(torch.empty(1).uniform_(0.01, 100, generator=generator))):
        scale_inv = torch.tensor([s_inv], device=device)
        out = k.dequantize(data, scale_inv, dtype)
        expected = (data.float() * scale_inv).to(dtype)
        assert out.dtype == dtype
        torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
# (1000, 160) and (517, 200): tall (128-row) and 64-row tiles and ragged edges in one band;
# (320, 96): the same with 32-byte aligned rows, which the AVX2 path writes with streaming stores;
# (256, 4160) and (130, 4165): rows wider than one AVX-512 panel (4096 columns), the first with
# y and y_t streamed, the second with a ragged edge and bottom rows.
@pytest.mark.parametrize("shape", [(1, 1), (33, 65), (64, 512), (3, 70, 31), (2049, 7), (1000, 160), (517, 200),
                                   (320, 96), (256, 4160), (130, 4165)])
def test_cast_transpose(device, generator, dtype, fp8_dtype, shape):
    x = (torch.randn(shape, generator=generator) * 50).to(dtype).to(device)
    x.view(-1)[0] = float("inf")
    scale = torch.tensor([1.7], device=device)
    amax = torch.zeros(1, device=device)
    data, data_t = k.cast_transpose(x, scale, amax, fp8_dtype)
    expected = reference_quantize(x, scale, fp8_dtype)
    torch.testing.assert_close(as_bytes(data), as_bytes(expected), rtol=0, atol=0)
    as_matrix = as_bytes(expected).reshape(-1, shape[-1])
    torch.testing.assert_close(as_bytes(data_t), as_matrix.t().contiguous(), rtol=0, atol=0)
    assert amax.item() == float("inf")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_amax_at_chunk_boundaries(device, generator, dtype):
    """The maximum just before, on and after each boundary of the CPU's work split, and last.

    quantize splits the elements into chunks of CHUNK; cast_transpose of this (2049, 96)
    matrix splits its rows into bands of 704 (whole 64-row tiles of about CHUNK elements)."""
    x = torch.randn(3 * CHUNK + 96, generator=generator).to(dtype).to(device)
    band = 704 * 96
    positions = [0, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK - 1, 3 * CHUNK,
                 band - 1, band, 2 * band - 1, 2 * band, x.numel() - 1]
    one = torch.ones(1, device=device)
    for p in positions:
        y = x.clone()
        y[p] = -100.0
        amax = torch.zeros(1, device=device)
        k.quantize(y, one, amax, torch.float8_e4m3fn)
        assert amax.item() == 100.0, f"quantize, position {p}"
        assert k.compute_amax(y).item() == 100.0, f"compute_amax, position {p}"
        amax.zero_()
        k.cast_transpose(y.view(-1, 96), one, amax, torch.float8_e5m2)
        assert amax.item() == 100.0, f"cast_transpose, position {p}"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_paths_agree_with_flushed_denormals(generator, isa_path, dtype):
    """Under torch.set_flush_denormal(True) (FTZ and DAZ), a SIMD path gives the portable bytes."""
    if isa_path == "portable":
        pytest.skip("compares the other paths with the portable one")
    if dtype == torch.float32:
        bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=generator, dtype=torch.int64)
        x = bits.to(torch.int32).view(torch.float32)
    else:
        x = all_16bit_patterns(dtype)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        for s in (1.0, 2.0**-100, 3.0):
            scale = torch.tensor([s])
            for fp8_dtype in FP8_DTYPES:
                data, amax = quantize(x, scale, fp8_dtype)
                with cpu.isa("portable"):
                    ref, ref_amax = quantize(x, scale, fp8_dtype)
                torch.testing.assert_close(as_bytes(data), as_bytes(ref), rtol=0, atol=0)
                assert amax.view(torch.int32).item() == ref_amax.view(torch.int32).item()
    finally:
        torch.set_flush_denormal(False)


def test_empty_tensors_work(device):
    for shape in [(0,), (0, 16), (16, 0)]:
        x = torch.empty(shape, device=device)
        scale = torch.ones(1, device=device)
        amax = torch.zeros(1, device=device)
        assert k.quantize(x, scale, amax, torch.float8_e4m3fn).shape == shape
        assert amax.item() == 0.0
        assert k.compute_amax(x).item() == 0.0
        if len(shape) == 2:
            data, data_t = k.cast_transpose(x, scale, amax, torch.float8_e4m3fn)
            assert data.shape == shape and data_t.shape == (shape[1], shape[0] if shape[1] else 0)
        data = k.quantize(x, scale, amax, torch.float8_e5m2)
        assert k.dequantize(data, scale, torch.bfloat16).shape == shape


def test_fp8_max_values():
    assert k.fp8_max(torch.float8_e4m3fn) == 448.0
    assert k.fp8_max(torch.float8_e5m2) == 57344.0


def _boundaries(n, log2_chunks):
    """First and last element of every chunk, for chunks of 2^k elements (k in log2_chunks), and the ends."""
    edges = {c * 2**k + d for k in log2_chunks for c in (1, 2, 3) for d in (-1, 0)}
    return sorted(p for p in edges | {0, n - 1} if 0 <= p < n)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_amax_at_chunk_boundaries(device, generator, dtype):
    """The ops split the tensor into chunks (2^16 elements on the CPU): a maximum at the first or
    last element of any chunk, or at the tensor's last element, must reach amax through the op."""
    n = 3 * 2**16 + 1000
    x = (torch.rand(n, generator=generator) * 2 - 1).to(dtype).to(device)  # |x| < 1
    scale = torch.ones(1, device=device)
    for position in _boundaries(n, (4, 7, 10, 13, 15, 16, 17)):
        peak = -7.5 if position % 2 else 7.5
        x[position] = peak
        amax = torch.zeros(1, device=device)
        k.quantize(x, scale, amax, torch.float8_e4m3fn)
        found = (amax.item(), k.compute_amax(x).item())
        x[position] = 0.5
        assert found == (7.5, 7.5), f"max at element {position} of {n}: amax (quantize, compute_amax) = {found}"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_cast_transpose_amax_at_band_boundaries(device, generator, dtype):
    """cast_transpose works in bands of rows: the maximum at the first or last element of a band."""
    rows, cols = 3 * 2**11 + 37, 48
    x = (torch.rand(rows, cols, generator=generator) * 2 - 1).to(dtype).to(device)
    scale = torch.ones(1, device=device)
    for row in _boundaries(rows, (3, 5, 7, 9, 11)):
        for col in (0, cols - 1):
            x[row, col] = 7.5
            amax = torch.zeros(1, device=device)
            k.cast_transpose(x, scale, amax, torch.float8_e5m2)
            x[row, col] = 0.5
            assert amax.item() == 7.5, f"max at ({row}, {col}) of {tuple(x.shape)}: amax {amax.item()}"
