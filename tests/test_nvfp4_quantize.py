"""The NVFP4 kernels (quantize, dequantize) bit for bit against the independent float64 reference of
nvfp4_reference.py, the reference against the format's facts, stochastic rounding's statistics, the
Hadamard transform, 2D blocks, the fake kernels and the refusals.

Every kernel test runs once per instruction-set path of the CPU kernels this machine has.

Planted in csrc/fp4/nvfp4_format.h and seen failing (then reverted): the tie 0.25 rounded up
(`a > 0.25f` -> `a >= 0.25f` in tf_e2m1_encode_rn): test_ties_round_to_the_even_code fails on every
path and dtype (random inputs never hit the tie); stochastic rounding biased down (the threshold
`d * 2^24` scaled by 0.9): test_stochastic_rounding_is_unbiased_and_picks_a_neighbour fails. Planted in
csrc/fp4/nvfp4_quantize_avx512.c: the round-to-nearest encoder's step below 1 halved (2^21 for 2^22): 68 tests fail,
all on the avx512 path.
"""

import math

import pytest
import torch

import nvfp4_reference as ref
from fp8_reference import FLOAT_DTYPES, random_decades
from te_fuser.kernels import cpu
from te_fuser.kernels import nvfp4 as k
from te_fuser.tensor import NVFP4Quantizer

ISA_PATHS = [tier for tier in ("portable", "avx2", "avx512") if tier in cpu.available_isa()]
SHAPES = [(16, 16), (48, 528), (2, 32, 160), (128, 64),
          (1, 1), (1, 15), (17, 33), (31, 129), (3, 5, 127), (200, 17)]  # ragged: zero-padded to 16s
MODES = {  # block_2d, rht, stochastic
    "1d": (False, False, False), "2d": (True, False, False), "rht": (False, True, False),
    "sr": (False, False, True), "rht_sr": (False, True, True), "2d_sr": (True, False, True),
}


@pytest.fixture(params=ISA_PATHS)
def isa_path(request):
    with cpu.isa(request.param):
        yield request.param


def edge_input(shape, dtype, generator):
    """Values over many decades, with an all-zero block, a huge and a tiny block, signed zeros and a
    whole zero row."""
    low, high = (-3, 1) if dtype == torch.float16 else (-12, 12)
    x = random_decades(math.prod(shape), torch.float64, generator, low=low, high=high).reshape(-1, shape[-1])
    x[:, 16:32] = 0.0
    x[1::5, :16] *= 1e20 if dtype != torch.float16 else 1e3
    x[2::7, :16] *= 1e-20 if dtype != torch.float16 else 1e-3
    x[:, 7::13] = -0.0
    x[3:4] = 0.0
    return x.to(dtype).reshape(shape)


def padding_is_zero(scale, rows, cols):
    rest = scale.clone()
    rest[:rows, :cols] = 0
    return bool(rest.eq(0).all())


def check_against_reference(x, block_2d, rht, stochastic, seed=12345):
    x2 = x.reshape(-1, x.shape[-1])
    rows, cols = x2.shape
    data, scale, amax, col_data, col_scale, col_amax = k.nvfp4_quantize(x, True, True, block_2d, rht, stochastic,
                                                                        seed)
    rows_p, cols_p = -(-rows // 16) * 16, -(-cols // 16) * 16
    assert data.shape == (*x.shape[:-1], cols_p // 2) and col_data.shape == (cols, rows_p // 2)
    assert tuple(scale.shape) == k.nvfp4_scale_shape(x.shape, False) and scale.dtype == torch.uint8
    assert tuple(col_scale.shape) == k.nvfp4_scale_shape(x.shape, True)
    usages = ((data, scale, amax, False), (col_data, col_scale, col_amax, True))
    for got_data, got_scale, got_amax, columnwise in usages:
        codes, scale_codes, want_amax = ref.quantize(x2, columnwise, block_2d, rht and columnwise,
                                                     seed if stochastic else None)
        n, m = scale_codes.shape
        assert torch.equal(got_data.reshape(-1, got_data.shape[-1]), ref.pack(codes)), f"data (columnwise={columnwise})"
        assert torch.equal(got_scale[:n, :m], scale_codes), f"scales (columnwise={columnwise})"
        assert padding_is_zero(got_scale, n, m) and got_amax.item() == want_amax
    return data, scale, amax, col_data, col_scale, col_amax


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bit_exact(isa_path, generator, shape, dtype, mode):
    check_against_reference(edge_input(shape, dtype, generator), *MODES[mode])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_ties_round_to_the_even_code(isa_path, dtype):
    """Elements that scale exactly onto the midpoints of the E2M1 grid: the tensor's amax 2688 makes
    S_enc = 1, and a block whose amax is 6 * 2^n gets the scale 2^n, so its elements are scaled by
    2^-n exactly. Ties go to the even code, as TE's cvt.rn does."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], dtype=torch.float64)
    x = torch.zeros(16, 64, dtype=torch.float64)
    x[0, 0] = 2688.0
    for r in range(16):
        for b in range(1, 4):
            n = r % 8 - 3 + b
            x[r, 16 * b: 16 * b + 8] = ties * 2.0**n
            x[r, 16 * b + 8: 16 * b + 16] = -ties * 2.0**n
    x = x.to(dtype)
    data, *_ = check_against_reference(x, False, False, False)
    codes = ref.unpack(data)[:, 16:64].reshape(16, 3, 16)
    expected = torch.tensor([0, 2, 2, 4, 4, 6, 6, 7], dtype=torch.uint8)
    assert torch.equal(codes, torch.cat([expected, expected | 8]).expand(16, 3, 16))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_all_zero_and_constant_tensors(isa_path, dtype):
    for x in (torch.zeros(32, 64, dtype=dtype), torch.full((32, 64), -3.5, dtype=dtype)):
        for mode in MODES.values():
            check_against_reference(x, *mode)
    data, scale, amax, _, _, _ = k.nvfp4_quantize(torch.zeros(16, 32), True, False)
    assert amax.item() == 0 and not data.any() and not scale.any()


def test_reference_facts():
    """The reference against facts of TE's format (docs/block_scaling.md): the grid, ties to even,
    saturation, the global scale of amax 0, 2688 and a subnormal amax, the block-scale formula's
    saturation at 448, and the transform's orthogonality."""
    assert ref.e2m1_decode(torch.arange(16)).tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.0, -0.1, float("inf")], dtype=torch.float64)
    assert ref.e2m1_encode_rn(ties).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 8, 7]
    assert ref.global_scale(0.0) == 1.0 and ref.global_scale(2688.0) == 1.0 and ref.global_scale(1e-45) == ref.FLT_MAX
    assert ref.block_scale_codes(torch.tensor([1e30], dtype=torch.float64), 1.0).item() == 0x7E
    m = ref.hadamard_matrix()
    assert torch.equal(m @ m.t(), torch.eye(16, dtype=torch.float64))
    # 0.75 is halfway between codes 1 and 2: up with probability exactly 1/2 of the 2^24 draws.
    u = torch.tensor([0, 2**23 - 1, 2**23, 2**24 - 1])
    assert ref.e2m1_encode_sr(torch.full((4,), 0.75, dtype=torch.float64), u).tolist() == [2, 2, 1, 1]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_dequantize(isa_path, generator, dtype):
    x = edge_input((64, 96), torch.float32, generator)
    data, scale, amax, col_data, col_scale, col_amax = k.nvfp4_quantize(x, True, True, rht=True)
    for d, s, a in ((data, scale, amax), (col_data, col_scale, col_amax)):
        codes = ref.unpack(d)
        got = k.nvfp4_dequantize(d, s, a, dtype)
        want = ref.dequantize(codes, s[: codes.shape[0], : codes.shape[1] // 16], a.item(), dtype)
        assert got.dtype == dtype and torch.equal(got, want)


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour(generator):
    """Over many seeds each value rounds to one of its two neighbours on the E2M1 grid, and the mean of the
    dequantized values approaches the value (within 5 standard errors of the worst case); round to
    nearest, the control, misses by far more for some values. A scaled value beyond 6 (a block whose
    E4M3 scale rounded down) saturates at 6 every time, as under round to nearest."""
    x = torch.randn(16, 64, generator=generator) * 2
    seeds = 1500
    codes_rn, scales, amax = ref.quantize(x)
    factors = ref.decode_factors(scales, amax).repeat_interleave(16, 1)
    scaled = ref.round_f32(x.double() * ref.encode_multipliers(scales, ref.global_scale(amax)).repeat_interleave(16, 1))
    lower, upper = ref.e2m1_neighbours(scaled)
    total = torch.zeros(16, 64, dtype=torch.float64)
    for seed in range(seeds):
        data, scale, _, _, _, _ = k.nvfp4_quantize(x, True, False, stochastic=True, seed=seed * 7919 + 1)
        assert torch.equal(scale[:16, :4], scales)  # scales never depend on the rounding
        codes = ref.unpack(data).to(torch.int64)
        assert bool(((codes & 7) == lower).logical_or((codes & 7) == upper).all())
        total += ref.e2m1_decode(codes) * factors
    mean = total / seeds
    inside = scaled.abs() <= 6
    assert bool(inside.float().mean() > 0.9) and torch.equal(mean[~inside], ref.e2m1_decode(codes_rn)[~inside] *
                                                             factors[~inside])
    step = (ref.E2M1_GRID[upper] - ref.E2M1_GRID[lower]) * factors
    bound = 5 * step / 2 / math.sqrt(seeds) + 1e-6 * x.abs().double()
    assert bool(((mean - x.double()).abs() <= bound)[inside].all())
    rn_error = (ref.e2m1_decode(codes_rn) * factors - x.double()).abs()
    assert bool((rn_error > bound)[inside].any())  # control: the bound is tight enough to see rounding bias


def test_stochastic_rounding_is_reproducible():
    x = torch.randn(32, 64)
    a = k.nvfp4_quantize(x, True, True, stochastic=True, seed=99)
    b = k.nvfp4_quantize(x, True, True, stochastic=True, seed=99)
    c = k.nvfp4_quantize(x, True, True, stochastic=True, seed=100)
    assert all(torch.equal(p, q) for p, q in zip(a, b)) and not torch.equal(a[0], c[0])
    quantizer = NVFP4Quantizer(stochastic_rounding=True)
    torch.manual_seed(3)
    first = quantizer(x)
    torch.manual_seed(3)
    again = quantizer(x)
    assert torch.equal(first._rowwise_data, again._rowwise_data)
    assert not torch.equal(first._rowwise_data, quantizer(x)._rowwise_data)  # the next call draws a new seed


def test_hadamard_transform_round_trip_and_wgrad_identity(generator):
    """The columnwise data under the transform holds (x.T M) per 16 rows; inverting it (M.T) gives x's
    values back within NVFP4's error, and a product over the rows of two transformed operands is the
    product of the untransformed ones (M is orthogonal and block-diagonal)."""
    x = torch.randn(64, 32, generator=generator)
    dy = torch.randn(64, 48, generator=generator)
    m = ref.hadamard_matrix()
    _, _, amax, col_data, col_scale, col_amax = k.nvfp4_quantize(x, True, True, rht=True)
    assert col_amax.item() == ref.hadamard_rows(x.double().t()).abs().max().item() != amax.item()
    stored = ref.values(x, columnwise=True, rht=True)  # (32, 64), transformed
    back = (stored.reshape(32, 4, 16) @ m.t()).reshape(32, 64)
    plain = ref.values(x, columnwise=True)
    assert (back - x.double().t()).abs().max() <= 2 * (plain - x.double().t()).abs().max() + 0.5
    a, b = dy.double().t(), x.double().t()
    transformed = (a.reshape(48, 4, 16) @ m).reshape(48, 64) @ (b.reshape(32, 4, 16) @ m).reshape(32, 64).t()
    torch.testing.assert_close(transformed, a @ b.t(), rtol=1e-12, atol=1e-12)


def test_2d_blocks_share_one_scale(generator):
    x = torch.randn(48, 64, generator=generator)
    _, scale, amax, _, col_scale, col_amax = k.nvfp4_quantize(x, True, True, block_2d=True)
    s = scale[:48, :4]
    assert torch.equal(s, s[::16].repeat_interleave(16, 0))  # the same scale on each 16 rows of a block
    assert torch.equal(col_scale[:64, :3], s[::16].t().repeat_interleave(16, 0))  # the transposed blocks
    assert amax.item() == col_amax.item()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_amaxes_from_outside(isa_path, generator, mode):
    """nvfp4_amax is the amax each usage's quantization takes (rowwise; columnwise after the transform), and
    quantizing under given amaxes (a tensor-parallel group's maximum: this tensor's or larger) matches the float64
    reference under those amaxes, every code and scale; under x's own amaxes it is the plain quantization."""
    block_2d, rht, stochastic = MODES[mode]
    x = edge_input((48, 80), torch.bfloat16, generator)
    own = k.nvfp4_quantize(x, True, True, block_2d, rht, stochastic, 7)
    amax, amax_t = k.nvfp4_amax(x), k.nvfp4_amax(x, rht=rht)
    assert torch.equal(amax, own[2]) and torch.equal(amax_t, own[5])
    same = k.nvfp4_quantize(x, True, True, block_2d, rht, stochastic, 7, amaxes=(amax, amax_t))
    assert all(torch.equal(a, b) for a, b in zip(own, same))
    group = (amax * 3.7, amax_t * 1.3) if not block_2d else (amax * 3.7, amax * 3.7)
    data, scale, got_amax, col_data, col_scale, got_amax_t = k.nvfp4_quantize(
        x, True, True, block_2d, rht, stochastic, 7, amaxes=group)
    for got_data, got_scale, columnwise, a in ((data, scale, False, group[0]), (col_data, col_scale, True, group[1])):
        codes, scale_codes, want_amax = ref.quantize(x, columnwise, block_2d, rht and columnwise,
                                                     7 if stochastic else None, amax=a.item())
        n, m = scale_codes.shape
        assert torch.equal(got_data, ref.pack(codes)) and torch.equal(got_scale[:n, :m], scale_codes)
    assert got_amax.item() == group[0].item() and got_amax_t.item() == group[1].item()
    assert not torch.equal(scale, own[1])  # the larger amax changed the block scales


def test_amaxes_bad_arguments():
    x = torch.randn(16, 32)
    a = k.nvfp4_amax(x)
    with pytest.raises(ValueError, match=r"amaxes\[1\]"):
        k.nvfp4_quantize(x, amaxes=(a, a.double()))
    with pytest.raises(ValueError, match="amaxes must be a pair"):
        k.nvfp4_quantize(x, amaxes=a)
    with pytest.raises(ValueError, match="seed"):
        k.nvfp4_quantize(x, stochastic=True, seed=torch.tensor(3), amaxes=(a, a))
    with pytest.raises(RuntimeError, match="Inf or NaN"):
        k.nvfp4_quantize(x, amaxes=(a, torch.tensor([float("nan")])))
    with pytest.raises(TypeError, match="x must have dtype"):
        k.nvfp4_amax(x.to(torch.int32))


@pytest.mark.parametrize("n", [1, 31, 32, 33, 256, 4103])
def test_e2m1_as_e4m3_is_torchs_cast_of_each_value(isa_path, generator, n):
    """The GEMM's unpacking of packed E2M1 bytes (low nibble first) into E4M3 codes: torch's float8_e4m3fn cast of
    each float64 E2M1 value (zeros of both signs included), every byte value, lengths around the 32-byte step."""
    data = torch.randint(0, 256, (3, n), dtype=torch.uint8, generator=generator)
    data.view(-1)[: min(256, data.numel())] = torch.arange(min(256, data.numel()), dtype=torch.uint8)
    codes = torch.stack((data & 15, data >> 4), dim=-1).reshape(3, 2 * n)
    want = ref.e2m1_decode(codes).float().to(torch.float8_e4m3fn)
    got = k.e2m1_as_e4m3(data)
    assert got.dtype == torch.float8_e4m3fn and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert k.e2m1_as_e4m3(data.to("meta")).shape == (3, 2 * n)
    with pytest.raises(TypeError, match="data must have dtype"):
        k.e2m1_as_e4m3(data.to(torch.int16))


def test_fake_kernels_and_opcheck():
    x = torch.randn(2, 16, 64)
    meta = x.to("meta")
    for real, fake in zip(k.nvfp4_quantize(x, True, True, rht=True), k.nvfp4_quantize(meta, True, True, rht=True)):
        assert real.shape == fake.shape and real.dtype == fake.dtype
    torch.library.opcheck(torch.ops.te_fuser.nvfp4_quantize, (x, True, True, False, True, True, 5))
    data, scale, amax, _, _, _ = k.nvfp4_quantize(x, True, False)
    torch.library.opcheck(torch.ops.te_fuser.nvfp4_dequantize, (data.reshape(32, 32), scale, amax, torch.bfloat16))
    only_col = k.nvfp4_quantize(x, rowwise=False, columnwise=True)
    assert only_col[:3] == (None, None, None) and only_col[3].shape == (64, 16)
    a, at = k.nvfp4_amax(x), k.nvfp4_amax(x, rht=True)
    torch.library.opcheck(torch.ops.te_fuser.nvfp4_amax, (x, True))
    torch.library.opcheck(torch.ops.te_fuser.nvfp4_quantize_with_amax, (x, a, at, True, True, False, True, False, 5))
    assert k.nvfp4_amax(meta).shape == (1,)


def test_bad_arguments_name_themselves():
    x = torch.randn(32, 64)
    with pytest.raises(ValueError, match="x must have at least 1 dimension"):
        k.nvfp4_quantize(torch.tensor(1.0))
    with pytest.raises(TypeError, match="x must have dtype"):
        k.nvfp4_quantize(x.double())
    with pytest.raises(ValueError, match="x must be contiguous"):
        k.nvfp4_quantize(torch.randn(64, 32).t())
    with pytest.raises(ValueError, match="rowwise and columnwise"):
        k.nvfp4_quantize(x, rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="with_2d_quantization and with_rht"):
        k.nvfp4_quantize(x, block_2d=True, rht=True)
    for special in (math.inf, -math.inf, math.nan):
        bad = x.clone()
        bad[5, 7] = special
        with pytest.raises(ValueError, match="Inf or NaN"):
            k.nvfp4_quantize(bad)
    with pytest.raises(ValueError, match="seed"):
        k.nvfp4_quantize(x, stochastic=True, seed=-1)
    data, scale, amax, _, _, _ = k.nvfp4_quantize(x)
    with pytest.raises(ValueError, match="does not cover"):
        k.nvfp4_dequantize(data, scale[:, :1].contiguous(), amax)
    with pytest.raises(ValueError, match="amax must be one float32"):
        k.nvfp4_dequantize(data, scale, amax.double())
    with pytest.raises(TypeError, match="data must have dtype"):
        k.nvfp4_dequantize(data.float(), scale, amax)
    with pytest.raises(ValueError, match="multiple of 16 values"):
        k.nvfp4_dequantize(data[:, :4].contiguous(), scale, amax)
