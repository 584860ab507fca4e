"""Reshape: torch.reshape forward, the gradient back to the input's shape."""

import pytest
import torch

from te_fuser import ops


@pytest.mark.parametrize("shape", [(6, 4), (-1,), (2, -1, 2), (24,)])
def test_reshape(shape):
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    y = ops.Reshape(shape)(x)
    dy = torch.randn(y.shape, dtype=torch.float64)
    y.backward(dy)
    assert torch.equal(y, x.detach().reshape(shape))
    assert torch.equal(x.grad, dy.reshape(2, 3, 4))


def test_bad_shape():
    with pytest.raises(TypeError, match="shape must be an iterable of ints"):
        ops.Reshape(5)
    with pytest.raises(TypeError, match="shape must be an iterable of ints"):
        ops.Reshape((2, 2.0))
    with pytest.raises(ValueError, match="shape may hold .* at most one -1"):
        ops.Reshape((-1, -1))
    with pytest.raises(RuntimeError):
        ops.Reshape((5,))(torch.randn(2, 3))
