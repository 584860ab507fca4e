"""ConstantScale: y = scale * x, dx = scale * dy."""

import pytest
import torch

from te_fuser import ops


@pytest.mark.parametrize("scale", [0.5, -3.0, 0, 2**-20])
def test_constant_scale(scale):
    x = torch.randn(5, 7, dtype=torch.float64)
    x[0, 0] = float("inf")
    x.requires_grad_()
    y = ops.ConstantScale(scale)(x)
    dy = torch.randn(5, 7, dtype=torch.float64)
    y.backward(dy)
    torch.testing.assert_close(y, x.detach() * scale, equal_nan=True)
    torch.testing.assert_close(x.grad, dy * scale)


def test_bad_scale():
    with pytest.raises(TypeError, match="scale must be a real number"):
        ops.ConstantScale("2")
    with pytest.raises(TypeError, match="scale must be a real number"):
        ops.ConstantScale(torch.tensor(2.0))
