"""How ops hand FP8 tensors to each other: direct FP8 kernel outputs and the transposed data."""

from typing import Optional

import torch

from ..tensor.float8_tensor import Float8Quantizer, Float8Tensor, columnwise_bytes, fp8_data
from ..tensor.quantized_tensor import QuantizedTensor


def direct_fp8_args(quantizer) -> Optional[tuple]:
    """(fp8_dtype, scale, amax) for a kernel to write FP8 itself, or None.

    Only delayed scaling qualifies: its scale is known before the output
    exists. A current-scaling quantizer needs the output's amax first, so the
    op writes high precision and the consumer quantizes.
    """
    if isinstance(quantizer, Float8Quantizer):
        return (quantizer.fp8_dtype, *quantizer.scaling())
    return None


def wrap_kernel_output(data: torch.Tensor, quantizer: Float8Quantizer, nominal_dtype: torch.dtype) -> Float8Tensor:
    """A Float8Tensor around FP8 codes a kernel wrote with quantizer's scale."""
    transpose = columnwise_bytes(data) if quantizer.columnwise_usage else None
    return Float8Tensor(data, torch.reciprocal(quantizer.scaling()[0]), quantizer.fp8_dtype, nominal_dtype, transpose)


def with_transpose(t: Float8Tensor) -> Float8Tensor:
    """t, given its transposed data when it came without (byte transpose, no requantization)."""
    if t._transpose is None:
        t._transpose = columnwise_bytes(fp8_data(t))
    return t


def high_precision(x):
    """x as a plain tensor (dequantized when it is a quantized tensor)."""
    return x.dequantize() if isinstance(x, QuantizedTensor) else x


class QuantizeWithGrad(torch.autograd.Function):
    """quantizer(x) as a Float8Tensor that carries autograd; the gradient passes through unchanged
    (dequantized when it arrives in FP8). Saves nothing for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, quantizer) -> Float8Tensor:
        del ctx
        return quantizer(high_precision(x).contiguous())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        del ctx
        return high_precision(grad), None


class DequantizeWithGrad(torch.autograd.Function):
    """x.dequantize() that carries autograd (Float8Tensor.dequantize() reads the buffers and is not
    recorded): the gradient passes through. Saves nothing for backward."""

    @staticmethod
    def forward(ctx, x: Float8Tensor) -> torch.Tensor:
        del ctx
        return x.dequantize()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        del ctx
        return high_precision(grad)


def dequantized_with_grad(x: torch.Tensor) -> torch.Tensor:
    """x as a plain tensor, through autograd when it is a Float8Tensor."""
    return DequantizeWithGrad.apply(x) if isinstance(x, Float8Tensor) else x
