"""The table path of the CPU quantizer: on the portable and avx2 paths, bfloat16/float16 tensors of at
least 2^21 elements (TF_FP8_TABLE_MIN_ELEMENTS in csrc/fp8/fp8_quantize.h) are quantized through a
per-call table of the FP8 code of every 16-bit pattern (the avx512 path encodes them directly). Checked against torch's float8 casts on every pattern
(NaN, Inf, subnormals and -0 included), shuffled, with random scales and saturating ones, under
each instruction-set path. Cast-transpose has no table path (it measured no gain there).
"""

import pytest
import torch

from te_fuser.kernels import fp8 as k
from fp8_reference import FP8_DTYPES, all_16bit_patterns, reference_amax, reference_quantize
from test_fp8_quantize import as_bytes, isa_path  # noqa: F401 (isa_path: the autouse fixture over the CPU tiers)

TABLE_MIN_ELEMENTS = 1 << 21
DTYPES_16 = [torch.bfloat16, torch.float16]


def every_pattern_shuffled(dtype, numel, generator):
    """numel elements holding every 16-bit pattern at least once (then random ones), in a random order."""
    patterns = all_16bit_patterns(dtype)
    rest = patterns[torch.randint(0, 2**16, (numel - 2**16,), generator=generator)]
    x = torch.cat([patterns, rest])
    return x[torch.randperm(numel, generator=generator)]


def random_scales(generator):
    """1, random scales over many decades (both signs), and scales that saturate most values."""
    spread = torch.pow(10.0, torch.empty(4, dtype=torch.float64).uniform_(-6, 6, generator=generator))
    return [1.0, *spread.tolist(), -float(spread[0]), 1e30, 3.0e38, 2.0**-140, 0.0]


def without_nan(x, generator):
    """x with its NaNs replaced by random finite values, so that the amax is a number."""
    finite = torch.randn(x.shape, generator=generator).to(x.dtype)
    return torch.where(x.isnan(), finite, x)


def assert_same_amax(amax, x):
    ref = reference_amax(x)
    if ref.isnan():
        assert amax.isnan().item()
    else:
        assert amax.item() == ref.item()


def test_inputs_take_the_table_path(generator):
    """Every test input holds every bit pattern and is as large as the threshold."""
    for dtype in DTYPES_16:
        for numel in (TABLE_MIN_ELEMENTS, TABLE_MIN_ELEMENTS + 37):
            x = every_pattern_shuffled(dtype, numel, generator)
            assert x.numel() >= TABLE_MIN_ELEMENTS and x.view(torch.int16).unique().numel() == 2**16


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES_16)
def test_quantize_every_pattern(generator, dtype, fp8_dtype):
    x = every_pattern_shuffled(dtype, TABLE_MIN_ELEMENTS + 37, generator)
    for data_x in (x, without_nan(x, generator)):
        for s in random_scales(generator):
            scale = torch.tensor([s])
            amax = torch.zeros(1)
            data = k.quantize(data_x, scale, amax, fp8_dtype)
            torch.testing.assert_close(as_bytes(data), as_bytes(reference_quantize(data_x, scale, fp8_dtype)),
                                       rtol=0, atol=0, msg=lambda m: f"scale {s!r}: {m}")
            assert_same_amax(amax, data_x)


@pytest.mark.parametrize("dtype", DTYPES_16)
def test_table_and_scale_paths_agree_at_the_threshold(generator, dtype):
    """Just below the threshold (the scale path) and at it (the table path): the same bytes, amax bits."""
    x = every_pattern_shuffled(dtype, TABLE_MIN_ELEMENTS, generator)
    scale = torch.tensor([float(torch.empty(1).uniform_(0.1, 100.0, generator=generator))])
    for fp8_dtype in FP8_DTYPES:
        amax_small, amax_large = torch.zeros(1), torch.zeros(1)
        small = k.quantize(x[:-1], scale, amax_small, fp8_dtype)
        large = k.quantize(x, scale, amax_large, fp8_dtype)
        assert torch.equal(as_bytes(small), as_bytes(large)[:-1])
        amax_rest = torch.zeros(1)
        k.quantize(x[-1:], scale, amax_rest, fp8_dtype)
        combined = torch.maximum(amax_small.view(torch.int32), amax_rest.view(torch.int32))
        assert torch.equal(combined, amax_large.view(torch.int32))


def test_float16_nan_payload_amax(generator):
    """A signalling float16 NaN widens to a larger float32 pattern than a quiet one: the table path
    reports the same amax bits as the amax kernel, which works in float32 bits."""
    x = torch.randn(TABLE_MIN_ELEMENTS, generator=generator).to(torch.float16)
    bits = x.view(torch.int16)
    bits[1000] = 0x7E00  # quiet NaN, the larger 16-bit pattern
    bits[1_600_000] = 0x7C01  # signalling NaN, widened to 0x7FC02000
    amax = torch.zeros(1)
    k.quantize(x, torch.tensor([2.0]), amax, torch.float8_e4m3fn)
    assert amax.view(torch.int32).item() == k.compute_amax(x).view(torch.int32).item() == 0x7FC02000
