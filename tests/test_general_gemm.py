"""cpp_extensions.general_gemm / general_grouped_gemm (TE's GEMM entry points) against float64 torch: the three
layouts, bias, GELU forward and backward, accumulation, FP8 operands (their exact values), quantized output,
grouped GEMMs equal to the loop of single ones, and refused arguments."""

import pytest
import torch
import torch.nn.functional as F

from te_fuser.cpp_extensions import general_gemm, general_grouped_gemm
from te_fuser.tensor import Float8Quantizer

M, K, N = 24, 40, 16


def _close(got, want, tol=1e-5):
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
def test_layouts_are_cublas_operand_order(layout, generator):
    shapes = {"TN": ((N, K), (M, K)), "NN": ((N, K), (M, N)), "NT": ((M, K), (M, N))}[layout]
    a, b = (torch.randn(s, generator=generator) for s in shapes)
    a64, b64 = a.double(), b.double()
    want = {"TN": lambda: b64 @ a64.t(), "NN": lambda: b64 @ a64, "NT": lambda: b64.t() @ a64}[layout]()
    out, bias_grad, gelu_input, extra = general_gemm(a, b, None, torch.float32, layout=layout)
    _close(out, want)
    assert bias_grad is None and gelu_input is None and extra is None


def test_bias_gelu_forward_and_backward(generator):
    w, x, bias = torch.randn(N, K, generator=generator), torch.randn(M, K, generator=generator), torch.randn(N)
    pre = x.double() @ w.double().t() + bias.double()
    out, _, gelu_input, _ = general_gemm(w, x, None, torch.float32, gelu=True, bias=bias)
    _close(gelu_input, pre)
    _close(out, F.gelu(pre, approximate="tanh"))
    dy = torch.randn(M, N, generator=generator)
    pre_leaf = pre.clone().requires_grad_()
    (dpre,) = torch.autograd.grad(F.gelu(pre_leaf, approximate="tanh"), pre_leaf, dy.double())
    dgelu, _, _, _ = general_gemm(torch.eye(N), dy, None, torch.float32, layout="NN", gelu=True, gelu_in=gelu_input,
                                  grad=True)
    _close(dgelu, dpre)
    dw, dbias, _, _ = general_gemm(x, dy, None, torch.float32, layout="NT", grad=True, bias=bias)
    _close(dw, dy.double().t() @ x.double())
    _close(dbias, dy.double().sum(0))


def test_accumulate_adds_into_out_once_rounded(generator):
    w, x = torch.randn(N, K, generator=generator), torch.randn(M, K, generator=generator)
    out = torch.randn(M, N, generator=generator).to(torch.bfloat16)
    want = (out.double() + x.double() @ w.double().t()).to(torch.bfloat16)
    result, _, _, _ = general_gemm(w, x, None, out=out, accumulate=True)
    assert result is out
    torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)


def test_fp8_operands_are_read_as_their_values_and_the_output_can_be_quantized(generator):
    quantizer = Float8Quantizer(torch.tensor([2.0]), torch.zeros(1), torch.float8_e4m3fn)
    w8 = quantizer(torch.randn(N, K, generator=generator))
    x8 = quantizer(torch.randn(M, K, generator=generator))
    want = x8.dequantize(dtype=torch.float32).double() @ w8.dequantize(dtype=torch.float32).double().t()
    out, _, _, _ = general_gemm(w8, x8, None, torch.float32)
    _close(out, want)
    out8, _, _, _ = general_gemm(w8, x8, None, torch.float32, quantization_params=quantizer)
    assert type(out8).__name__ == "Float8Tensor"
    torch.testing.assert_close(out8.dequantize(), quantizer(want.float()).dequantize())


@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
def test_grouped_gemm_is_the_loop_of_single_ones(layout, generator):
    splits = [8, 0, 16]
    if layout == "TN":
        A = [torch.randn(N, K, generator=generator) for _ in splits]
        B = list(torch.split(torch.randn(M, K, generator=generator), splits))
    elif layout == "NN":
        A = [torch.randn(N, K, generator=generator) for _ in splits]
        B = list(torch.split(torch.randn(M, N, generator=generator), splits))
    else:
        A = list(torch.split(torch.randn(M, K, generator=generator), splits))
        B = list(torch.split(torch.randn(M, N, generator=generator), splits))
    single = layout != "NT"
    width = {"TN": N, "NN": K}.get(layout)
    out = [torch.randn(M, width, generator=generator)] if single else [torch.randn(N, K) for _ in splits]
    ref = [o.clone() for o in (torch.split(out[0], splits) if single else out)]
    for a, b, o in zip(A, B, ref):
        general_gemm(a, b, None, torch.float32, layout=layout, out=o, accumulate=True)
    general_grouped_gemm(A, B, out, torch.float32, None, layout=layout, m_splits=splits, accumulate=True,
                         single_output=single)
    got = list(torch.split(out[0], splits)) if single else out
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


def test_bad_arguments_name_themselves():
    a, b = torch.randn(4, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match="layout"):
        general_gemm(a, b, None, layout="TT")
    with pytest.raises(ValueError, match="do not multiply"):
        general_gemm(a, b, None, layout="NN")
    with pytest.raises(ValueError, match="accumulate=True needs out"):
        general_gemm(a, b, None, accumulate=True)
    with pytest.raises(ValueError, match="gelu_in"):
        general_gemm(a, b, None, gelu=True, grad=True)
    with pytest.raises(NotImplementedError, match="userbuffer"):
        general_gemm(a, b, None, ub=object())
    with pytest.raises(ValueError, match="m_splits"):
        general_grouped_gemm([a], [b], [torch.empty(3, 4)], torch.float32, single_output=True)
