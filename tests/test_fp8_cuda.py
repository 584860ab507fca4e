"""CUDA FP8 quantizer kernels: the same bytes as the CPU kernels, and torch's float8 casts where NaN is absent.

The CPU kernels are checked against torch's casts in test_fp8_quantize.py; here every CUDA result is compared
bit for bit with the CPU result for the same input and scale (NaN signs and payloads, amax bits, scale bits
included), and with torch on the GPU where NaN does not occur (torch's GPU multiply drops a NaN's sign).
Sizes and offsets reach the vector tails and the misaligned scalar paths, and large tensors the grid-stride loops.
"""

import numpy as np
import pytest
import torch

from te_fuser._extension import has_cuda_kernels
from te_fuser.kernels import fp8 as k
from fp8_reference import (
    FLOAT_DTYPES, FP8_DTYPES, all_16bit_patterns, edge_values, fp8_max, random_decades, reference_quantize,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")

CUDA = torch.device("cuda")
_ops = torch.ops.te_fuser


def bits(t):
    """The raw bit pattern of a tensor, on the CPU, as integers."""
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(got, expected):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    mismatch = (bits(got) != bits(expected)).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.shape[0]} elements differ, first at {mismatch[0].tolist()}"


def quantize_on(device, x, scale, fp8_dtype, amax_start=0.0):
    amax = torch.tensor([amax_start], device=device)
    data = k.quantize(x.to(device), torch.tensor([scale], device=device), amax, fp8_dtype)
    return data, amax


def nan_free_reference(x, scale, fp8_dtype):
    return reference_quantize(x, torch.tensor([scale], device=x.device), fp8_dtype)


def nans(dtype, negative=True):
    """NaN of one sign with two payloads in dtype: a quiet one and one with only the lowest payload bit."""
    raw = {torch.float32: [0x7FC00000, 0x7F800001], torch.bfloat16: [0x7FC0, 0x7F81],
           torch.float16: [0x7E00, 0x7C01]}[dtype]
    sign = {torch.float32: 0x80000000, torch.bfloat16: 0x8000, torch.float16: 0x8000}[dtype] if negative else 0
    as_int = torch.tensor([r | sign for r in raw], dtype=torch.int64).to(torch.int32)
    return (as_int if dtype == torch.float32 else as_int.to(torch.int16)).view(dtype)


SPECIALS = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-45, -2.0, 1e38])


def sprinkle_specials(t, generator):
    """Overwrites about a quarter of t's entries with SPECIALS, in place."""
    flat = t.view(-1)
    pick = torch.randint(0, 4 * len(SPECIALS), (flat.numel(),), generator=generator)
    hit = pick < len(SPECIALS)
    flat[hit] = SPECIALS[pick[hit]]
    return t


def test_cuda_kernels_are_built():
    assert has_cuda_kernels(), "CUDA is available but te_fuser._C was built without its CUDA kernels"


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_same_bytes_as_cpu(generator, dtype, fp8_dtype):
    x = torch.cat([random_decades(50_001, dtype, generator), edge_values(fp8_dtype, dtype), nans(dtype)])
    if dtype != torch.float32:
        x = torch.cat([x, all_16bit_patterns(dtype)])
    for scale in (1.0, 2.0**-5, float(torch.empty(1).uniform_(0.1, 10.0, generator=generator)), 3e4):
        cpu_data, cpu_amax = quantize_on("cpu", x, scale, fp8_dtype, amax_start=1e-3)
        gpu_data, gpu_amax = quantize_on(CUDA, x, scale, fp8_dtype, amax_start=1e-3)
        assert_same_bits(gpu_data, cpu_data)
        assert_same_bits(gpu_amax, cpu_amax)
        assert gpu_amax.isnan().item()  # the input holds NaN


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_quantize_float32_bit_patterns_same_as_cpu(generator, fp8_dtype):
    """Random bit patterns: every exponent, float32 subnormals, NaN payloads of both signs."""
    x = torch.randint(-(2**31), 2**31 - 1, (300_001,), generator=generator, dtype=torch.int64)
    x = x.to(torch.int32).view(torch.float32)
    cpu_data, cpu_amax = quantize_on("cpu", x, 0.75, fp8_dtype)
    gpu_data, gpu_amax = quantize_on(CUDA, x, 0.75, fp8_dtype)
    assert_same_bits(gpu_data, cpu_data)
    assert_same_bits(gpu_amax, cpu_amax)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_nan_sign_survives_the_scale_multiply(dtype):
    x = torch.cat([nans(dtype), nans(dtype, negative=False)]).to(CUDA)
    for fp8_dtype in FP8_DTYPES:
        data, amax = quantize_on(CUDA, x, 2.0, fp8_dtype)
        assert bits(data).tolist() == [0xFF, 0xFF, 0x7F, 0x7F]
        assert amax.isnan().item() and bits(amax).item() > 0  # the sign bit is cleared


@pytest.mark.parametrize("offset", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_odd_sizes_and_misaligned_pointers(generator, dtype, offset):
    """Vector tails, and views whose data pointer is not 16-byte aligned (the scalar fallback)."""
    base = random_decades(5000, dtype, generator, low=-6, high=4)
    for n in (0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 255, 4099):
        x = base[offset:offset + n]
        for fp8_dtype in FP8_DTYPES:
            gpu_data, gpu_amax = quantize_on(CUDA, x, 1.5, fp8_dtype)
            cpu_data, cpu_amax = quantize_on("cpu", x, 1.5, fp8_dtype)
            assert_same_bits(gpu_data, cpu_data)
            assert_same_bits(gpu_amax, cpu_amax)
            gpu_x = base.to(CUDA)[offset:offset + n]
            assert_same_bits(k.quantize(gpu_x, torch.tensor([1.5], device=CUDA), torch.zeros(1, device=CUDA),
                                        fp8_dtype), cpu_data)
            assert_same_bits(gpu_data, nan_free_reference(x.to(CUDA), 1.5, fp8_dtype))
            assert_same_bits(k.compute_amax(gpu_x), k.compute_amax(x))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_large_tensors_cover_the_grid_stride_loops(generator, dtype):
    """More vectors than the grid has threads; the amax sits in the last element, then in a tail element."""
    n = (1 << 23) + 5
    x = (torch.rand(n, generator=generator) * 2 - 1).to(dtype).to(CUDA)
    for where in (n - 6, n - 1):
        x[where] = -3.5
        for fp8_dtype in FP8_DTYPES:
            data, amax = quantize_on(CUDA, x, 100.0, fp8_dtype)
            assert amax.item() == 3.5
            assert_same_bits(data, nan_free_reference(x, 100.0, fp8_dtype))
        assert k.compute_amax(x).item() == 3.5
        x[where] = 0.0


def test_amax_empty_and_negative_start_same_as_cpu():
    """An empty input still folds into amax, and a negative stored amax counts by magnitude, as on the CPU."""
    for device in ("cpu", CUDA):
        assert bits(k.compute_amax(torch.empty(0, device=device))).item() == 0
    for start in (-7.0, -0.0, 2.0):
        for x in (torch.empty(0), torch.tensor([1.0, -3.0]), torch.tensor([-9.0])):
            _, cpu_amax = quantize_on("cpu", x, 1.0, torch.float8_e4m3fn, amax_start=start)
            _, gpu_amax = quantize_on(CUDA, x, 1.0, torch.float8_e4m3fn, amax_start=start)
            assert_same_bits(gpu_amax, cpu_amax)
            assert gpu_amax.item() == max(abs(start), x.abs().max().item() if x.numel() else 0.0)


@pytest.mark.parametrize("offset", [0, 1, 5])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_dequantize_same_bits_as_cpu(generator, dtype, fp8_dtype, offset):
    """All codes, NaN included, from views at byte offsets that misalign the vector loads and stores."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    random_codes = torch.randint(0, 256, (10_007,), generator=generator, dtype=torch.int32).to(torch.uint8)
    raw = torch.cat([codes, random_codes])
    cpu_data = raw[offset:].view(fp8_dtype)
    gpu_data = raw.to(CUDA)[offset:].view(fp8_dtype)
    for s_inv in (1.0, 2.0**-10, 3.3e-3, 7.25):
        cpu = k.dequantize(cpu_data, torch.tensor([s_inv]), dtype)
        gpu = k.dequantize(gpu_data, torch.tensor([s_inv], device=CUDA), dtype)
        assert_same_bits(gpu, cpu)
        expected = (gpu_data.float() * s_inv).to(dtype)
        finite = ~expected.isnan()
        assert_same_bits(gpu[finite], expected[finite])
        assert torch.equal(gpu.isnan(), expected.isnan())
    # A NaN scale_inv on the codes that are not NaN (with both NaN, the CPU's pick depends on operand order).
    cpu_nan = k.dequantize(cpu_data, torch.tensor([float("nan")]), dtype)
    gpu_nan = k.dequantize(gpu_data, torch.tensor([float("nan")], device=CUDA), dtype)
    not_nan_code = ~cpu_data.float().isnan()
    assert_same_bits(gpu_nan[not_nan_code.to(CUDA)], cpu_nan[not_nan_code])


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (31, 33), (32, 32), (33, 31), (64, 96), (65, 127), (3, 40, 70),
                                   (1000, 1), (1, 1000), (0, 9), (9, 0), (2, 0, 3)])
def test_cast_transpose_same_bytes_as_cpu(generator, dtype, fp8_dtype, shape):
    x = random_decades(max(1, torch.Size(shape).numel()), dtype, generator, low=-4, high=4)
    x = x[:torch.Size(shape).numel()].reshape(shape)
    if x.numel():
        x.view(-1)[x.numel() // 2] = nans(dtype)[0]
    cpu_amax = torch.tensor([0.5])
    gpu_amax = torch.tensor([0.5], device=CUDA)
    cpu_data, cpu_t = k.cast_transpose(x, torch.tensor([2.5]), cpu_amax, fp8_dtype)
    gpu_data, gpu_t = k.cast_transpose(x.to(CUDA), torch.tensor([2.5], device=CUDA), gpu_amax, fp8_dtype)
    assert_same_bits(gpu_data, cpu_data)
    assert_same_bits(gpu_t, cpu_t)
    assert_same_bits(gpu_amax, cpu_amax)
    rows = x.numel() // shape[-1] if shape[-1] else 0
    assert_same_bits(gpu_t, gpu_data.reshape(rows, shape[-1]).t().contiguous())
    assert_same_bits(gpu_data, k.quantize(x.to(CUDA), torch.tensor([2.5], device=CUDA),
                                          torch.zeros(1, device=CUDA), fp8_dtype))


def test_cast_transpose_large_matrix_matches_reference(generator):
    """More tiles than the grid has blocks."""
    x = torch.randn(4100, 3001, generator=generator).to(torch.bfloat16).to(CUDA)
    amax = torch.zeros(1, device=CUDA)
    data, data_t = k.cast_transpose(x, torch.tensor([30.0], device=CUDA), amax, torch.float8_e4m3fn)
    expected = nan_free_reference(x, 30.0, torch.float8_e4m3fn)
    assert_same_bits(data, expected)
    assert_same_bits(data_t, expected.t().contiguous())
    assert amax.item() == x.float().abs().max().item()


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 3, -2])
@pytest.mark.parametrize("history_len,n", [(1, 1), (2, 3), (16, 1000)])
def test_delayed_scaling_update_same_bits_as_cpu(generator, algo, margin, history_len, n):
    history = sprinkle_specials(
        random_decades(history_len * n, torch.float32, generator, low=-10, high=10).abs().reshape(history_len, n),
        generator)
    history[0, ::3] = 0.0  # tensors that recorded nothing: kept as they are
    scale = random_decades(n, torch.float32, generator, low=-3, high=3).abs()
    scale[0] = float("nan")  # an old scale that is kept must come back bit for bit
    cpu = [history, scale, torch.ones(n)]
    gpu = [t.to(CUDA) for t in cpu]
    cpu = [t.clone() for t in cpu]
    k.delayed_scaling_update(*cpu, 448.0, margin, algo)
    k.delayed_scaling_update(*gpu, 448.0, margin, algo)
    for g, c in zip(gpu, cpu):
        assert_same_bits(g, c)
    assert (gpu[0][0] == 0).all()  # row 0 reset, or 0 (or -0) already: nothing recorded


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("epsilon", [0.0, 1e-3])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_current_scale_same_bits_as_cpu(generator, pow2, epsilon, fp8_dtype):
    amaxes = [0.0, -0.0, float("inf"), float("nan"), 1e-45, 1e-6, 3.0, 448.0, 1e38]
    amaxes += random_decades(20, torch.float32, generator, low=-8, high=8).abs().tolist()
    for a in amaxes:
        cpu = k.current_scale(torch.tensor([a]), fp8_max(fp8_dtype), epsilon, pow2)
        gpu = k.current_scale(torch.tensor([a], device=CUDA), fp8_max(fp8_dtype), epsilon, pow2)
        for g, c in zip(gpu, cpu):
            assert g.device.type == "cuda"
            assert_same_bits(g, c)


def test_ops_run_on_the_current_stream():
    """The input is written on a side stream behind a long sleep; an op on the default stream would read zeros."""
    src = torch.full((1 << 20,), 3.0, device=CUDA)
    x = torch.zeros_like(src)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        x.copy_(src)
        amax = torch.zeros(1, device=CUDA)
        data = k.quantize(x, torch.ones(1, device=CUDA), amax, torch.float8_e4m3fn)
        computed = k.compute_amax(x)
        scale, _ = k.current_scale(computed, 448.0)
    side.synchronize()
    # The kernel divides in float32 (fp8_max / amax, IEEE-rounded: no fast math): 149.33333, not 448 / 3 in double.
    # numpy's float32 division is IEEE-rounded too; torch's CPU division of a tensor may be an ulp off.
    assert amax.item() == 3.0 and computed.item() == 3.0 and scale.item() == float(np.float32(448.0) / np.float32(3.0))
    assert data.float().eq(3.0).all()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_a_second_gpu():
    dev = torch.device("cuda", 1)
    x = torch.linspace(-5, 5, 10_001, device=dev)
    with torch.cuda.device(0):
        amax = torch.zeros(1, device=dev)
        data = k.quantize(x, torch.ones(1, device=dev), amax, torch.float8_e5m2)
        data_t = k.cast_transpose(x.reshape(1, -1), torch.ones(1, device=dev), amax, torch.float8_e5m2)[1]
    assert data.device == dev and amax.item() == 5.0
    assert_same_bits(data, nan_free_reference(x, 1.0, torch.float8_e5m2))
    assert_same_bits(data_t.reshape(-1), data)


def test_raw_ops_reject_bad_arguments():
    x = torch.ones(8, device=CUDA)
    shared = torch.ones(1, device=CUDA)
    with pytest.raises(RuntimeError, match="share memory"):
        _ops.fp8_quantize(x, shared, shared, torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="same device"):
        _ops.fp8_quantize(x, torch.ones(1), torch.zeros(1, device=CUDA), torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="contiguous"):
        _ops.fp8_amax(torch.ones(8, 8, device=CUDA).t())
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        _ops.fp8_amax(torch.ones(8, device=CUDA, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="margin"):
        _ops.fp8_delayed_scaling_update(torch.zeros(2, 1, device=CUDA), torch.ones(1, device=CUDA),
                                        torch.ones(1, device=CUDA), 448.0, 200, 0)
    with pytest.raises(RuntimeError, match="outside its domain"):
        _ops.fp8_delayed_scaling_update(torch.zeros(2, 1, device=CUDA), torch.ones(1, device=CUDA),
                                        torch.ones(1, device=CUDA), 448.0, 0, 7)
