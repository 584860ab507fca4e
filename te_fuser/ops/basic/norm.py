"""Normalization ops over the last dimension: RMSNorm and LayerNorm, on the fused kernels."""

from typing import Iterable, Union

import torch

from ...kernels import fused
from .._fp8_io import direct_fp8_args, high_precision, wrap_kernel_output
from ..op import BasicOperation


def _feature_size(normalized_shape: Union[int, Iterable[int]]) -> int:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(f"te_fuser norms normalize over the last dimension only; got normalized_shape {shape}")
    return int(shape[0])


class _Norm(BasicOperation):
    def __init__(self, normalized_shape, eps: float = 1e-5, *, device=None, dtype=None,
                 zero_centered_gamma: bool = False, with_bias: bool):
        super().__init__()
        self.size = _feature_size(normalized_shape)
        self.eps = float(eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.weight = torch.nn.Parameter(torch.empty(self.size, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(self.size, device=device, dtype=dtype)) if with_bias else None
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.zeros_(self.weight) if self.zero_centered_gamma else torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def _input(self, input_) -> torch.Tensor:
        x = high_precision(input_).contiguous()
        if x.shape[-1] != self.size:
            raise ValueError(f"input's last dimension must be {self.size}, got shape {tuple(x.shape)}")
        return x

    def _output(self, y, next_op_input_quantizer, fp8_out, dtype):
        return wrap_kernel_output(y, next_op_input_quantizer, dtype) if fp8_out is not None else y


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x^2) + eps) * weight (weight + 1 with zero_centered_gamma)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, *, device=None, dtype=None,
                 zero_centered_gamma: bool = False):
        super().__init__(normalized_shape, eps, device=device, dtype=dtype,
                         zero_centered_gamma=zero_centered_gamma, with_bias=False)

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer):
        del prev_op_grad_output_quantizer
        x = self._input(input_)
        fp8_out = direct_fp8_args(next_op_input_quantizer)
        y, rstd = fused.rmsnorm(x, self.weight, self.eps, self.zero_centered_gamma, fp8_out=fp8_out)
        if ctx.input_requires_grad or any(ctx.params_require_grad):
            ctx.save_for_backward(x, rstd)
        return self._output(y, next_op_input_quantizer, fp8_out, x.dtype)

    def op_backward(self, ctx, grad_output):
        x, rstd = ctx.saved_tensors
        dy = high_precision(grad_output).contiguous()
        dx, dw = fused.rmsnorm_backward(dy, x, rstd, self.weight, self.zero_centered_gamma)
        return dx, (dw if ctx.params_require_grad[0] else None,)


class LayerNorm(_Norm):
    """y = (x - mean) / sqrt(var + eps) * weight + bias (weight + 1 with zero_centered_gamma)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, *, device=None, dtype=None,
                 zero_centered_gamma: bool = False):
        super().__init__(normalized_shape, eps, device=device, dtype=dtype,
                         zero_centered_gamma=zero_centered_gamma, with_bias=True)

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer):
        del prev_op_grad_output_quantizer
        x = self._input(input_)
        fp8_out = direct_fp8_args(next_op_input_quantizer)
        y, mean, rstd = fused.layernorm(x, self.weight, self.bias, self.eps, self.zero_centered_gamma,
                                        fp8_out=fp8_out)
        if ctx.input_requires_grad or any(ctx.params_require_grad):
            ctx.save_for_backward(x, mean, rstd)
        return self._output(y, next_op_input_quantizer, fp8_out, x.dtype)

    def op_backward(self, ctx, grad_output):
        x, mean, rstd = ctx.saved_tensors
        dy = high_precision(grad_output).contiguous()
        dx, dw, db = fused.layernorm_backward(dy, x, mean, rstd, self.weight, self.zero_centered_gamma)
        return dx, (dw if ctx.params_require_grad[0] else None, db if ctx.params_require_grad[1] else None)
