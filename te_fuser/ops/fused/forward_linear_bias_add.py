"""Forward fusion: BasicLinear (+ Bias) + AddExtraInput, y = x W^T (+ b) + extra input."""

from typing import Optional

from ... import amp
from ..basic.add_extra_input import AddExtraInput
from ..basic.bias import Bias
from ..basic.linear import BasicLinear
from ..op import FusedOperation
from .linear_bias_activation import LinearBiasActivation


class ForwardLinearBiasAdd(FusedOperation):
    """TE's ForwardLinearBiasAdd. In high precision, out of place, the GEMM accumulates onto the extra
    input (addmm, beta = 1), so no separate x W^T tensor is made; otherwise (FP8, in place, another
    dtype) the GEMM output gets the extra input added. The backward is the basic ops'."""

    def __init__(self, linear: BasicLinear, bias: Optional[Bias], add: AddExtraInput):
        super().__init__((linear, add) if bias is None else (linear, bias, add))

    applies_to = staticmethod(LinearBiasActivation.applies_to)

    def fuser_forward(self, ctxs, input_, prev_op_grad_output_quantizer, next_op_input_quantizer, kwargs_list):
        del next_op_input_quantizer
        linear: BasicLinear = self._basic_ops[0]
        add: AddExtraInput = self._basic_ops[-1]
        linear_ctx, linear_kwargs = ctxs[0], kwargs_list[0]
        (extra,) = ctxs[-1].extra_inputs
        weight = linear_kwargs.get("weight") if linear_kwargs.get("weight") is not None else linear.weight
        linear_ctx.grad_input_quantizer = prev_op_grad_output_quantizer
        b = None
        if len(self._basic_ops) == 3:
            bias_op: Bias = self._basic_ops[1]
            b = kwargs_list[1].get("bias") if kwargs_list[1].get("bias") is not None else bias_op.bias
            ctxs[1].bias_requires_grad = b.requires_grad
            ctxs[1].grad_input_quantizer = linear.grad_output_quantizer()
            b = amp.cast(b, linear_ctx.autocast_dtype)
        first_microbatch = linear_kwargs.get("is_first_microbatch")
        gathered = bool(linear_kwargs.get("input_gathered", False))
        lead = list(input_.shape[:-1])
        if linear.gathers_input and not gathered and lead:
            lead[0] *= linear.tensor_parallel_size
        out_dtype = linear_ctx.autocast_dtype or weight.dtype
        if (not linear.fp8_enabled and not add.in_place and extra.dtype == out_dtype
                and tuple(extra.shape) == (*lead, linear.local_out_features)):
            y = linear.forward_gemm(linear_ctx, input_, weight, extra.reshape(-1, linear.local_out_features),
                                    first_microbatch, gathered)
            return y if b is None else y.add_(b)
        y = linear.forward_gemm(linear_ctx, input_, weight, b, first_microbatch, gathered)
        return add.add(y, extra)
