"""Normalization ops over the last dimension: RMSNorm and LayerNorm, on the fused kernels."""

from typing import Iterable, Union

import torch

from ... import amp
from ...kernels import fused
from .._fp8_io import direct_fp8_args, high_precision, wrap_kernel_output
from ..op import BasicOperation


def _feature_size(normalized_shape: Union[int, Iterable[int]]) -> int:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(f"te_fuser norms normalize over the last dimension only; got normalized_shape {shape}")
    return int(shape[0])


class _Norm(BasicOperation):
    """create_params=False leaves weight (and bias) to the caller, passed to each forward as the
    `weight` / `bias` keywords (the modules do this to keep TransformerEngine's parameter names)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, *, device=None, dtype=None,
                 zero_centered_gamma: bool = False, with_bias: bool, create_params: bool = True):
        super().__init__()
        self.size = _feature_size(normalized_shape)
        if self.size <= 0:
            raise ValueError(f"normalized_shape must be positive, got {normalized_shape}")
        self.eps = float(eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.with_bias = bool(with_bias)
        self.weight = self.bias = None
        if create_params:
            self.weight = torch.nn.Parameter(torch.empty(self.size, device=device, dtype=dtype))
            if with_bias:
                self.bias = torch.nn.Parameter(torch.empty(self.size, device=device, dtype=dtype))
            if self.weight.device.type != "meta":
                self.reset_parameters()

    def reset_parameters(self) -> None:
        self.init_params(self.weight, self.bias)

    def init_params(self, weight, bias) -> None:
        """weight = 1 (0 with zero_centered_gamma), bias = 0."""
        with torch.no_grad():
            weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if bias is not None:
                bias.zero_()

    def op_params(self, weight=None, bias=None, **kwargs):
        del kwargs
        # getattr, not _parameters: under FSDP1 the parameters are plain attributes.
        weight = self.weight if weight is None else weight
        if not self.with_bias:
            return (weight,)
        return (weight, self.bias if bias is None else bias)

    def _input(self, input_) -> torch.Tensor:
        x = high_precision(input_).contiguous()
        if x.shape[-1] != self.size:
            raise ValueError(f"input's last dimension must be {self.size}, got shape {tuple(x.shape)}")
        return x

    def _onnx_weight(self, weight) -> torch.Tensor:
        w = self.op_params(weight)[0].float()
        return w + 1 if self.zero_centered_gamma else w

    def _output(self, y, next_op_input_quantizer, fp8_out, dtype):
        return wrap_kernel_output(y, next_op_input_quantizer, dtype) if fp8_out is not None else y


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x^2) + eps) * weight (weight + 1 with zero_centered_gamma)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, *, device=None, dtype=None,
                 zero_centered_gamma: bool = False, create_params: bool = True):
        super().__init__(normalized_shape, eps, device=device, dtype=dtype,
                         zero_centered_gamma=zero_centered_gamma, with_bias=False, create_params=create_params)

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer, weight=None):
        del prev_op_grad_output_quantizer
        x = self._input(input_)
        weight = amp.cast(self.op_params(weight)[0], ctx.autocast_dtype)
        fp8_out = direct_fp8_args(next_op_input_quantizer)
        y, rstd = fused.rmsnorm(x, weight, self.eps, self.zero_centered_gamma, fp8_out=fp8_out)
        if ctx.input_requires_grad or any(ctx.params_require_grad):
            ctx.save_for_backward(x, rstd, weight)
        return self._output(y, next_op_input_quantizer, fp8_out, x.dtype)

    def op_backward(self, ctx, grad_output):
        x, rstd, weight = ctx.saved_tensors
        dy = high_precision(grad_output).contiguous()
        dx, dw = fused.rmsnorm_backward(dy, x, rstd, weight, self.zero_centered_gamma)
        return dx, (dw if ctx.params_require_grad[0] else None,)

    def onnx_forward(self, input_, weight=None):
        x = input_.float()
        y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self._onnx_weight(weight)
        return y.to(input_.dtype), ()


class LayerNorm(_Norm):
    """y = (x - mean) / sqrt(var + eps) * weight + bias (weight + 1 with zero_centered_gamma)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, *, device=None, dtype=None,
                 zero_centered_gamma: bool = False, create_params: bool = True):
        super().__init__(normalized_shape, eps, device=device, dtype=dtype,
                         zero_centered_gamma=zero_centered_gamma, with_bias=True, create_params=create_params)

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer,
                   weight=None, bias=None):
        del prev_op_grad_output_quantizer
        x = self._input(input_)
        weight, bias = (amp.cast(p, ctx.autocast_dtype) for p in self.op_params(weight, bias))
        fp8_out = direct_fp8_args(next_op_input_quantizer)
        y, mean, rstd = fused.layernorm(x, weight, bias, self.eps, self.zero_centered_gamma, fp8_out=fp8_out)
        if ctx.input_requires_grad or any(ctx.params_require_grad):
            ctx.save_for_backward(x, mean, rstd, weight)
        return self._output(y, next_op_input_quantizer, fp8_out, x.dtype)

    def op_backward(self, ctx, grad_output):
        x, mean, rstd, weight = ctx.saved_tensors
        dy = high_precision(grad_output).contiguous()
        dx, dw, db = fused.layernorm_backward(dy, x, mean, rstd, weight, self.zero_centered_gamma)
        return dx, (dw if ctx.params_require_grad[0] else None, db if ctx.params_require_grad[1] else None)

    def onnx_forward(self, input_, weight=None, bias=None):
        b = self.op_params(weight, bias)[1].float()
        y = torch.nn.functional.layer_norm(input_.float(), (self.size,), self._onnx_weight(weight), b, self.eps)
        return y.to(input_.dtype), ()
