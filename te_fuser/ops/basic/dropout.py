"""Dropout, as TE's op: in training, entries zeroed with probability p and the rest scaled by 1/(1-p)."""

import numbers

import torch

from .._fp8_io import high_precision
from ..op import BasicOperation


class Dropout(BasicOperation):
    """y = x * m / (1 - p) with m ~ Bernoulli(1 - p), drawn from torch's generator of x's device (so
    torch.manual_seed makes a run reproducible); the identity in eval mode or for p = 0. The backward
    keeps m as a bool tensor (one byte an entry): dx = dy * m / (1 - p)."""

    def __init__(self, p: float):
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
            raise ValueError(f"p (the dropout probability) must be a number in [0, 1], got {p!r}")
        self.dropout_probability = float(p)

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer):
        del prev_op_grad_output_quantizer, next_op_input_quantizer
        p = self.dropout_probability
        ctx.active = self.training and p > 0.0
        if not ctx.active:
            return input_
        x = high_precision(input_)
        mask = torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(1.0 - p)
        ctx.scale = 1.0 / (1.0 - p) if p < 1.0 else 0.0
        if ctx.input_requires_grad:
            ctx.save_for_backward(mask)
        return (x * mask).mul_(ctx.scale)

    def op_backward(self, ctx, grad_output):
        if not ctx.active:
            return grad_output, ()
        (mask,) = ctx.saved_tensors
        return (high_precision(grad_output) * mask).mul_(ctx.scale), ()

    def onnx_forward(self, input_):
        return input_, ()  # an inference graph: dropout off
