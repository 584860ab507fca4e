"""QuantizedTensor: the base of te_fuser's quantized tensors, under TransformerEngine's name.

A QuantizedTensor is a torch.Tensor wrapper subclass: it has the shape, nominal dtype and device
of the high-precision tensor it stands for, carries autograd like any tensor, and keeps its
quantized buffers as attributes (the wrapper itself owns no storage). Client code tests
`isinstance(x, QuantizedTensor)` to find quantized parameters and activations.

What an op does with it (the table subclasses extend, see Float8Tensor.OPS):
- ops with a quantized meaning (views, detach, clone, copy_, moving device) keep it quantized;
- in-place ops on it compute in high precision and quantize the result back into its buffers
  with its own scale (so an optimizer can step an FP8 weight directly, at FP8's precision);
- every other op dequantizes its quantized arguments and returns plain tensors.
"""

from typing import Optional

import torch
from torch.utils._pytree import tree_map


def _dequantized(t):
    return t.dequantize() if isinstance(t, QuantizedTensor) else t


def _written_arguments(func, args, kwargs, high_args, high_kwargs):
    """(original, high-precision stand-in) of every argument the op writes to."""
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if i < len(args):
            yield args[i], high_args[i]
        elif argument.name in kwargs:
            yield kwargs[argument.name], high_kwargs[argument.name]


class QuantizedTensor(torch.Tensor):
    """A tensor held in a quantized format; `dequantize()` gives it back in high precision."""

    # Torch functions go straight to __torch_dispatch__, below autograd: autograd records ops on
    # the wrapper, and the dispatch table sees wrappers without autograd.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, shape, dtype: torch.dtype, device: torch.device, requires_grad: bool = False, strides=None):
        # strides: those of the quantized data when it is a strided view (default: contiguous), so
        # torch's reshape/contiguous decide view-or-copy from the layout the bytes really have.
        layout = {} if strides is None else {"strides": strides}  # (torch.compile traces no strides=None)
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device,
                                                   requires_grad=requires_grad, **layout)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not implement dequantize()")

    def quantize_(self, src: torch.Tensor) -> "QuantizedTensor":
        """Write src (high precision) into this tensor's buffers, with its own scaling."""
        raise NotImplementedError(f"{type(self).__name__} does not implement quantize_()")

    @classmethod
    def _handled_op(cls, func, args, kwargs):
        """The op's result if cls gives it a quantized meaning, else NotImplemented."""
        return NotImplemented

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = cls._handled_op(func, args, kwargs)
        if result is not NotImplemented:
            return result
        high_args, high_kwargs = tree_map(_dequantized, (args, kwargs))
        result = func(*high_args, **high_kwargs)
        # Written-to quantized arguments (in place, out=): quantize the new values back into them.
        written = [(orig, new) for orig, new in _written_arguments(func, args, kwargs, high_args, high_kwargs)
                   if isinstance(orig, QuantizedTensor)]
        for orig, new in written:
            orig.quantize_(new)
        if written and func._schema.returns and func._schema.returns[0].alias_info is not None:
            return written[0][0] if len(func._schema.returns) == 1 else tuple(orig for orig, _ in written)
        return result

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"
