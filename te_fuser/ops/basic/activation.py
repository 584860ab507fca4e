"""Activation ops: GELU (tanh approximation), ReLU and SwiGLU, on the fused C/CUDA kernels."""

from ...kernels import fused
from .._fp8_io import direct_fp8_args, high_precision, wrap_kernel_output
from ..op import BasicOperation


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
            ctx.save_for_backward(x, bias)
        return y

    def op_backward(self, ctx, grad_output):
        return self.backward_with_bias(ctx, grad_output, False, ctx.grad_input_quantizer)[0], ()

    def backward_with_bias(self, ctx, grad_output, compute_dbias, grad_input_quantizer):
        """(dx, dbias) from one pass; dx in FP8 when the previous op takes FP8 gradients."""
        x, bias = ctx.saved_tensors
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
            ctx.save_for_backward(x)
        return y

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        return fused.swiglu_backward(high_precision(grad_output).contiguous(), x), ()
