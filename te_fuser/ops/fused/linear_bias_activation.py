"""Forward fusion: BasicLinear + Bias (+ an element-wise activation) in one step."""

from typing import Optional

from ... import amp
from ..basic.activation import _BiasActivation
from ..basic.bias import Bias
from ..basic.linear import BasicLinear
from ..op import FusedOperation


class LinearBiasActivation(FusedOperation):
    """y = act(x @ W.T + b).

    Without an activation the bias goes into the GEMM (addmm; the FP8 GEMM's
    bias epilogue on CUDA). With one, the GEMM output z is followed by a single
    bias + activation kernel that may write FP8 for the next linear; the
    activation's context keeps z and the bias (not z + b), so nothing extra is
    stored for its backward.
    """

    def __init__(self, linear: BasicLinear, bias: Bias, activation: Optional[_BiasActivation] = None):
        super().__init__((linear, bias) if activation is None else (linear, bias, activation))

    @property
    def linear(self) -> BasicLinear:
        return self._basic_ops[0]

    @property
    def bias(self) -> Bias:
        return self._basic_ops[1]

    @property
    def activation(self) -> Optional[_BiasActivation]:
        return self._basic_ops[2] if len(self._basic_ops) == 3 else None

    @staticmethod
    def applies_to(linear: BasicLinear) -> bool:
        # A row-parallel linear reduces its output across ranks before the bias is added.
        return linear.tensor_parallel_mode != "row" or linear.tensor_parallel_size == 1

    def fuser_forward(self, ctxs, input_, prev_op_grad_output_quantizer, next_op_input_quantizer, kwargs_list):
        linear_ctx, bias_ctx = ctxs[0], ctxs[1]
        linear_kwargs, bias_kwargs = kwargs_list[0], kwargs_list[1]
        weight = linear_kwargs.get("weight") if linear_kwargs.get("weight") is not None else self.linear.weight
        b = bias_kwargs.get("bias") if bias_kwargs.get("bias") is not None else self.bias.bias
        linear_ctx.grad_input_quantizer = prev_op_grad_output_quantizer
        bias_ctx.bias_requires_grad = b.requires_grad
        b = amp.cast(b, linear_ctx.autocast_dtype)
        bias_ctx.grad_input_quantizer = self.linear.grad_output_quantizer()
        first_microbatch = linear_kwargs.get("is_first_microbatch")
        gathered = bool(linear_kwargs.get("input_gathered", False))
        if self.activation is None:
            return self.linear.forward_gemm(linear_ctx, input_, weight, b, first_microbatch, gathered)
        z = self.linear.forward_gemm(linear_ctx, input_, weight, None, first_microbatch, gathered)
        return self.activation.forward_with_bias(ctxs[2], z, b, self.linear.grad_output_quantizer(),
                                                 next_op_input_quantizer)
