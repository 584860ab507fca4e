"""CUDA block-scaled quantizers (MXFP8, Float8 block scaling, NVFP4): the same bytes as the CPU kernels.

The CPU kernels are checked against independent float64 references in test_fp8_block_quantize.py and
test_nvfp4_quantize.py; here every output of the CUDA op (data, scales with their padding, amaxes) is compared
bit for bit with the CPU op's for the same input: ragged sizes (partial last blocks), every FP8 code point,
all-zero, Inf, NaN and tiny blocks, and NVFP4's 2D blocks, Hadamard transform and seeded stochastic rounding.
The kernels themselves also run without a GPU, under the host emulation (make c-check/emulated-block).
"""

import pytest
import torch

from fp8_reference import FLOAT_DTYPES, FP8_DTYPES, random_decades
from te_fuser._extension import has_cuda_kernels
from te_fuser.kernels import fp8_block as fk
from te_fuser.kernels import nvfp4 as nk

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and has_cuda_kernels()),
                                reason="CUDA and te_fuser's CUDA kernels are not available")

CUDA = torch.device("cuda")


def bits(t):
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(gpu_out, cpu_out):
    """Each output of the CUDA op has the CPU one's shape, dtype and bits (None where a usage is off)."""
    assert len(gpu_out) == len(cpu_out)
    for i, (got, want) in enumerate(zip(gpu_out, cpu_out)):
        if want is None:
            assert got is None, f"output {i}"
            continue
        assert got.device.type == "cuda", f"output {i} is on {got.device}"
        assert got.dtype == want.dtype and got.shape == want.shape, f"output {i}"
        mismatch = (bits(got) != bits(want)).nonzero()
        assert mismatch.numel() == 0, (f"output {i}: {mismatch.shape[0]} elements differ, first at "
                                       f"{mismatch[0].tolist()}")


def edge_matrix(rows, cols, dtype, generator, block_rows, block_cols, finite=False):
    """Values over many decades with whole blocks all zero, tiny (subnormal scales), holding Inf or NaN."""
    low, high = (-6, 4) if dtype == torch.float16 else (-20, 20)
    x = random_decades(rows * cols, torch.float64, generator, low=low, high=high).reshape(rows, cols)
    tiny = 1e-3 if dtype == torch.float16 else 1e-38
    for i, r in enumerate(range(0, rows, block_rows)):
        for j, c in enumerate(range(0, cols, block_cols)):
            kind = (i * 7 + j * 3) % 6
            block = x[r:r + block_rows, c:c + block_cols]
            if kind == 0:
                block.zero_()
            elif kind == 1:
                block.mul_(tiny)
            elif kind == 2 and not finite:
                block[0, -1] = float("inf")
            elif kind == 3 and not finite:
                block[-1, 0] = -float("nan")
    return x.to(dtype)


def code_point_matrix(rows, cols, dtype, values, max_value):
    """Row 0 and column 0 hold +-max (those blocks quantize with scale 1); the rest cycles through values."""
    n = (rows - 1) * (cols - 1)
    x = torch.full((rows, cols), max_value, dtype=torch.float64)
    x[0, 1::2] = -max_value
    x[1:, 1:] = values.double().repeat(n // values.numel() + 1)[:n].reshape(rows - 1, cols - 1)
    return x.to(dtype)


def fp8_code_values(fp8_dtype):
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).float()


RAGGED = [(1, 1), (31, 33), (33, 129), (130, 127), (257, 300), (3, 4, 70)]


@pytest.mark.parametrize("usage", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_mxfp8_same_bytes_as_cpu(generator, dtype, fp8_dtype, usage):
    for shape in RAGGED:
        x = edge_matrix(shape[0] * (shape[1] if len(shape) == 3 else 1), shape[-1], dtype, generator, 32, 32)
        x = x.reshape(shape)
        assert_same(fk.mxfp8_quantize(x.to(CUDA), fp8_dtype, *usage), fk.mxfp8_quantize(x, fp8_dtype, *usage))
    max_value = torch.finfo(fp8_dtype).max
    x = code_point_matrix(64, 96, dtype, fp8_code_values(fp8_dtype), max_value)
    assert_same(fk.mxfp8_quantize(x.to(CUDA), fp8_dtype, *usage), fk.mxfp8_quantize(x, fp8_dtype, *usage))


@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_fp8_block_same_bytes_as_cpu(generator, dtype, fp8_dtype, block_dim):
    for shape in RAGGED:
        rows = shape[0] * (shape[1] if len(shape) == 3 else 1)
        x = edge_matrix(rows, shape[-1], dtype, generator, 128 if block_dim == 2 else 1, 128).reshape(shape)
        for eps, pow2 in ((0.0, False), (0.0, True), (1e-4, True)):
            for usage in ((True, True), (True, False), (False, True)):
                args = (fp8_dtype, block_dim, eps, pow2, *usage)
                assert_same(fk.fp8_block_quantize(x.to(CUDA), *args), fk.fp8_block_quantize(x, *args))
    x = code_point_matrix(128, 256, dtype, fp8_code_values(fp8_dtype), torch.finfo(fp8_dtype).max)
    args = (fp8_dtype, block_dim, 0.0, False, True, True)
    assert_same(fk.fp8_block_quantize(x.to(CUDA), *args), fk.fp8_block_quantize(x, *args))


NVFP4_MODES = {  # (block_2d, rht, stochastic)
    "1d": (False, False, False), "2d": (True, False, False), "rht": (False, True, False),
    "stochastic": (False, False, True), "rht_stochastic": (False, True, True), "2d_stochastic": (True, False, True),
}


@pytest.mark.parametrize("mode", sorted(NVFP4_MODES))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_nvfp4_same_bytes_as_cpu(generator, dtype, mode):
    block_2d, rht, stochastic = NVFP4_MODES[mode]
    for shape in [(16, 16), (32, 48), (48, 272), (160, 144), (2, 8, 512), (1, 1), (5, 7), (37, 131), (3, 7, 150)]:
        rows = shape[0] * (shape[1] if len(shape) == 3 else 1)
        x = edge_matrix(rows, shape[-1], dtype, generator, 16, 16, finite=True).reshape(shape)
        for seed in (0, 7, 2**62 + 3):
            for usage in ((True, True), (True, False), (False, True)):
                args = (*usage, block_2d, rht, stochastic, seed)
                assert_same(nk.nvfp4_quantize(x.to(CUDA), *args), nk.nvfp4_quantize(x, *args))
            if not stochastic:
                break
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x = code_point_matrix(32, 64, dtype, torch.cat([grid, -grid]), 6.0)
    x[31, 63] = 2688.0  # a global amax of 448 * 6: blocks of amax 6 quantize with multiplier 1
    args = (True, True, block_2d, rht, stochastic, 5)
    assert_same(nk.nvfp4_quantize(x.to(CUDA), *args), nk.nvfp4_quantize(x, *args))


@pytest.mark.parametrize("layout", [(1, 32, False), (32, 1, False), (1, 128, True), (128, 128, False)])
@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float32])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_block_dequantize_same_bytes_as_cpu(generator, dtype, fp8_dtype, scale_dtype, layout):
    """Every FP8 code under every E8M0 code, or float32 scales with Inf, NaN and subnormals, ragged edges."""
    block_rows, block_cols, transposed = layout
    rows, cols = 130, 257
    data = torch.arange(rows * cols, dtype=torch.int64).remainder(256).to(torch.uint8)
    data = data[torch.randperm(data.numel(), generator=generator)].view(fp8_dtype).reshape(rows, cols)
    shape = (-(-rows // block_rows), -(-cols // block_cols))
    shape = shape[::-1] if transposed else shape
    n = shape[0] * shape[1]
    if scale_dtype == torch.uint8:
        scale = torch.arange(n, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(shape)
    else:
        scale = random_decades(n, torch.float32, generator, low=-44, high=38).reshape(shape)
        scale.view(-1)[::17] = torch.tensor([float("inf"), float("nan"), 0.0, 1e-45])[torch.arange(n)[::17] % 4]
    args = (block_rows, block_cols, transposed, dtype)
    gpu = fk.block_dequantize(data.to(CUDA), scale.to(CUDA), *args)
    assert_same((gpu,), (fk.block_dequantize(data, scale, *args),))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_nvfp4_dequantize_same_bytes_as_cpu(generator, dtype):
    rows, cols = 48, 272
    data = torch.randint(0, 256, (rows, cols // 2), generator=generator, dtype=torch.int64).to(torch.uint8)
    scale = torch.randint(0, 256, nk.nvfp4_scale_shape((rows, cols), False), generator=generator).to(torch.uint8)
    scale[(scale & 0x7F) == 0x7F] ^= 1  # no NaN block scale: the quantizer never writes one
    for amax in (0.0, 1.0, 2688.0, 3e-30, 1e30):
        amax = torch.tensor([amax])
        gpu = nk.nvfp4_dequantize(data.to(CUDA), scale.to(CUDA), amax.to(CUDA), dtype)
        assert_same((gpu,), (nk.nvfp4_dequantize(data, scale, amax, dtype),))
