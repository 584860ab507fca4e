"""Bias: y = x + b over the last dimension."""

import torch

from ... import amp
from ...kernels import fused
from ...kernels.bias_grad import bias_grad
from .. import _tensor_parallel as tp
from .._fp8_io import direct_fp8_args, high_precision, wrap_kernel_output
from ..op import BasicOperation


class Bias(BasicOperation):
    """Adds a bias of `size` elements. create_bias=False: the caller passes `bias=` to each forward.

    tensor_parallel=True: the bias of a column-parallel linear, `size` global and
    size / TP size elements on each rank (tagged as a tensor-parallel parameter).
    """

    def __init__(self, size: int, *, device=None, dtype=None, tensor_parallel: bool = False,
                 tensor_parallel_group=None, tensor_parallel_size=None, create_bias: bool = True):
        super().__init__()
        ranks = 1
        if tensor_parallel:
            ranks = tensor_parallel_size if tensor_parallel_size is not None else tp.world_size(tensor_parallel_group)
        if int(size) % ranks:
            raise ValueError(f"Bias size ({size}) must be divisible by the TP size {ranks}")
        self.size = int(size) // ranks
        if create_bias:
            self.bias = torch.nn.Parameter(torch.zeros(self.size, device=device, dtype=dtype))
            self.bias.tensor_model_parallel = False
            if tensor_parallel:
                tp.mark_parallel_param(self.bias, 0)
        else:
            self.bias = None

    def reset_parameters(self) -> None:
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def op_params(self, bias=None, **kwargs):
        del kwargs
        return (self.bias if bias is None else bias,)

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer, bias=None):
        b = self.bias if bias is None else bias
        x = high_precision(input_)
        if x.shape[-1] != self.size:
            raise ValueError(f"input's last dimension must be {self.size} for Bias, got shape {tuple(x.shape)}")
        ctx.bias_requires_grad = b.requires_grad
        b = amp.cast(b, ctx.autocast_dtype)
        ctx.grad_input_quantizer = prev_op_grad_output_quantizer
        fp8_out = direct_fp8_args(next_op_input_quantizer)
        if fp8_out is None:
            return x + b
        y = fused.bias_activation(x.contiguous(), b, "none", fp8_out=fp8_out)
        return wrap_kernel_output(y, next_op_input_quantizer, x.dtype)

    def op_backward(self, ctx, grad_output):
        dy = high_precision(grad_output)
        db = bias_grad(dy.reshape(-1, self.size)) if ctx.bias_requires_grad else None
        return dy, (db,)

    def onnx_forward(self, input_, bias=None):
        b = self.bias if bias is None else bias
        return (input_.float() + b.float()).to(input_.dtype), ()
