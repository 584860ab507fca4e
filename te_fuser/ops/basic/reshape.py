"""Reshape: torch.reshape to a fixed shape."""

from typing import Iterable

from .._fp8_io import high_precision
from ..op import BasicOperation


class Reshape(BasicOperation):
    """y = x.reshape(shape) (one entry may be -1); the gradient goes back to x's shape."""

    def __init__(self, shape: Iterable[int]):
        super().__init__()
        try:
            shape = tuple(shape)
        except TypeError:
            raise TypeError(f"shape must be an iterable of ints, got {type(shape).__name__}") from None
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise TypeError(f"shape must be an iterable of ints, got {shape!r}")
        if any(d < -1 for d in shape) or shape.count(-1) > 1:
            raise ValueError(f"shape may hold non-negative sizes and at most one -1, got {shape!r}")
        self.shape = shape

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer):
        del prev_op_grad_output_quantizer, next_op_input_quantizer
        x = high_precision(input_)
        ctx.input_shape = tuple(x.shape)
        return x.reshape(self.shape)

    def op_backward(self, ctx, grad_output):
        return high_precision(grad_output).reshape(ctx.input_shape), ()

    def onnx_forward(self, input_):
        return input_.reshape(self.shape), ()
