"""The device engines of the block-scaled GEMM without a library (te_fuser.ops.block_gemm_cuda's split emulation
and its one-pass GEMMs on scale-folded operands), run on the CPU: within docs/block_scaling.md's bounds of
te_fuser's C kernel and of the float64 product; and the bound stated there between the C kernel's split accumulation and a one-pass float32 accumulation of the same scaled
products (a model of Blackwell's block-scaled MMA), for MXFP8, Float8 block scaling and NVFP4."""

import pytest
import torch

from block_gemm_bounds import exact64, gamma, magnitude64, one_pass_bound, split_bound
from te_fuser.kernels.gemm import block_scaled_gemm, nvfp4_gemm
from te_fuser.ops.block_gemm_cuda import emulated_block_scaled_gemm_nt, folded, one_pass_block_scaled_gemm_nt

# (m, n, k, block): each recipe's block, K a whole number of blocks, ragged (a shorter last block) and below one
SHAPES = [(37, 29, 256, 32), (37, 29, 300, 32), (20, 33, 384, 128), (20, 33, 200, 128), (16, 24, 80, 16),
          (9, 11, 37, 16), (5, 3, 7, 32)]
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def random_case(generator, m, n, k, block, dtype=torch.float8_e4m3fn, powers_of_two=False):
    """Finite FP8 codes over the whole grid, normal float32 scales (odd ones unless powers_of_two), a bias."""
    nb = -(-k // block)

    def codes(rows):
        x = torch.randint(0, 256, (rows, k), dtype=torch.uint8, generator=generator).view(dtype).float()
        return torch.where(x.isfinite(), x, 1.0).to(dtype)

    def scales(rows):
        s = torch.exp2(torch.randint(-12, 6, (rows, nb), generator=generator).float())
        return s if powers_of_two else s * (1 + torch.rand(rows, nb, generator=generator))

    return codes(m), scales(m), codes(n), scales(n), torch.randn(n, generator=generator)


def within(out, ref, bound, what):
    excess = (out.double() - ref).abs() - bound
    assert bool((excess <= 0).all()), f"{what}: {int((excess > 0).sum())} beyond the bound, worst by {excess.max()}"


@pytest.mark.parametrize("m,n,k,block", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_emulation_within_the_bound_of_the_c_kernel_and_float64(m, n, k, block, dtype, generator):
    a, sa, b, sb, bias = random_case(generator, m, n, k, block, dtype)
    out = emulated_block_scaled_gemm_nt(a, sa, b, sb, block, torch.float32, bias, blocks_per_batch=3)
    c_kernel = block_scaled_gemm(a, sa, b, sb, block, torch.float32, bias)
    d = magnitude64(a, sa, b, sb, block, bias)
    bound = split_bound(k, block, bias=True) * d
    within(out, exact64(a, sa, b, sb, block, bias), bound, "emulation vs float64")
    within(out, c_kernel.double(), 2 * bound, "emulation vs the C kernel")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_emulation_rounds_once_to_the_output_dtype(out_dtype, generator):
    """Both round their float32 totals (within 2 * bound of each other) once: half an ulp each."""
    a, sa, b, sb, bias = random_case(generator, 30, 40, 96, 32)
    sa = sa * 2.0**-14  # totals within float16's range
    out = emulated_block_scaled_gemm_nt(a, sa, b, sb, 32, out_dtype, bias.to(out_dtype))
    c_kernel = block_scaled_gemm(a, sa, b, sb, 32, out_dtype, bias.to(out_dtype))
    assert out.dtype == out_dtype
    d = magnitude64(a, sa, b, sb, 32, bias.to(out_dtype))
    half_ulp = torch.finfo(out_dtype).eps / 2
    bound = 2 * split_bound(96, 32, bias=True) * d + half_ulp * (out.double().abs() + c_kernel.double().abs())
    within(out, c_kernel.double(), bound, "emulation vs the C kernel")


def test_emulation_propagates_nan_codes_like_the_c_kernel(generator):
    a, sa, b, sb, _ = random_case(generator, 12, 10, 64, 32)
    a.view(torch.uint8)[3, 5] = 0x7F  # E4M3 NaN
    b.view(torch.uint8)[7, 40] = 0xFF
    out = emulated_block_scaled_gemm_nt(a, sa, b, sb, 32, torch.float32)
    assert torch.equal(out.isnan(), block_scaled_gemm(a, sa, b, sb, 32, torch.float32).isnan())
    assert bool(out[3].isnan().all()) and bool(out[:, 7].isnan().all())


def one_pass(terms, generator):
    """sum over the last axis of float32 terms, one float32 addition at a time in a random order from +0."""
    total = torch.zeros(terms.shape[:-1], dtype=torch.float32)
    for k in torch.randperm(terms.shape[-1], generator=generator).tolist():
        total = total + terms[..., k]
    return total


@pytest.mark.parametrize("m,n,k,block", [s for s in SHAPES if s[3] != 16])
def test_split_against_one_pass_accumulation(m, n, k, block, generator):
    """Each product times float32(sa sb) summed over all K in float32 in a random order (a hardware MMA that
    scales inside and accumulates in float32) stays within split_bound + one_pass_bound of the C kernel; the
    two differ (with powers-of-two scales, MXFP8's, and odd ones, Float8 block scaling's)."""
    for powers_of_two in (True, False):
        a, sa, b, sb, _ = random_case(generator, m, n, k, block, powers_of_two=powers_of_two)
        nb = sa.shape[1]
        scale = (sa[:, None, :] * sb[None, :, :]).repeat_interleave(block, dim=2)[..., :k]  # float32(sa sb)
        terms = (a.float()[:, None, :] * b.float()[None, :, :]) * scale
        hardware = one_pass(terms, generator)
        c_kernel = block_scaled_gemm(a, sa, b, sb, block, torch.float32)
        d = magnitude64(a, sa, b, sb, block)
        within(hardware, exact64(a, sa, b, sb, block), one_pass_bound(k) * d, "one pass vs float64")
        within(hardware, c_kernel.double(), (split_bound(k, block) + one_pass_bound(k)) * d, "one pass vs split")
        if k > block and nb > 1:
            assert not torch.equal(hardware, c_kernel), "the model should round differently somewhere"


@pytest.mark.parametrize("m,n,k", [(16, 24, 80), (9, 11, 37), (32, 16, 512)])
def test_nvfp4_alpha_at_the_end_against_the_folded_factors(m, n, k, generator):
    """NVFP4 three ways: te_fuser's CPU GEMM (nvfp4_gemm: exact block terms e2m1 e2m1 s_a s_b added in block order,
    times alpha = float32(float32(amax_a c) float32(amax_b c)), c = float32(1 / 2688)); the Blackwell model (the
    same terms summed over K in float32 in any order, times alpha); and each block scaled by float32(fa fb),
    fa = float32(float32(s_a amax_a) c), the factors the device engines take (here through the C kernel's split
    accumulation). Each within its bound of float64, and of one another."""
    kp, nb = -(-k // 16) * 16, -(-k // 16)
    c = torch.tensor(1.0 / 2688.0, dtype=torch.float32)
    signed_e2m1 = torch.cat([E2M1, -E2M1])

    def operand(rows):
        nibbles = torch.randint(0, 16, (rows, kp), generator=generator)
        nibbles[:, k:] = 0  # the zero padding
        packed = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).to(torch.uint8)
        s = torch.randint(0x08, 0x7F, (rows, nb), dtype=torch.uint8, generator=generator)
        amax = torch.exp2(torch.randn((), generator=generator) * 6) * (1 + torch.rand((), generator=generator))
        return signed_e2m1[nibbles].to(torch.float8_e4m3fn), packed, s, s.view(torch.float8_e4m3fn).float(), amax

    a, a_packed, a_codes, s_a, amax_a = operand(m)
    b, b_packed, b_codes, s_b, amax_b = operand(n)
    alpha = (amax_a * c) * (amax_b * c)
    cpu = nvfp4_gemm(a_packed, a_codes, b_packed, b_codes, alpha, torch.float32)
    fa, fb = s_a * amax_a * c, s_b * amax_b * c  # float32, as NVFP4Tensor._codes_and_factors gives them
    factors = block_scaled_gemm(a, fa, b, fb, 16, torch.float32)
    scale = (s_a[:, None, :] * s_b[None, :, :]).repeat_interleave(16, dim=2)  # exact: E4M3 x E4M3
    terms = (a.float()[:, None, :] * b.float()[None, :, :]) * scale  # exact: 2 + 2 + 4 + 4 significant bits
    hardware = one_pass(terms, generator) * alpha
    ga, gb = amax_a.double() * c.double(), amax_b.double() * c.double()
    true_a, true_b = s_a.double() * ga, s_b.double() * gb  # the factors without rounding
    d = magnitude64(a, true_a, b, true_b, 16)
    exact = exact64(a, true_a, b, true_b, 16)
    cpu_bound = gamma(nb + 3)  # the blocks' total (nb - 1), times alpha (1), alpha's own 3
    within(cpu, exact, cpu_bound * d, "CPU GEMM vs float64")
    within(hardware, exact, one_pass_bound(kp, scale_roundings=2) * d, "alpha at the end vs float64")
    within(factors, exact, split_bound(kp, 16, scale_roundings=4) * d, "folded factors vs float64")
    within(hardware, cpu.double(), (cpu_bound + one_pass_bound(kp, scale_roundings=2)) * d, "one pass vs CPU")
    within(factors, cpu.double(), (cpu_bound + split_bound(kp, 16, scale_roundings=4)) * d, "factors vs CPU")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_mxfp8_values_fold_into_bfloat16_exactly(dtype, generator):
    """The bf16 one-pass engine's premise: an FP8 value (at most 4 significant bits) times an E8M0 scale is a
    bfloat16 (8 bits, float32's exponents), while the product stays within bf16's normal range; odd scales
    (Float8 block scaling's) are not, which is why that recipe folds in float32."""
    a, sa, _, _, _ = random_case(generator, 37, 1, 300, 32, dtype, powers_of_two=True)
    exact = a.double() * sa.double().repeat_interleave(32, dim=1)[:, :300]
    assert torch.equal(folded(a, sa, 32, torch.bfloat16).double(), exact)
    odd = sa * 1.3
    assert not torch.equal(folded(a, odd, 32, torch.bfloat16).double(),
                           a.double() * odd.double().repeat_interleave(32, dim=1)[:, :300])


# the bf16 engine runs MXFP8's power-of-two scales only
ONE_PASS_CASES = [(*s, torch.float32) for s in SHAPES] + [(*s, torch.bfloat16) for s in SHAPES if s[3] == 32]


@pytest.mark.parametrize("m,n,k,block,operand_dtype", ONE_PASS_CASES)
def test_one_pass_engines_within_their_bound(m, n, k, block, operand_dtype, generator):
    """One GEMM over all of K on folded operands. float32: each term float32(float32(a sa) float32(b sb)) (3
    roundings), K - 1 additions, the bias: gamma(K + 3). bf16 (power-of-two scales only): exact terms, so
    gamma(K). Against the C kernel, that plus split_bound."""
    a, sa, b, sb, bias = random_case(generator, m, n, k, block, powers_of_two=block == 32)
    out = one_pass_block_scaled_gemm_nt(a, sa, b, sb, block, torch.float32, bias, operand_dtype)
    d = magnitude64(a, sa, b, sb, block, bias)
    bound = gamma(k + 3 if operand_dtype == torch.float32 else k) * d
    within(out, exact64(a, sa, b, sb, block, bias), bound, "one pass vs float64")
    c_kernel = block_scaled_gemm(a, sa, b, sb, block, torch.float32, bias)
    within(out, c_kernel.double(), bound + split_bound(k, block, bias=True) * d, "one pass vs the C kernel")


def test_one_pass_propagates_nan_codes_like_the_c_kernel(generator):
    a, sa, b, sb, _ = random_case(generator, 12, 10, 64, 32, powers_of_two=True)
    a.view(torch.uint8)[3, 5] = 0x7F  # E4M3 NaN
    b.view(torch.uint8)[7, 40] = 0xFF
    for operand_dtype in (torch.float32, torch.bfloat16):
        out = one_pass_block_scaled_gemm_nt(a, sa, b, sb, 32, torch.float32, operand_dtype=operand_dtype)
        assert torch.equal(out.isnan(), block_scaled_gemm(a, sa, b, sb, 32, torch.float32).isnan())
