"""Activation ops: GELU (tanh approximation), ReLU and SwiGLU, on the fused C/CUDA kernels.

Between two FP8 linears (the next op takes FP8 input), the activations save their
input for backward in FP8 E4M3 (current scaling) rather than in 16 bits, and
dequantize it only for the backward kernel call (issue 15: activations are not
kept in 16 bits between FP8 layers; DeepSeek-V3 caches activation inputs in
FP8 the same way).
"""

import torch

from ...tensor.float8_tensor import Float8Tensor
from ...kernels import fused
from ...tensor.float8_tensor import Float8CurrentScalingQuantizer
from .._fp8_io import direct_fp8_args, high_precision, wrap_kernel_output
from ..op import BasicOperation


def quantize_saved_input(x: torch.Tensor) -> Float8Tensor:
    """The FP8 E4M3 copy of an activation's input that its backward keeps."""
    return Float8CurrentScalingQuantizer(torch.float8_e4m3fn, device=x.device, columnwise=False)(x)


class _BiasActivation(BasicOperation):
    """act(x); when fused after a bias (LinearBiasActivation) the saved input is x - bias and
    the bias is saved too, so the pre-activation never has to be stored."""

    activation = "none"

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer):
        return self.forward_with_bias(ctx, high_precision(input_).contiguous(), None,
                                      prev_op_grad_output_quantizer, next_op_input_quantizer)

    def forward_with_bias(self, ctx, x, bias, prev_op_grad_output_quantizer, next_op_input_quantizer):
        """act(x + bias) in one kernel, FP8 when the next op takes FP8 with a known scale."""
        fp8_out = direct_fp8_args(next_op_input_quantizer)
        y = fused.bias_activation(x, bias, self.activation, fp8_out=fp8_out)
        if fp8_out is not None:
            y = wrap_kernel_output(y, next_op_input_quantizer, x.dtype)
        ctx.grad_input_quantizer = prev_op_grad_output_quantizer
        if ctx.input_requires_grad:
            fp8_next = next_op_input_quantizer is not None
            ctx.save_for_backward(quantize_saved_input(x) if fp8_next else x, bias)
        return y

    def op_backward(self, ctx, grad_output):
        return self.backward_with_bias(ctx, grad_output, False, ctx.grad_input_quantizer)[0], ()

    def backward_with_bias(self, ctx, grad_output, compute_dbias, grad_input_quantizer):
        """(dx, dbias) from one pass; dx in FP8 when the previous op takes FP8 gradients."""
        x, bias = ctx.saved_tensors
        x = high_precision(x)  # the FP8-saved input, in 16 bits only for this call
        dy = high_precision(grad_output).contiguous()
        fp8_out = direct_fp8_args(grad_input_quantizer)
        dx, dbias = fused.activation_bias_backward(dy, x, bias, self.activation, compute_dbias, fp8_out=fp8_out)
        if fp8_out is not None:
            dx = wrap_kernel_output(dx, grad_input_quantizer, dy.dtype)
        return dx, dbias


class GELU(_BiasActivation):
    """GELU with the tanh approximation (= torch.nn.functional.gelu(x, approximate="tanh"))."""

    activation = "gelu"


class ReLU(_BiasActivation):
    activation = "relu"


class SwiGLU(BasicOperation):
    """silu(a) * g with a, g = x.chunk(2, dim=-1): halves the last dimension."""

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer):
        del prev_op_grad_output_quantizer
        x = high_precision(input_).contiguous()
        fp8_out = direct_fp8_args(next_op_input_quantizer)
        y = fused.swiglu(x, fp8_out=fp8_out)
        if fp8_out is not None:
            y = wrap_kernel_output(y, next_op_input_quantizer, x.dtype)
        if ctx.input_requires_grad:
            ctx.save_for_backward(quantize_saved_input(x) if next_op_input_quantizer is not None else x)
        return y

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        return fused.swiglu_backward(high_precision(grad_output).contiguous(), high_precision(x)), ()
