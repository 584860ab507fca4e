"""ops.Quantize at a chain's ends hands the quantized tensor out, as TE's does: the last op's output is a
quantized tensor when it casts forward, the first op's input gradient one when it casts backward. Under
per-tensor FP8 they hold the bytes of torch's own cast at the reference current scale (inputs with edge
values), under MXFP8 the float64 reference's values; the block-scaled recipes give their own tensor types.
Inside a chain the next op still receives high-precision values."""

import pytest
import torch

import te_fuser
import te_fuser.ops as ops
from te_fuser.recipe import Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling
from te_fuser.tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
from te_fuser.tensor.float8_tensor import Float8Tensor, fp8_data
from te_fuser.tensor.mxfp8_tensor import MXFP8Tensor
from te_fuser.tensor.nvfp4_tensor import NVFP4Tensor

from block_scaling_reference import mxfp8_values
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


@pytest.mark.parametrize("recipe_cls, tensor_type", [(MXFP8BlockScaling, MXFP8Tensor),
                                                     (Float8BlockScaling, Float8BlockwiseQTensor),
                                                     (NVFP4BlockScaling, NVFP4Tensor)])
def test_block_scaled_recipes_hand_out_their_tensor(recipe_cls, tensor_type, generator):
    """Under each block-scaled recipe the output and the input gradient are that recipe's tensors; under
    MXFP8 their values are the float64 reference's (rowwise 1x32 blocks, E8M0 scales)."""
    recipe = recipe_cls()
    op = ops.Quantize(forward=True, backward=True)
    x = (torch.randn(64, 128, generator=generator) * 3).to(torch.bfloat16).requires_grad_()
    dy = (torch.randn(64, 128, generator=generator) * 3).to(torch.bfloat16)
    with te_fuser.fp8_autocast(fp8_recipe=recipe):
        y = op(x)
    y.backward(dy)
    assert isinstance(y, tensor_type) and isinstance(x.grad, tensor_type)
    if recipe_cls is MXFP8BlockScaling:
        bwd_dtype = torch.float8_e4m3fn if recipe.fp8_format == Format.E4M3 else torch.float8_e5m2
        assert torch.equal(y.dequantize().double(), mxfp8_values(x.detach(), torch.float8_e4m3fn))
        assert torch.equal(x.grad.dequantize().double(), mxfp8_values(dy, bwd_dtype))
