"""te_fuser::fp8_gemm (the CPU FP8 GEMM) against a float64 torch reference of the decoded values,
on every CPU path this machine has (te_fuser.kernels.cpu.isa), within the float32 summation bound.

Bound. The products of two FP8 values are exact in float32; the kernel adds K of them to a float32
accumulator (in k order, or two at a time on the bf16-pair engines), so
    |acc - exact| <= (K + 1) * u * sum_k |a_ik b_jk|,  u = 2^-24
(the classic recursive-summation bound K*u/(1-K*u), rounded up). The epilogue then rounds three
times in float32 (scale product, multiply, bias add: at most 4u of the magnitudes involved) and once
to the output dtype (half an ulp of the result, plus half the smallest float16 subnormal)."""

import itertools

import pytest
import torch

from te_fuser.kernels import cpu
from te_fuser.kernels.gemm import fp8_gemm

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ISAS = cpu.available_isa()
FLOAT32_PATHS = [name for name in ISAS if name in ("portable", "avx2", "avx512")]
U32 = 2.0**-24
UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def random_fp8(shape, dtype, generator, finite=True):
    """Uniform over the FP8 codes (every exponent, subnormals, zeros of both signs); NaN and Inf
    codes become zeros unless finite is False."""
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
    x = codes.view(dtype)
    if finite:
        x = torch.where(x.float().isfinite(), x.float(), 0.0).to(dtype)
    return x


def scalar(v):
    return torch.tensor([v], dtype=torch.float32)


def reference_and_tolerance(a, sa, b, sb, bias, out_dtype):
    a64, b64 = a.double(), b.double()
    exact = a64 @ b64.t()
    mag = a64.abs() @ b64.abs().t()
    scale = float((sa * sb).item())  # the kernel multiplies the two scales in float32
    k = a.shape[1]
    bias64 = bias.double() if bias is not None else torch.zeros(b.shape[0], dtype=torch.float64)
    ref = exact * scale + bias64
    tol = ((k + 1) * U32 * mag * abs(scale) + 4 * U32 * ((exact * scale).abs() + bias64.abs())
           + UNIT[out_dtype] * ref.abs() + (2.0**-25 if out_dtype == torch.float16 else 0.0))
    return ref, tol


def assert_within(out, ref, tol, out_dtype):
    got = out.double()
    if out_dtype == torch.float16:  # at and beyond float16's rounding limit (65520) the result is +-Inf
        must = (ref.abs() - tol) >= 65520
        may = (ref.abs() + tol) >= 65520
        inf = got.isinf()
        assert bool((inf[must]).all()) and not bool((inf & ~may).any())
        assert torch.equal(got[inf].sign(), ref[inf].sign())
        got, ref, tol = got[~inf], ref[~inf], tol[~inf]
    err = (got - ref).abs()
    worst = (err - tol).max() if err.numel() else torch.tensor(0.0)
    assert bool((err <= tol).all()), f"max excess over the bound {worst.item():.3g}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("a_dtype,b_dtype", list(itertools.product(FP8, FP8)))
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_matches_float64_reference(isa, a_dtype, b_dtype, out_dtype, generator):
    m, n, k = 197, 130, 300  # not multiples of the 192 x 128 output tile or the 256-deep k block
    a = random_fp8((m, k), a_dtype, generator)
    b = random_fp8((n, k), b_dtype, generator)
    # keep float16 outputs mostly in range: scales as delayed scaling would pick them
    sa = scalar(2.0 ** -int(torch.randint(4, 12, (1,), generator=generator)))
    sb = scalar(0.75 * 2.0 ** -int(torch.randint(4, 12, (1,), generator=generator)))
    bias = torch.randn(n, generator=generator).to(out_dtype)
    with cpu.isa(isa):
        out = fp8_gemm(a, sa, b, sb, out_dtype, bias)
    assert out.dtype == out_dtype and out.shape == (m, n)
    ref, tol = reference_and_tolerance(a, sa, b, sb, bias, out_dtype)
    assert_within(out, ref, tol, out_dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (16, 16, 16), (5, 3, 0), (0, 7, 4), (6, 0, 9), (193, 257, 520),
                                   (2, 300, 33), (300, 2, 31)])
def test_shapes(isa, m, n, k, generator):
    a = random_fp8((m, k), torch.float8_e4m3fn, generator)
    b = random_fp8((n, k), torch.float8_e5m2, generator)
    bias = torch.randn(n, generator=generator, dtype=torch.bfloat16)
    sa, sb = scalar(0.5), scalar(1.0 / 1024)
    with cpu.isa(isa):
        out = fp8_gemm(a, sa, b, sb, torch.float32, bias)
    ref, tol = reference_and_tolerance(a, sa, b, sb, bias, torch.float32)
    assert_within(out, ref, tol, torch.float32)


@pytest.mark.skipif(len(FLOAT32_PATHS) < 2, reason="one float32 path on this CPU")
def test_float32_paths_give_identical_bits(generator):
    a = random_fp8((150, 700), torch.float8_e5m2, generator)
    b = random_fp8((140, 700), torch.float8_e4m3fn, generator)
    outs = []
    for name in FLOAT32_PATHS:
        with cpu.isa(name):
            outs.append(fp8_gemm(a, scalar(1.0), b, scalar(1.0), torch.float32))
    for other in outs[1:]:
        assert torch.equal(other, outs[0])


@pytest.mark.parametrize("isa", ISAS)
def test_edge_values(isa):
    """Largest finite values, subnormals, signed zeros, then NaN and Inf propagation."""
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    k = 40
    a = torch.zeros(4, k)
    a[0] = 448.0  # E4M3 max: 40 * 448 * 57344 stays finite in float32
    a[1, ::2] = 2.0**-9  # smallest E4M3 subnormal
    a[2] = -0.0
    a[3, 3] = 2.0**-6
    b = torch.zeros(3, k)
    b[0] = 57344.0  # E5M2 max
    b[1] = 2.0**-16  # smallest E5M2 subnormal
    b[2, :] = -1.5
    a8, b8 = a.to(e4), b.to(e5)
    assert torch.equal(a8.float(), a) and torch.equal(b8.float(), b)  # exactly representable
    with cpu.isa(isa):
        out = fp8_gemm(a8, scalar(1.0), b8, scalar(1.0), torch.float32)
    ref = a.double() @ b.double().t()
    torch.testing.assert_close(out.double(), ref, rtol=(k + 1) * U32, atol=0)
    assert out[1, 1].item() == 20 * 2.0**-25  # products of subnormals are exact

    # NaN in a row of a gives a NaN row; Inf (E5M2) gives Inf, and Inf * 0 gives NaN.
    a = random_fp8((5, 64), e5, torch.Generator().manual_seed(0)).float().abs() + 1
    a[0, 7] = float("nan")
    a[1, 9] = float("inf")
    b = torch.ones(3, 64)
    b[2, 9] = 0.0
    with cpu.isa(isa):
        out = fp8_gemm(a.to(e5), scalar(1.0), b.to(e5), scalar(1.0), torch.bfloat16)
    assert out[0].isnan().all()
    assert torch.isposinf(out[1, :2]).all() and out[1, 2].isnan()
    assert out[2:].isfinite().all()


def test_bias_dtypes_and_output_rounding(generator):
    a = random_fp8((33, 48), torch.float8_e4m3fn, generator)
    b = random_fp8((20, 48), torch.float8_e4m3fn, generator)
    sa, sb = scalar(0.01), scalar(0.02)
    for bias_dtype in OUT_DTYPES:
        bias = torch.randn(20, generator=generator).to(bias_dtype)
        for out_dtype in OUT_DTYPES:
            out = fp8_gemm(a, sa, b, sb, out_dtype, bias)
            ref, tol = reference_and_tolerance(a, sa, b, sb, bias, out_dtype)
            assert_within(out, ref, tol, out_dtype)


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_results_do_not_depend_on_the_thread_count(generator, threads):
    """Threads take runs of tiles of equal output area; partial last rows and columns of tiles
    (500 = 2 * 192 + 116 rows, 400 = 3 * 128 + 16 columns) make those runs uneven in count."""
    a = random_fp8((500, 260), torch.float8_e4m3fn, generator)
    b = random_fp8((400, 260), torch.float8_e5m2, generator)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fp8_gemm(a, scalar(1.0), b, scalar(1.0), torch.float32)
        torch.set_num_threads(threads)
        many = fp8_gemm(a, scalar(1.0), b, scalar(1.0), torch.float32)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def test_opcheck_and_fake_kernel(generator):
    a = random_fp8((20, 32), torch.float8_e4m3fn, generator)
    b = random_fp8((24, 32), torch.float8_e5m2, generator)
    bias = torch.randn(24, generator=generator)
    # test_schema is left out: it compares inputs with arithmetic that float8 tensors lack
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for args in ((a, scalar(1.0), b, scalar(2.0), torch.bfloat16, bias), (a, scalar(1.0), b, scalar(2.0), torch.float32, None)):
        torch.library.opcheck(torch.ops.te_fuser.fp8_gemm, args, test_utils=checks)
        out = torch.compile(fp8_gemm, fullgraph=True)(*args)
        assert torch.equal(out, fp8_gemm(*args))


def test_bad_inputs_raise_clear_errors():
    a = torch.zeros(4, 8).to(torch.float8_e4m3fn)
    b = torch.zeros(6, 8).to(torch.float8_e4m3fn)
    one = scalar(1.0)
    with pytest.raises(TypeError, match="a must have dtype"):
        fp8_gemm(a.float(), one, b, one)
    with pytest.raises(ValueError, match="b must be 2-D"):
        fp8_gemm(a, one, b.reshape(6, 2, 4), one)
    with pytest.raises(ValueError, match="b must have a.shape\\[1\\] = 8 columns"):
        fp8_gemm(a, one, b[:, :4].contiguous(), one)
    with pytest.raises(ValueError, match="a must be contiguous"):
        fp8_gemm(torch.zeros(8, 4).to(torch.float8_e4m3fn).t(), one, b, one)
    with pytest.raises(TypeError, match="a_scale_inv must be a float32 tensor with one element"):
        fp8_gemm(a, torch.ones(2), b, one)
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        fp8_gemm(a, one, b, one, torch.int32)
    with pytest.raises(ValueError, match="bias must have shape \\(6,\\)"):
        fp8_gemm(a, one, b, one, torch.float32, torch.zeros(4))
    with pytest.raises(TypeError, match="bias must have dtype"):
        fp8_gemm(a, one, b, one, torch.float32, torch.zeros(6, dtype=torch.int64))
    # the raw op checks on its own too
    ops = torch.ops.te_fuser
    with pytest.raises(RuntimeError, match="b must have a.shape\\[1\\] = 8 columns"):
        ops.fp8_gemm(a, one, b[:, :4].contiguous(), one, torch.float32, None)
    with pytest.raises(RuntimeError, match="a must be torch.float8_e4m3fn or torch.float8_e5m2"):
        ops.fp8_gemm(a.float(), one, b, one, torch.float32, None)
    with pytest.raises(RuntimeError, match="bias must be 1-D"):
        ops.fp8_gemm(a, one, b, one, torch.float32, torch.zeros(5))


@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID"])
def test_fp8_linear_takes_the_kernel_on_every_path(fmt, generator):
    """te_fuser.Linear's three FP8 GEMMs run on each CPU path: the float32 paths agree bit for bit,
    the bf16-pair paths (where present) within the summation bound's order of magnitude, and every
    path calls te_fuser::fp8_gemm three times per step."""
    import te_fuser
    from te_fuser import recipe

    import copy

    fresh = te_fuser.Linear(64, 48, params_dtype=torch.bfloat16)  # each path starts from the same scales
    x = torch.randn(32, 64, generator=generator).bfloat16()
    dy = torch.randn(32, 48, generator=generator).bfloat16()
    results = {}
    for name in ISAS:
        layer = copy.deepcopy(fresh)
        xi = x.clone().requires_grad_()
        with cpu.isa(name), torch.profiler.profile() as prof:
            with te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_format=getattr(recipe.Format, fmt))):
                y = layer(xi)
            y.backward(dy)
        calls = sum(e.count for e in prof.key_averages() if e.key == "te_fuser::fp8_gemm")
        assert calls == 3, f"{name}: {calls} fp8_gemm calls"
        results[name] = (y.detach(), xi.grad, layer.weight.grad)
    first = results[ISAS[0]]
    for name, got in results.items():
        for g, f in zip(got, first):
            if name in FLOAT32_PATHS:
                assert torch.equal(g, f), name
            else:
                torch.testing.assert_close(g.float(), f.float(), rtol=2e-2, atol=1e-3)
