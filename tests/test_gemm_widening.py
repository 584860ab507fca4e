"""te_fuser.ops.gemm.mm: 16-bit CPU GEMMs computed in float32 where the CPU has no bf16 dot products."""

import pytest
import torch

from te_fuser.kernels import cpu as cpu_kernels
from te_fuser.ops import gemm

WIDENS_HERE = cpu_kernels.current_isa() in ("portable", "avx2", "avx512")


def _operands(layout, dtype, generator):
    """a (m, k) and b (k, n) in the three layouts of a linear's GEMMs, with edge values mixed in."""
    m, k, n = 37, 70, 19
    a = torch.randn(m, k, generator=generator) * 3
    a[0, :4] = torch.tensor([0.0, -0.0, 1000.0 if dtype == torch.float16 else 1e30, -1e-3])
    b = torch.randn(n, k, generator=generator)
    a, b = a.to(dtype), b.to(dtype)
    if layout == "nt":  # forward: x @ W.T
        return a, b.t()
    if layout == "nn":  # dgrad: dy @ W
        return a, b.t().contiguous()
    return a.t().contiguous().t(), b.t()  # wgrad-like: a transposed view


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["nt", "nn", "tn"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_16bit_mm_is_the_float32_product_rounded_once(dtype, layout, with_bias, generator):
    a, b = _operands(layout, dtype, generator)
    bias = torch.randn(b.shape[1], generator=generator).to(dtype) if with_bias else None
    out = gemm.mm(a, b, bias)
    assert out.dtype == dtype and out.shape == (a.shape[0], b.shape[1])
    exact = a.double() @ b.double() + (bias.double() if with_bias else 0.0)
    # float32 sums of exact products, rounded once: within float32 summation error plus half an ulp of dtype.
    eps = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    bound = exact.abs() * eps + (a.double().abs() @ b.double().abs()) * 1e-6 + 1e-30
    assert ((out.double() - exact).abs() <= bound).all()
    if WIDENS_HERE:
        widened = torch.mm(a.float(), b.float()) + (bias.float() if with_bias else 0.0)
        assert torch.equal(out, widened.to(dtype))


def test_which_gemms_widen():
    x16 = torch.ones(2, 2, dtype=torch.bfloat16)
    assert gemm.widens_to_float32(x16, x16) == WIDENS_HERE
    assert not gemm.widens_to_float32(x16.float(), x16.float())  # float32 runs as it is
    assert not gemm.widens_to_float32(x16, x16.half())  # mixed dtypes: torch's own rules and errors
    with cpu_kernels.isa("portable"):
        assert gemm.widens_to_float32(x16, x16)


@pytest.mark.parametrize("widen", [True, False], ids=["widened", "torch_16bit"])
def test_out_dtype(widen, monkeypatch):
    """A float32 output keeps float32 sums on every path (with AVX512-BF16 or AMX, or without widening)."""
    monkeypatch.setattr(gemm, "WIDEN_16BIT_ON_CPU", widen)
    a = torch.randn(4, 8).bfloat16()
    out = gemm.mm(a, a.t(), out_dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, a.float() @ a.float().t(), atol=1e-5, rtol=1e-5)
