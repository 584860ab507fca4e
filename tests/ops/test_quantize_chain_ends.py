"""ops.Quantize at a chain's ends hands the quantized tensor out, as TE's does: the last op's output is a
Float8Tensor when it casts forward, the first op's input gradient one when it casts backward, each holding
the bytes of torch's own cast at the reference current scale (inputs with edge values). Inside a chain the
next op still receives high-precision values."""

import pytest
import torch

import te_fuser
import te_fuser.ops as ops
from te_fuser.recipe import Float8CurrentScaling
from te_fuser.tensor.float8_tensor import Float8Tensor, fp8_data

from fp8_reference import reference_amax, reference_current_scale, reference_quantize


def _expected(x, fp8_dtype):
    scale = reference_current_scale(reference_amax(x), torch.finfo(fp8_dtype).max, 0.0, False)
    return reference_quantize(x, scale, fp8_dtype)


def _random(generator):
    x = torch.randn(32, 32, generator=generator) * 4
    x[0, :4] = torch.tensor([0.0, -0.0, 1e-6, -300.0])  # zeros, a value below E4M3's range, a large one
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("forward, backward", [(True, False), (False, True), (True, True)])
def test_quantized_tensors_leave_the_chain(forward, backward, generator):
    op = ops.Quantize(forward=forward, backward=backward)
    x = _random(generator).requires_grad_()
    dy = _random(generator)
    with te_fuser.fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        y = op(x)
    y.backward(dy)
    assert isinstance(y, Float8Tensor) == forward and isinstance(x.grad, Float8Tensor) == backward
    for got, source, fp8_dtype, cast in ((y, x.detach(), torch.float8_e4m3fn, forward),
                                         (x.grad, dy, torch.float8_e5m2, backward)):
        if cast:
            assert got.dtype == torch.bfloat16
            assert torch.equal(fp8_data(got).view(torch.uint8), _expected(source, fp8_dtype).view(torch.uint8))
        else:
            assert torch.equal(got, source)


def test_inside_a_chain_the_next_op_gets_high_precision(generator):
    """Quantize then an op without an FP8 input (ReLU): ReLU sees the rounded values as a plain tensor, and
    the chain's output is plain."""
    model = ops.Sequential(ops.Quantize(), ops.ReLU())
    x = _random(generator).requires_grad_()
    with te_fuser.fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        y = model(x)
    assert type(y) is torch.Tensor
    rounded = _expected(x.detach(), torch.float8_e4m3fn).to(torch.float32)
    scale = reference_current_scale(reference_amax(x.detach()), 448.0, 0.0, False)
    assert torch.equal(y, torch.relu(rounded / scale).to(torch.bfloat16))
