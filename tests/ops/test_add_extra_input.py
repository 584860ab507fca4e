"""AddExtraInput / AddInPlace and the fuser's extra inputs: values and gradients against float64 torch."""

import pytest
import torch
import torch.nn.functional as F

from te_fuser import ops


def test_add_extra_input_out_of_place():
    """(The fuser allows one backward per graph, so torch.autograd.gradcheck, which differentiates
    a graph once per output entry, cannot run on fused ops: float64 references instead.)"""
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    e = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    e_before = e.detach().clone()
    y = ops.AddExtraInput()(x, e)
    assert torch.equal(y, x + e) and torch.equal(e, e_before)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(x.grad, dy) and torch.equal(e.grad, dy)


def test_add_in_place_writes_into_the_extra_input():
    """TE's AddInPlace: the output is the extra input's memory, now x + e; both gradients are dy."""
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    e = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    expected = (x + e).detach()
    y = ops.AddInPlace()(x, e)
    assert y.data_ptr() == e.data_ptr() and torch.equal(e.detach(), expected) and torch.equal(y, expected)
    dy = torch.randn(4, 6, dtype=torch.float64)
    y.backward(dy)
    assert torch.equal(x.grad, dy) and torch.equal(e.grad, dy)
    assert ops.AddExtraInput(in_place=True).in_place and not ops.AddExtraInput().in_place


def test_extra_inputs_through_a_sequential_of_several_groups():
    """Extra inputs go to their ops in order, across the fusers a non-op module splits the chain into; a
    chain whose only input requiring grad is an extra input still gives its gradient and the later ops'."""
    torch.manual_seed(0)
    model = ops.Sequential(ops.BasicLinear(6, 6, dtype=torch.float64), ops.AddExtraInput(), torch.nn.Tanh(),
                           ops.AddExtraInput(), ops.BasicLinear(6, 3, dtype=torch.float64))
    x = torch.randn(5, 6, dtype=torch.float64)
    e1, e2 = (torch.randn(5, 6, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = model(x, e1, e2)
    w1, w2 = (model[i].weight.detach().clone().requires_grad_() for i in (0, 4))
    ref = F.linear(torch.tanh(F.linear(x, w1) + e1) + e2, w2)
    dy = torch.randn_like(ref)
    got = torch.autograd.grad(out, [e1, e2, model[0].weight, model[4].weight], dy)
    want = torch.autograd.grad(ref, [e1, e2, w1, w2], dy)
    torch.testing.assert_close(out, ref)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)

    e1.requires_grad_(False)
    model[0].weight.requires_grad_(False)
    (de2,) = torch.autograd.grad(model(x, e1, e2), [e2], dy)
    torch.testing.assert_close(de2, want[1])


def test_only_the_extra_input_requires_grad():
    """The chain input and the first op's weight need no gradient: the ops after the extra input still
    run their backward for it."""
    op_chain = ops.Sequential(ops.AddExtraInput(), ops.ConstantScale(3.0))
    x = torch.randn(4, 2)
    e = torch.randn(4, 2, requires_grad=True)
    op_chain(x, e).sum().backward()
    torch.testing.assert_close(e.grad, torch.full((4, 2), 3.0))


def test_wrong_number_or_shape_of_extra_inputs():
    model = ops.Sequential(ops.Identity(), ops.AddExtraInput())
    with pytest.raises(ValueError, match="extra_inputs: the ops take 1 extra input"):
        model(torch.randn(2, 3))
    with pytest.raises(ValueError, match="extra_inputs: the ops take 1 extra input"):
        model(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3))
    with pytest.raises(ValueError, match="extra input's shape"):
        model(torch.randn(2, 3), torch.randn(3, 3))
    with pytest.raises(TypeError, match="extra_inputs must be torch.Tensors"):
        ops.AddExtraInput()(torch.randn(2), 1.0)
    with pytest.raises(TypeError, match="in_place must be a bool"):
        ops.AddExtraInput(in_place="yes")
