"""AddExtraInput (and TE 2.6's AddInPlace): the chain's tensor plus a tensor the caller passes in."""

import torch

from .._fp8_io import high_precision
from ..op import BasicOperation


class AddExtraInput(BasicOperation):
    """y = x + e, where e is an extra input of the fuser (Sequential(x, e), op(x, e)); both gradients are dy.

    in_place=True adds x into e's own memory and returns it (TE's semantics: e is changed, and its
    autograd history is not; for callers that hand over a buffer they no longer need).
    """

    num_extra_inputs = 1

    def __init__(self, *, in_place: bool = False):
        super().__init__()
        if not isinstance(in_place, bool):
            raise TypeError(f"in_place must be a bool, got {type(in_place).__name__}")
        self.in_place = in_place

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer):
        del prev_op_grad_output_quantizer, next_op_input_quantizer
        (extra,) = ctx.extra_inputs
        return self.add(high_precision(input_), extra)

    def add(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        """x + extra, or extra += x when in place. Shared with the fused linear + add."""
        extra = high_precision(extra)
        if extra.shape != x.shape:
            raise ValueError(f"the extra input's shape {tuple(extra.shape)} must be the input's {tuple(x.shape)}")
        if not self.in_place:
            return x + extra
        out = extra.detach()
        out += x
        return out

    def op_backward(self, ctx, grad_output):
        dy = high_precision(grad_output)
        ctx.grad_extra_inputs = (dy,)
        return dy, ()

    def onnx_forward(self, input_, extra):
        if extra.shape != input_.shape:
            raise ValueError(f"the extra input's shape {tuple(extra.shape)} must be the input's {tuple(input_.shape)}")
        return (input_.float() + extra.float()).to(input_.dtype), ()


class AddInPlace(AddExtraInput):
    """TE 2.6's name: AddExtraInput(in_place=True)."""

    def __init__(self):
        super().__init__(in_place=True)
