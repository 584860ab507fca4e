"""L2Normalization against torch.nn.functional.normalize's formula in float64, with torch autograd's gradient."""

import pytest
import torch

from te_fuser import ops


def _reference(x64, eps):
    return x64 / torch.sqrt(x64.square().sum(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("eps", [1e-6, 0.0, 0.5])
def test_matches_float64_reference(dtype, tol, eps):
    x = torch.randn(4, 3, 16, dtype=torch.float64) * 3
    x[0, 0] = 0.0 if eps else 1e-3  # a zero vector: eps keeps it finite
    x[1, 1, :8] *= 1e4
    x = x.to(dtype).requires_grad_()
    y = ops.L2Normalization(eps=eps)(x)
    assert y.dtype == dtype
    dy = torch.randn(y.shape, dtype=dtype)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    ref = _reference(x64, eps)
    ref.backward(dy.double())
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol, atol=tol * max(1.0, x64.grad.abs().max().item()))


def test_saves_nothing_without_grad_and_in_a_chain():
    model = ops.Sequential(ops.BasicLinear(16, 32, dtype=torch.float64), ops.Reshape((-1, 2, 16)),
                           ops.L2Normalization())
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    out = model(x)
    w = model[0].weight.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    ref = _reference((x_ref @ w.T).reshape(-1, 2, 16), 1e-6)
    dy = torch.randn_like(ref)
    out.backward(dy)
    ref.backward(dy)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(model[0].weight.grad, w.grad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        ops.L2Normalization(eps=-1.0)
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        ops.L2Normalization(eps="small")
    with pytest.raises(ValueError, match="seq_length must be a positive int"):
        ops.L2Normalization(seq_length=0)
    with pytest.raises(ValueError, match="micro_batch_size must be a positive int"):
        ops.L2Normalization(micro_batch_size=2.5)
    with pytest.raises(TypeError):
        ops.L2Normalization(1e-6)  # keyword-only, as TE's
