"""Quantize: casts to FP8 in the forward and/or backward pass (a no-op outside fp8_autocast)."""

from ...tensor.quantized_tensor import QuantizedTensor
from .._fp8_io import high_precision
from ..op import BasicOperation


class Quantize(BasicOperation):
    """Casts the forward input (forward=True) and/or the gradient (backward=True) to FP8.

    When the neighbouring op takes FP8 it receives the Float8Tensor made with
    its own quantizer. At the chain's end (the last op's output, the first op's
    input gradient) the Float8Tensor leaves the chain, as TE's Quantize hands it
    out. Otherwise the values go on dequantized, so the chain sees the FP8
    rounding (the op's own quantizer and amax history).
    """

    num_forward_quantizers = 1
    num_backward_quantizers = 1
    supports_block_scaling = True  # its quantizers are the recipe's, whatever the format

    def __init__(self, forward: bool = True, backward: bool = False):
        super().__init__()
        self.quantize_forward = bool(forward)
        self.quantize_backward = bool(backward)

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer):
        ctx.fp8 = self._fp8_enabled
        ctx.grad_input_quantizer = prev_op_grad_output_quantizer
        ctx.own_grad_quantizer = self._backward_quantizers[0] if self._fp8_enabled else None
        if not (self._fp8_enabled and self.quantize_forward):
            return input_
        ctx.quantized_output = getattr(ctx, "last_in_chain", False)
        return self._cast(high_precision(input_), next_op_input_quantizer, self._forward_quantizers[0],
                          ctx.quantized_output)

    def op_backward(self, ctx, grad_output):
        if not (ctx.fp8 and self.quantize_backward):
            return grad_output, ()
        ctx.quantized_grad_input = getattr(ctx, "first_in_chain", False)
        return self._cast(high_precision(grad_output), ctx.grad_input_quantizer, ctx.own_grad_quantizer,
                          ctx.quantized_grad_input), ()

    @staticmethod
    def _cast(x, neighbour_quantizer, own_quantizer, leaves_chain: bool):
        if neighbour_quantizer is not None:
            return neighbour_quantizer(x.contiguous())
        q: QuantizedTensor = own_quantizer(x.contiguous())
        return q if leaves_chain else q.dequantize()
