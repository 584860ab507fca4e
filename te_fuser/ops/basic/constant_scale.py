"""ConstantScale: multiplication by a fixed number."""

import numbers

from .._fp8_io import high_precision
from ..op import BasicOperation


class ConstantScale(BasicOperation):
    """y = scale * x, dx = scale * dy."""

    def __init__(self, scale: float):
        super().__init__()
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
        self.scale = float(scale)

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer):
        del ctx, prev_op_grad_output_quantizer, next_op_input_quantizer
        return high_precision(input_) * self.scale

    def op_backward(self, ctx, grad_output):
        return high_precision(grad_output) * self.scale, ()

    def onnx_forward(self, input_):
        return input_ * self.scale, ()
