"""te_fuser::block_scaled_gemm (csrc/gemm/block_scaled_gemm.c), the GEMM of the block-scaled recipes, bit for
bit against two references on every CPU path this machine has:

- a float32 torch model of the numerics te_fuser.ops.block_gemm states: each K block (the last one shorter
  when K is ragged) summed from +0 one exact product at a time, in k order on the float32 paths and by pairs
  of k (the odd product, then the even one: vdpbf16ps's order) on AVX512-BF16; the block's sum times
  float32(a_scale * b_scale) added to a float32 total in block order; the bias added; one rounding;
- the Python loop block_scaled_gemm_nt ran before the kernel: fp8_gemm on each block's columns with unit
  scales, combined in torch (the only reference on AMX, whose pair order this file does not model).

NaN compares as NaN (its payload and sign are not asserted); every other value compares by its bits."""

import pytest
import torch

from te_fuser.kernels import cpu
from te_fuser.kernels.gemm import block_scaled_gemm, fp8_gemm
from te_fuser.ops.block_gemm import block_scaled_gemm_nt, e8m0_values, gemm_operand
from te_fuser.tensor.mxfp8_tensor import MXFP8Quantizer, MXFP8Tensor

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ISAS = cpu.available_isa()
MODELLED = [name for name in ISAS if name != "amx"]
EDGE_SCALES = (float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 2.0**-149, 2.0**-127, 3.0e38, -1.5)


def random_fp8(shape, dtype, generator, finite=True):
    """Uniform over the FP8 codes (subnormals, zeros of both signs; NaN and Inf unless finite)."""
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator).view(dtype)
    return torch.where(x.float().isfinite(), x.float(), 0.0).to(dtype) if finite else x


def random_scales(rows, blocks, generator, edge=True, strided=False):
    """Powers of two and odd values over a wide range, a few edge values (NaN, +-Inf, zeros, subnormals,
    the largest floats); strided: a transposed view, as gemm_operand hands over columnwise scales."""
    s = torch.exp2(torch.randint(-20, 8, (rows, blocks), generator=generator).float())
    s = s * torch.where(torch.rand(rows, blocks, generator=generator) < 0.5, 1.0, 1.375)
    if edge and s.numel():
        picks = torch.randint(0, s.numel(), (max(1, s.numel() // 20),), generator=generator)
        values = torch.tensor(EDGE_SCALES)[torch.randint(0, len(EDGE_SCALES), picks.shape, generator=generator)]
        s.view(-1)[picks] = values
    return s.t().contiguous().t() if strided else s


def block_sum(a, b, pairs):
    """sum_k a[:, k] b[:, k] as the tier's kernel adds it: float32, from +0, in k order or by pairs (odd
    product first; a missing odd k at a ragged end is a zero pad)."""
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32)
    af, bf = a.float(), b.float()
    products = [af[:, i, None] * bf[None, :, i] for i in range(a.shape[1])]  # exact in float32
    if not pairs:
        for p in products:
            acc = acc + p
        return acc
    for i in range(0, len(products), 2):
        if i + 1 < len(products):
            acc = acc + products[i + 1]
        acc = acc + products[i]
    return acc


def reference(a, sa, b, sb, block, out_dtype, bias, block_product):
    total = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32)
    for kb, k0 in enumerate(range(0, a.shape[1], block)):
        cols = slice(k0, k0 + block)
        total = total + block_product(a[:, cols], b[:, cols]) * (sa[:, kb, None] * sb[None, :, kb])
    if bias is not None:
        total = total + bias.float()
    return total.to(out_dtype)


def model(isa):
    return lambda a, b: block_sum(a, b, pairs=isa in ("avx512_bf16", "amx"))


def fp8_gemm_per_block(a, b):
    one = torch.ones(1)
    return fp8_gemm(a.contiguous(), one, b.contiguous(), one, torch.float32)


def assert_same_bits(out, ref):
    nan = ref.float().isnan()
    assert torch.equal(out.float().isnan(), nan), "NaN in different places"
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[out.dtype]
    differ = (out.view(bits) != ref.view(bits)) & ~nan
    assert not bool(differ.any()), f"{int(differ.sum())} values differ, first at {differ.nonzero()[0].tolist()}"


def random_case(generator, m, n, k, block, dtypes=(torch.float8_e4m3fn, torch.float8_e5m2), finite=True,
                edge=True, out_dtype=torch.bfloat16, bias=True):
    blocks = -(-k // block)
    a = random_fp8((m, k), dtypes[0], generator, finite)
    b = random_fp8((n, k), dtypes[1], generator, finite)
    sa = random_scales(m, blocks, generator, edge)
    sb = random_scales(n, blocks, generator, edge, strided=True)
    bias_t = torch.randn(n, generator=generator).to(out_dtype) if bias else None
    return a, sa, b, sb, block, out_dtype, bias_t


# (m, n, k, block): tiles cut (197 = 192 + 5 rows, 130 = 128 + 2 columns), each recipe's block, K ragged
# (the last block shorter, odd-length on the pair paths) or a whole number of blocks, K below one block;
# K so long that a's packed blocks exceed the fused AVX512-BF16 kernel's 16 MiB, so that tier takes the
# per-block path (the one AMX takes)
SHAPES = [(197, 130, 96, 32), (197, 130, 300, 32), (70, 45, 256, 128), (70, 45, 300, 128),
          (33, 150, 80, 16), (33, 150, 37, 16), (5, 7, 5, 16), (1, 1, 1, 32), (3, 40, 44001, 16)]


@pytest.mark.parametrize("isa", MODELLED)
@pytest.mark.parametrize("m,n,k,block", SHAPES)
def test_matches_the_float32_model(isa, m, n, k, block, generator):
    args = random_case(generator, m, n, k, block, edge=k <= 300)  # over 1376 blocks edge scales leave only NaN
    with cpu.isa(isa):
        out = block_scaled_gemm(*args)
    assert_same_bits(out, reference(*args, model(isa)))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m,n,k,block", SHAPES)
def test_matches_the_per_block_python_loop(isa, m, n, k, block, generator):
    args = random_case(generator, m, n, k, block, edge=k <= 300, out_dtype=torch.float32)
    with cpu.isa(isa):
        assert_same_bits(block_scaled_gemm(*args), reference(*args, fp8_gemm_per_block))


@pytest.mark.parametrize("isa", MODELLED)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("dtypes", [(d, e) for d in FP8 for e in FP8], ids=lambda d: f"{d[0]}-{d[1]}"[:40])
def test_formats_outputs_and_non_finite_values(isa, out_dtype, dtypes, generator):
    """NaN and Inf codes in both operands, edge scales (NaN, Inf, zeros, subnormals, overflowing products),
    every format pair and output dtype, with and without bias."""
    for bias in (True, False):
        args = random_case(generator, 40, 50, 70, 32, dtypes, finite=False, out_dtype=out_dtype, bias=bias)
        with cpu.isa(isa):
            out = block_scaled_gemm(*args)
        assert_same_bits(out, reference(*args, model(isa)))


# Exponent ranges (low, high) of a's and b's power-of-two scales, E4M3 operands (values 2^-9 to 448): the
# fused AVX512-BF16 kernel multiplies such scales into its packed values while every scaled value, product
# and partial sum stays a normal float32. Typical MXFP8 scales; the low edge (the least product 2^-126) and
# a step past it (subnormal products, which vdpbf16ps would flush); the high edge (a 32-block's sum below
# 2^127) and past it; one operand large, the other small.
POW2_RANGES = [((-20, 5), (-12, 3)), ((-54, -50), (-54, -50)), ((-55, -50), (-54, -50)),
               ((48, 52), (48, 52)), ((48, 53), (48, 52)), ((90, 100), (-100, -95)), ((-117, -100), (60, 70))]


@pytest.mark.parametrize("isa", MODELLED)
@pytest.mark.parametrize("ranges", POW2_RANGES, ids=str)
@pytest.mark.parametrize("dtypes", [(torch.float8_e4m3fn,) * 2, (torch.float8_e5m2, torch.float8_e4m3fn)],
                         ids=["e4m3", "e5m2-e4m3"])
def test_power_of_two_scales_give_the_models_bits(isa, ranges, dtypes, generator):
    """MXFP8's scales (and Float8 block scaling's with power_2_scale) are powers of two, which the fused kernel
    folds into the operands where that is exact: the bits are still the model's, inside the range and past
    its edges (where the kernel scales each block's sum instead). Every code, subnormals included; float32
    out, no bias, so that no bit of the sums is hidden."""
    (a_lo, a_hi), (b_lo, b_hi) = ranges
    m, n, k, block = 197, 130, 300, 32
    a, b = random_fp8((m, k), dtypes[0], generator), random_fp8((n, k), dtypes[1], generator)

    def scales(rows, lo, hi):
        return torch.exp2(torch.randint(lo, hi + 1, (rows, -(-k // block)), generator=generator).double()).float()

    sa, sb = scales(m, a_lo, a_hi), scales(n, b_lo, b_hi).t().contiguous().t()
    with cpu.isa(isa):
        out = block_scaled_gemm(a, sa, b, sb, block, torch.float32)
    assert_same_bits(out, reference(a, sa, b, sb, block, torch.float32, None, model(isa)))


@pytest.mark.parametrize("isa", MODELLED)
@pytest.mark.parametrize("a_value,a_format,exponents,want", [
    (2.0**-9, torch.float8_e4m3fn, (-55, -54), 2.0**-127),  # the product 2^-127: subnormal
    (2.0**-16, torch.float8_e5m2, (-117, 110), 2.0**-23),  # a's scaled value 2^-133: subnormal
], ids=["subnormal-product", "subnormal-value"])
def test_scales_just_past_the_fold_range(isa, a_value, a_format, exponents, want):
    """One product a block: where a folded operand would hold a subnormal value or product (which vdpbf16ps
    reads and writes as zero), the result is still the exact one."""
    a = torch.tensor([[a_value]]).to(a_format)
    b = torch.tensor([[2.0**-9 if a_format == torch.float8_e4m3fn else 1.0]]).to(torch.float8_e4m3fn)
    sa, sb = (torch.tensor([[2.0**e]]) for e in exponents)
    with cpu.isa(isa):
        out = block_scaled_gemm(a, sa, b, sb, 32, torch.float32)
    assert out.item() == want


@pytest.mark.parametrize("isa", MODELLED)
def test_zero_and_signed_zero_sums(isa):
    """Blocks whose products are all -0 or cancel exactly: the total starts at +0, so these stay +0 (a
    total started from the first block's value would keep -0)."""
    a = torch.tensor([[-0.0, 0.0, 1.0, -1.0]]).to(torch.float8_e4m3fn)
    b = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]).to(torch.float8_e4m3fn)
    sa, sb = torch.tensor([[1.0, -2.0]]), torch.tensor([[3.0, 0.5], [-1.0, 1.0]])
    with cpu.isa(isa):
        out = block_scaled_gemm(a, sa, b, sb, 2, torch.float32)
    assert_same_bits(out, reference(a, sa, b, sb, 2, torch.float32, None, model(isa)))
    assert out.view(torch.int32).eq(0).all()  # +0 everywhere


def test_several_tiles_and_thread_counts_give_the_same_bits(generator):
    """500 x 400 outputs are 3 x 4 tiles, so one call packs a row of a and b's blocks once for several
    tiles; the threads' runs of tiles must not change a bit. NVFP4's block with a ragged K."""
    args = random_case(generator, 500, 400, 200, 16, edge=False)
    ref = reference(*args, model(cpu.current_isa()))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert_same_bits(block_scaled_gemm(*args), ref)
    finally:
        torch.set_num_threads(before)


def test_empty_dimensions(generator):
    a, sa, b, sb, _, _, bias = random_case(generator, 3, 4, 0, 32)
    assert torch.equal(block_scaled_gemm(a, sa, b, sb, 32, torch.float32, bias), bias.float().expand(3, 4))
    a, sa, b, sb, *_ = random_case(generator, 0, 4, 64, 32)
    assert block_scaled_gemm(a, sa, b, sb, 32).shape == (0, 4)


def test_block_scaled_gemm_nt_runs_the_kernel_on_views(generator):
    """block_scaled_gemm_nt (what the Linear calls) takes non-contiguous codes, as the old loop did."""
    a, sa, b, sb, block, out_dtype, bias = random_case(generator, 64, 48, 96, 32)
    a_view = torch.cat([a, a], dim=1)[:, :96]
    out = block_scaled_gemm_nt(a_view, sa, b, sb, block, out_dtype, bias)
    assert_same_bits(out, reference(a, sa, b, sb, block, out_dtype, bias, model(cpu.current_isa())))


def test_e8m0_values_of_every_code():
    """The operands' scales from MXFP8's E8M0 codes: 2^(code - 127) (float64 powers, exact in float32: code 0
    is the subnormal 2^-127), NaN for 255."""
    values = e8m0_values(torch.arange(256, dtype=torch.uint8).reshape(16, 16).t())  # a strided view too
    want = torch.tensor([2.0 ** (code - 127) for code in range(255)], dtype=torch.float64)
    assert values.dtype == torch.float32
    assert torch.equal(values.t().reshape(-1)[:255].double(), want) and values[15, 15].isnan()


def test_mxfp8_columnwise_operand_is_the_transpose(generator):
    """gemm_operand's columnwise MXFP8 operand: the columnwise codes transposed (K along the rows), its scales
    the columnwise E8M0 codes, transposed."""
    x = torch.randn(96, 70, generator=generator).to(torch.bfloat16)
    q = MXFP8Quantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True)(x)
    codes, scales = gemm_operand(q, True)
    assert isinstance(q, MXFP8Tensor) and codes.shape == (70, 96) and codes.is_contiguous()
    assert torch.equal(codes.view(torch.uint8), q._columnwise_data.view(torch.uint8).reshape(96, 70).t())
    assert torch.equal(scales, q._columnwise_scale_inv[:3, :70].t())


@pytest.mark.parametrize("isa", ISAS)
def test_e8m0_code_scales_are_their_values(generator, isa):
    """uint8 scales are E8M0 codes: the GEMM gives the bits it gives for their float32 values, over every code
    (0, the subnormal 2^-127; 254; 255, NaN) and through a transposed view's strides."""
    a, _, b, _, block, out_dtype, bias = random_case(generator, 40, 24, 96, 32)
    codes_a = torch.randint(0, 256, (3, 40), dtype=torch.uint8, generator=generator).t()  # strided
    codes_b = torch.randint(100, 150, (24, 3), dtype=torch.uint8, generator=generator)
    codes_a[:8, 0] = torch.tensor([0, 1, 126, 127, 128, 253, 254, 255], dtype=torch.uint8)
    with cpu.isa(isa):
        got = block_scaled_gemm_nt(a, codes_a, b, codes_b, block, out_dtype, bias)
        want = block_scaled_gemm_nt(a, e8m0_values(codes_a), b, e8m0_values(codes_b), block, out_dtype, bias)
    assert_same_bits(got, want)
    with pytest.raises(TypeError, match="b_scales"):
        block_scaled_gemm(a, codes_a, b, codes_b.to(torch.int32), block, out_dtype, bias)


def test_opcheck_and_fake_kernel(generator):
    a, sa, b, sb, block, out_dtype, bias = random_case(generator, 20, 24, 40, 16, edge=False)
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for args in ((a, sa, b, sb, block, out_dtype, bias), (a, sa, b, sb, block, torch.float32, None)):
        torch.library.opcheck(torch.ops.te_fuser.block_scaled_gemm, args, test_utils=checks)
        out = torch.compile(block_scaled_gemm, fullgraph=True)(*args)
        assert torch.equal(out, block_scaled_gemm(*args))


def test_bad_inputs_raise_clear_errors():
    e4 = torch.float8_e4m3fn
    a, b = torch.zeros(4, 40).to(e4), torch.zeros(6, 40).to(e4)
    sa, sb = torch.ones(4, 2), torch.ones(6, 2)
    cases = [
        (lambda: block_scaled_gemm(a.float(), sa, b, sb, 32), TypeError, "a must have dtype"),
        (lambda: block_scaled_gemm(a, sa, b[:, :32].contiguous(), sb, 32), ValueError, "b must have a.shape\\[1\\] = 40"),
        (lambda: block_scaled_gemm(torch.zeros(40, 4).to(e4).t(), sa, b, sb, 32), ValueError, "a must be contiguous"),
        (lambda: block_scaled_gemm(a, torch.ones(4, 1), b, sb, 32), ValueError,
         "a_scales must have shape \\(4, 2\\)"),
        (lambda: block_scaled_gemm(a, sa, b, sb.double(), 32), TypeError, "b_scales must have dtype"),
        (lambda: block_scaled_gemm(a, sa, b, torch.ones(6, 2, device="meta"), 32), ValueError,
         "b_scales is on meta"),
        (lambda: block_scaled_gemm(a, sa, b, sb, 0), ValueError, "block must be an int in \\[1, 256\\]"),
        (lambda: block_scaled_gemm(a, torch.ones(4, 1), b, torch.ones(6, 1), 512), ValueError, "block must be"),
        (lambda: block_scaled_gemm(a, sa, b, sb, 32, torch.int32), ValueError, "out_dtype must be one of"),
        (lambda: block_scaled_gemm(a, sa, b, sb, 32, torch.float32, torch.zeros(4)), ValueError,
         "bias must have shape \\(6,\\)"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    # the raw op checks on its own too
    ops = torch.ops.te_fuser
    with pytest.raises(RuntimeError, match="a_scales must have shape \\(4, 2\\)"):
        ops.block_scaled_gemm(a, torch.ones(4, 1), b, sb, 32, torch.float32, None)
    with pytest.raises(RuntimeError, match="block must lie in \\[1, 256\\]"):
        ops.block_scaled_gemm(a, sa, b, sb, -1, torch.float32, None)
