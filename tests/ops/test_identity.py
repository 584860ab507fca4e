"""Identity: y = x, dx = dy, alone and between two linear ops."""

import torch
import torch.nn.functional as F

from te_fuser import ops


def test_identity():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = ops.Identity()(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(y, x) and torch.equal(x.grad, dy)


def test_identity_between_linears():
    model = ops.Sequential(ops.BasicLinear(6, 5, dtype=torch.float64), ops.Identity(),
                           ops.BasicLinear(5, 4, dtype=torch.float64))
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    out = model(x)
    w1, w2 = (model[i].weight.detach().clone().requires_grad_() for i in (0, 2))
    x_ref = x.detach().clone().requires_grad_()
    ref = F.linear(F.linear(x_ref, w1), w2)
    dy = torch.randn_like(ref)
    out.backward(dy)
    ref.backward(dy)
    torch.testing.assert_close(out, ref)
    for got, want in [(x.grad, x_ref.grad), (model[0].weight.grad, w1.grad), (model[2].weight.grad, w2.grad)]:
        torch.testing.assert_close(got, want)
