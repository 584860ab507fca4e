"""Dropout (TE's op): training-only, kept entries scaled by 1/(1-p), reproducible from torch's seed."""

import pytest
import torch

from te_fuser import ops


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_values_and_gradient_against_the_seeded_mask(p):
    """The mask is torch's Bernoulli(1 - p) draw from the default generator: redrawn here from the same
    seed it gives the float64 reference y = x * m / (1 - p), dx = dy * m / (1 - p)."""
    x = torch.randn(64, 33, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(123)
    y = ops.Dropout(p)(x)
    torch.manual_seed(123)
    mask = torch.empty(x.shape, dtype=torch.bool).bernoulli_(1 - p)
    torch.testing.assert_close(y, x.detach() * mask / (1 - p), rtol=1e-15, atol=0)
    dy = torch.randn_like(y)
    y.backward(dy)
    torch.testing.assert_close(x.grad, dy * mask / (1 - p), rtol=1e-15, atol=0)
    assert abs((~mask).double().mean().item() - p) < 0.05


def test_seeded_runs_repeat_and_unseeded_runs_differ():
    op = ops.Dropout(0.5)
    x = torch.randn(1000)
    torch.manual_seed(7)
    a = op(x)
    torch.manual_seed(7)
    b = op(x)
    c = op(x)
    assert torch.equal(a, b) and not torch.equal(b, c)


@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_eval_mode_p0_and_p1(p):
    op = ops.Dropout(p)
    x = torch.randn(20, 8, requires_grad=True)
    op.eval()
    y = op(x)
    assert torch.equal(y, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    op.train()
    x.grad = None
    y = op(x)
    y.sum().backward()
    if p == 0.0:
        assert torch.equal(y, x) and torch.equal(x.grad, torch.ones_like(x))
    elif p == 1.0:
        assert torch.equal(y, torch.zeros_like(x)) and torch.equal(x.grad, torch.zeros_like(x))


def test_in_a_chain_and_mask_saved_as_bool():
    """Between two linears: the float64 reference with the same mask; the backward keeps the mask in one
    byte an entry."""
    torch.manual_seed(0)
    model = ops.Sequential(ops.BasicLinear(8, 16, dtype=torch.float64), ops.Bias(16, dtype=torch.float64),
                           ops.Dropout(0.25), ops.BasicLinear(16, 4, dtype=torch.float64),
                           ops.Bias(4, dtype=torch.float64))
    x = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(5)
    out = model(x)
    torch.manual_seed(5)
    mask = torch.empty(10, 16, dtype=torch.bool).bernoulli_(0.75)
    saved = [t for t in out.grad_fn.saved_tensors if t.dtype == torch.bool]
    assert len(saved) == 1 and torch.equal(saved[0], mask)
    params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    x_ref = x.detach().clone().requires_grad_()
    h = (x_ref @ params[0].T + params[1]) * mask / 0.75
    ref = h @ params[2].T + params[3]
    dy = torch.randn_like(ref)
    out.backward(dy)
    ref.backward(dy)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for p, r in zip(model.parameters(), params):
        torch.testing.assert_close(p.grad, r.grad)


@pytest.mark.parametrize("p", [-0.1, 1.5, "0.5", True, None])
def test_bad_probability(p):
    with pytest.raises(ValueError, match=r"p \(the dropout probability\) must be a number in \[0, 1\]"):
        ops.Dropout(p)
