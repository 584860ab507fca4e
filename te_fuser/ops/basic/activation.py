"""Activation ops with TransformerEngine's names and semantics, on the fused C/CUDA kernels.

Element-wise: GELU (tanh approximation), QGELU (x * sigmoid(1.702 x)), ReLU, SReLU (relu(x)^2) and
SiLU. Gated (the last dimension split into halves a, g; TE's order, the activation on the first
half, so the output has half the last dimension): GEGLU, QGEGLU, ReGLU, SReGLU and SwiGLU.

Between two FP8 linears (the next op takes FP8 input), the activations save their
input for backward in FP8 E4M3 (current scaling) rather than in 16 bits, and
dequantize it only for the backward kernel call (issue 15: activations are not
kept in 16 bits between FP8 layers; DeepSeek-V3 caches activation inputs in
FP8 the same way). TE's cache_quantized_input=True saves it so whatever follows.
"""

import torch
import torch.nn.functional as F

from ...tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Tensor
from ...kernels import fused
from .._fp8_io import direct_fp8_args, high_precision, wrap_kernel_output
from ..op import BasicOperation


# Each activation in torch operators, for the ONNX export (the gated ones apply it to the first half).
_TORCH_FORMS = {
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "qgelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "srelu": lambda x: F.relu(x).square(),
    "silu": F.silu,
}
_GATED_BASE = {"geglu": "gelu", "qgeglu": "qgelu", "reglu": "relu", "sreglu": "srelu", "swiglu": "silu"}


def quantize_saved_input(x: torch.Tensor) -> Float8Tensor:
    """The FP8 E4M3 copy of an activation's input that its backward keeps."""
    return Float8CurrentScalingQuantizer(torch.float8_e4m3fn, device=x.device, columnwise=False)(x)


class _Activation(BasicOperation):
    """What every activation op shares: TE's constructor and the choice of how its input is saved."""

    activation = "none"  # the kernels' name of the activation

    def __init__(self, *, cache_quantized_input: bool = False):
        super().__init__()
        self.cache_quantized_input = bool(cache_quantized_input)

    def _saved_input(self, x: torch.Tensor, next_op_input_quantizer) -> torch.Tensor:
        """x in FP8 before an FP8 op (or when asked to), else x itself."""
        fp8 = self.cache_quantized_input or next_op_input_quantizer is not None
        return quantize_saved_input(x) if fp8 else x

    def onnx_forward(self, input_):
        x = input_.float()
        if self.activation in _GATED_BASE:
            a, g = x.chunk(2, dim=-1)
            return (_TORCH_FORMS[_GATED_BASE[self.activation]](a) * g).to(input_.dtype), ()
        return _TORCH_FORMS[self.activation](x).to(input_.dtype), ()


class _BiasActivation(_Activation):
    """act(x); when fused after a bias (LinearBiasActivation) the saved input is x - bias and
    the bias is saved too, so the pre-activation never has to be stored."""

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
            ctx.save_for_backward(self._saved_input(x, next_op_input_quantizer), bias)
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


class _GatedActivation(_Activation):
    """act(a) * g with a, g = x.chunk(2, dim=-1): halves the last dimension."""

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer):
        del prev_op_grad_output_quantizer
        x = high_precision(input_).contiguous()
        fp8_out = direct_fp8_args(next_op_input_quantizer)
        y = fused.gated_activation(x, self.activation, fp8_out=fp8_out)
        if fp8_out is not None:
            y = wrap_kernel_output(y, next_op_input_quantizer, x.dtype)
        if ctx.input_requires_grad:
            ctx.save_for_backward(self._saved_input(x, next_op_input_quantizer))
        return y

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        dy = high_precision(grad_output).contiguous()
        return fused.gated_activation_backward(dy, high_precision(x), self.activation), ()


class GELU(_BiasActivation):
    """GELU with the tanh approximation (= torch.nn.functional.gelu(x, approximate="tanh"))."""

    activation = "gelu"


class QGELU(_BiasActivation):
    """Quick GELU: x * sigmoid(1.702 x)."""

    activation = "qgelu"


class ReLU(_BiasActivation):
    """max(x, 0); a NaN input gives 0, as TE's."""

    activation = "relu"


class SReLU(_BiasActivation):
    """Squared ReLU: relu(x)^2."""

    activation = "srelu"


class SiLU(_BiasActivation):
    """SiLU (swish): x * sigmoid(x)."""

    activation = "silu"


class GEGLU(_GatedActivation):
    """gelu(a) * g (tanh approximation)."""

    activation = "geglu"


class QGEGLU(_GatedActivation):
    """qgelu(a) * g."""

    activation = "qgeglu"


class ReGLU(_GatedActivation):
    """relu(a) * g."""

    activation = "reglu"


class SReGLU(_GatedActivation):
    """relu(a)^2 * g."""

    activation = "sreglu"


class SwiGLU(_GatedActivation):
    """silu(a) * g."""

    activation = "swiglu"
