"""The bias gradient (the column sums of the output gradient), the same bits eager or compiled.

Eager calls torch's sum. Under torch.compile the sum is an opaque op, te_fuser::bias_grad, that runs
the same torch sum: inductor would otherwise generate its own reduction, whose summation order
differs, and compiled training would drift from eager in the last bits from the first bias update.
"""

import torch


@torch.library.custom_op("te_fuser::bias_grad", mutates_args=())
def _bias_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.sum(0)


@_bias_grad.register_fake
def _(grad):
    return grad.new_empty(grad.shape[1:])


def bias_grad(grad: torch.Tensor) -> torch.Tensor:
    """grad.sum(0) for a 2-D grad (rows: tokens)."""
    if torch.compiler.is_compiling():
        return _bias_grad(grad)
    return grad.sum(0)


class _AddBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        del ctx
        return x + bias

    @staticmethod
    def backward(ctx, grad):
        del ctx
        return grad, bias_grad(grad.reshape(-1, grad.shape[-1]))


def add_bias(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x + bias over the last dimension. Eager: torch's add and its autograd (the bias gradient is torch's
    sum over the other dimensions). Under torch.compile: the bias gradient is te_fuser::bias_grad, the same
    sum (see above)."""
    if torch.compiler.is_compiling():
        return _AddBias.apply(x, bias)
    return x + bias
