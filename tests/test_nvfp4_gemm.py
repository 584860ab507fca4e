"""te_fuser::nvfp4_gemm (tf_nvfp4_gemm_nt), NVFP4's GEMM on the CPU, bit for bit against a model of the numerics
it states, on every CPU path this machine has (AMX too: the bits do not depend on the summation order):

- each 16-value block's sum of E2M1 products times its two E4M3 scales, in float64 (exact, and exactly a float32:
  a multiple of 1/4 of at most 576 times an 8-bit scale product);
- those terms added to a float32 total in block order from +0; the total times alpha in float32; the bias added
  in float32; one rounding to the output dtype.

The operands are packed bytes (every one of the 256) and E4M3 scale codes (zero, the least subnormal and 448
among them); a NaN scale code gives NaN where it is used. Then block_gemm, which the Linear calls, against the
same model on NVFP4Quantizer's tensors (both usages), opcheck and torch.compile, and bad arguments."""

import pytest
import torch

from te_fuser.kernels import cpu
from te_fuser.kernels.gemm import nvfp4_gemm
from te_fuser.ops.block_gemm import block_gemm
from te_fuser.tensor.nvfp4_tensor import NVFP4Quantizer

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=torch.float64)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unpacked64(packed):
    """(rows, 2 * bytes) float64 E2M1 values: the low nibble first."""
    return torch.stack([E2M1[(packed & 15).long()], E2M1[(packed >> 4).long()]], dim=-1).reshape(packed.shape[0], -1)


def e4m3_values64(codes):
    return codes.view(torch.float8_e4m3fn).double()


def model(a, sa, b, sb, alpha, out_dtype, bias=None):
    """The stated numerics in float64 and float32, from packed data and E4M3 scale codes."""
    av, bv = unpacked64(a), unpacked64(b)
    blocks = av.shape[1] // 16
    sums = torch.einsum("mbk,nbk->mnb", av.reshape(a.shape[0], blocks, 16), bv.reshape(b.shape[0], blocks, 16))
    terms = (sums * e4m3_values64(sa.contiguous())[:, None, :] * e4m3_values64(sb.contiguous())[None, :, :]).float()
    total = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32)
    for kb in range(blocks):
        total = total + terms[:, :, kb]  # exact terms (the float32 conversion loses nothing), in block order
    out = total * alpha.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def random_case(generator, m, n, k, nan_scale=False, out_dtype=torch.bfloat16, bias=True):
    a = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, generator=generator)
    b = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator)
    sa = torch.randint(0, 0x7F, (m, k // 16), dtype=torch.uint8, generator=generator)
    sb = torch.randint(0, 0x7F, (k // 16, n), dtype=torch.uint8, generator=generator).t()  # strided
    sa[0, 0], sa[-1, -1], sb[0, 0] = 0x00, 0x01, 0x7E  # a zero scale, the least subnormal, 448
    if nan_scale:
        sb[n // 2, 0] = 0x7F
    alpha = torch.exp2(torch.randint(-30, 5, (), generator=generator).float()) * (1 + torch.rand((), generator=generator))
    bias_t = torch.randn(n, generator=generator).to(out_dtype) if bias else None
    return a, sa, b, sb, alpha, out_dtype, bias_t


def assert_same_bits(out, ref):
    nan = ref.float().isnan()
    assert torch.equal(out.float().isnan(), nan), "NaN in different places"
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[out.dtype]
    differ = (out.view(bits) != ref.view(bits)) & ~nan
    assert not bool(differ.any()), f"{int(differ.sum())} values differ, first at {differ.nonzero()[0].tolist()}"


# (m, n, k): tiles cut (197 = 192 + 5 rows, 130 = 128 + 2 columns), one block, several tiles, a K long enough that
# a's packed blocks exceed the fused AVX512-BF16 kernel's 16 MiB (the per-block path)
SHAPES = [(197, 130, 96), (33, 150, 48), (5, 7, 16), (300, 260, 64), (3, 40, 44000)]


@pytest.mark.parametrize("isa", cpu.available_isa())
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_matches_the_model(isa, m, n, k, out_dtype, generator):
    for nan_scale in (False, True):
        args = random_case(generator, m, n, k, nan_scale, out_dtype, bias=nan_scale)
        with cpu.isa(isa):
            out = nvfp4_gemm(*args)
        assert_same_bits(out, model(*args))
        if nan_scale:
            assert bool(out[:, n // 2].isnan().all()) and not bool(out[:, : n // 2].isnan().any())


def test_thread_counts_give_the_same_bits(generator):
    args = random_case(generator, 500, 400, 208)
    want = model(*args)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert_same_bits(nvfp4_gemm(*args), want)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows,cols", [(64, 96), (50, 70)])
def test_block_gemm_of_nvfp4_tensors(rows, cols, generator):
    """block_gemm on NVFP4Quantizer's tensors, rowwise (y = x @ W.T) and columnwise (dW = dy.T @ x, transformed
    under the Hadamard transform on both sides): the model of their data, scales and alpha =
    float32(float32(amax_a / 2688) * float32(amax_b / 2688)); ragged sizes go through the zero padding."""
    x = torch.randn(rows, cols, generator=generator, dtype=torch.bfloat16) * 3
    w = torch.randn(40, cols, generator=generator, dtype=torch.bfloat16)
    dy = torch.randn(rows, 40, generator=generator, dtype=torch.bfloat16)
    both = dict(rowwise=True, columnwise=True)
    xq, wq = NVFP4Quantizer(**both, with_rht=True)(x), NVFP4Quantizer(**both)(w)
    dyq = NVFP4Quantizer(**both, with_rht=True)(dy)
    c = torch.tensor(1.0 / 2688.0, dtype=torch.float32)
    for (a, a_col), (b, b_col) in (((xq, False), (wq, False)), ((dyq, True), (xq, True))):
        a_data, a_scales, a_amax = a._packed_operand(a_col)
        b_data, b_scales, b_amax = b._packed_operand(b_col)
        alpha = (a_amax.reshape(()) * c) * (b_amax.reshape(()) * c)
        out = block_gemm(a, a_col, b, b_col, torch.float32)
        assert out.shape == (a_data.shape[0], b_data.shape[0])
        assert_same_bits(out, model(a_data, a_scales, b_data, b_scales, alpha, torch.float32))
    # the model's operands are the tensors' values: within float32 roundings of the dequantized product
    y = block_gemm(xq, False, wq, False, torch.float32).double()
    exact = xq.dequantize(dtype=torch.float32).double() @ wq.dequantize(dtype=torch.float32).double().t()
    magnitude = xq.dequantize(dtype=torch.float32).double().abs() @ wq.dequantize(dtype=torch.float32).double().abs().t()
    assert bool(((y - exact).abs() <= (-(-cols // 16) + 8) * 2.0**-24 * magnitude).all())


def test_opcheck_and_fake_kernel(generator):
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for bias in (True, False):
        args = random_case(generator, 20, 24, 48, bias=bias)
        torch.library.opcheck(torch.ops.te_fuser.nvfp4_gemm, args, test_utils=checks)
        out = torch.compile(nvfp4_gemm, fullgraph=True)(*args)
        assert torch.equal(out, nvfp4_gemm(*args))


def test_bad_inputs_raise_clear_errors(generator):
    a, sa, b, sb, alpha, out_dtype, bias = random_case(generator, 4, 6, 32)
    cases = [
        (lambda: nvfp4_gemm(a.to(torch.int16), sa, b, sb, alpha), TypeError, "a must have dtype"),
        (lambda: nvfp4_gemm(a, sa, b[:, :8].contiguous(), sb[:, :1], alpha), ValueError, "b must have a.shape"),
        (lambda: nvfp4_gemm(a[:, :12], sa, b, sb, alpha), ValueError, "a must be 2-D packed E2M1 data"),
        (lambda: nvfp4_gemm(torch.zeros(16, 4, dtype=torch.uint8).t(), sa, b, sb, alpha), ValueError,
         "a must be contiguous"),
        (lambda: nvfp4_gemm(a, sa[:, :1], b, sb, alpha), ValueError, "a_scales must have shape \\(4, 2\\)"),
        (lambda: nvfp4_gemm(a, sa, b, sb.float(), alpha), TypeError, "b_scales must have dtype"),
        (lambda: nvfp4_gemm(a, sa, b, sb, alpha.double()), TypeError, "alpha must be a float32 tensor"),
        (lambda: nvfp4_gemm(a, sa, b, sb, torch.ones(2)), TypeError, "alpha must be a float32 tensor"),
        (lambda: nvfp4_gemm(a, sa, b, sb, alpha, torch.int32), ValueError, "out_dtype must be one of"),
        (lambda: nvfp4_gemm(a, sa, b, sb, alpha, torch.float32, torch.zeros(5)), ValueError,
         "bias must have shape \\(6,\\)"),
        (lambda: nvfp4_gemm(a, sa, b, sb.to("meta"), alpha), ValueError, "b_scales is on meta"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
