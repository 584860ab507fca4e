"""QuantizedTensor and Quantizer, the bases of te_fuser's quantized formats, and saving them for backward.

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

import copy
from typing import List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_map

from ..kernels.validate import check_tensor


def _dequantized(t):
    return t.dequantize() if isinstance(t, QuantizedTensor) else t


def _written_arguments(func, args, kwargs, high_args, high_kwargs):
    """(original, high-precision stand-in) of every argument the op writes to; a written list (the
    foreach ops optimizers call with foreach=True or fused=True) item by item."""
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if i < len(args):
            original, high = args[i], high_args[i]
        elif argument.name in kwargs:
            original, high = kwargs[argument.name], high_kwargs[argument.name]
        else:
            continue
        if isinstance(original, (list, tuple)):
            yield from zip(original, high)
        else:
            yield original, high


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

    # How many tensors prepare_for_saving() hands over; restore_from_saved() takes them back.
    SAVED_TENSORS = 0

    def prepare_for_saving(self) -> Tuple[List[Optional[torch.Tensor]], object]:
        """Hand the buffers over for ctx.save_for_backward: (the buffers, the shell to keep on ctx)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement prepare_for_saving()")

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not implement dequantize()")

    def quantize_(self, src: torch.Tensor) -> "QuantizedTensor":
        """Write src (high precision) into this tensor's buffers, with its own scaling."""
        raise NotImplementedError(f"{type(self).__name__} does not implement quantize_()")

    def _adopt(self, other: "QuantizedTensor") -> None:
        """Take other's buffers, format and quantizer (other: of this type and shape)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _adopt()")

    @torch.no_grad()
    def _set_data(self, tensor: torch.Tensor) -> None:
        """`t.data = tensor`, TE's semantics: a quantized tensor of t's kind and shape lends t its buffers (and
        its nominal dtype and device); any other tensor is quantized into t's buffers with t's scaling."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{type(self).__name__}.data must be set to a tensor, got {type(tensor).__name__}")
        if tuple(tensor.shape) != tuple(self.shape):
            raise ValueError(f"{type(self).__name__}.data: a tensor of shape {tuple(tensor.shape)} cannot replace "
                             f"the data of shape {tuple(self.shape)}")
        if type(tensor) is type(self):
            if tensor.dtype != self.dtype or tensor.device != self.device:
                torch._C.TensorBase.data.__set__(self, tensor)  # the wrapper's nominal dtype and device
            self._adopt(tensor)
            return
        self.quantize_(tensor)

    # torch's own getter (a detached alias); torch's setter would replace only the wrapper's metadata and leave
    # the quantized buffers as they were
    data = property(torch._C.TensorBase.data.__get__, _set_data)

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
            _bump_versions(orig)
        if written and func._schema.returns and func._schema.returns[0].alias_info is not None:
            return written[0][0] if len(func._schema.returns) == 1 else tuple(orig for orig, _ in written)
        return result

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


def _bump_versions(t: QuantizedTensor) -> None:
    """Count a write into t's buffers on their version counters. Writes made inside __torch_dispatch__ run
    below autograd's ADInplaceOrView key, which would count them: without this, a buffer saved for backward
    (a quantized weight's bytes) and then overwritten (an optimizer step before backward) went unnoticed."""
    for inner in (getattr(t, name) for name in t.__tensor_flatten__()[0]):
        if isinstance(inner, QuantizedTensor):  # a view of another quantized tensor
            _bump_versions(inner)
        else:
            torch.autograd.graph.increment_version(inner)


def to_op(func, args, kwargs, moved):
    """aten to / _to_copy on a quantized tensor: another dtype dequantizes; another device (or a copy)
    keeps the format, as moved(tensor, device) builds it; otherwise the tensor itself."""
    names = [argument.name for argument in func._schema.arguments]
    bound = {**dict(zip(names, args)), **kwargs}
    t, other = bound["self"], bound.get("other")
    dtype = other.dtype if other is not None else bound.get("dtype")
    device = other.device if other is not None else bound.get("device")
    device = torch.device(device) if device is not None else t.device
    if dtype is not None and dtype != t.dtype:
        return t.dequantize(dtype).to(device)
    if device == t.device and func != torch.ops.aten._to_copy.default and not bound.get("copy", False):
        return t
    return moved(t, device)


class Quantizer:
    """Turns a high-precision tensor into a QuantizedTensor; says which layouts that tensor carries.

    TransformerEngine's Quantizer: keyword-only usages in the constructor, `set_usage`, `quantize`
    (`out=` writes into an existing tensor), `update_quantized`, `make_empty`, `calibrate`, `copy`.

    rowwise_usage:    the data in the tensor's own layout (forward GEMMs); te_fuser always keeps it
    columnwise_usage: also the transposed data (the weight-gradient GEMM), from the same pass
    internal:         TE's request for its storage-only tensor class; te_fuser always returns the
                      tensor subclass, which carries the same attributes
    """

    def __init__(self, *, rowwise: bool = True, columnwise: bool = True):
        self.internal = False
        self.rowwise_usage = True
        self.columnwise_usage = False
        self.set_usage(rowwise=rowwise, columnwise=columnwise)

    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        if rowwise is not None and not rowwise:
            raise ValueError("rowwise usage cannot be turned off: te_fuser always keeps the row-major data")
        if columnwise is not None:
            self.columnwise_usage = bool(columnwise)

    def quantize(self, tensor: torch.Tensor, *, out: Optional["QuantizedTensor"] = None,
                 dtype: Optional[torch.dtype] = None) -> "QuantizedTensor":
        """tensor quantized; with out=, written into out's buffers (update_quantized) and out returned.
        dtype is TE's hook for other quantizers and is not used by te_fuser's."""
        del dtype
        if out is not None:
            return self.update_quantized(tensor, out)
        return self._quantize(tensor)

    def _quantize(self, x: torch.Tensor) -> "QuantizedTensor":
        raise NotImplementedError(f"{type(self).__name__} does not implement quantize()")

    def update_quantized(self, src: torch.Tensor, dst: "QuantizedTensor", *,
                         noop_flag: Optional[torch.Tensor] = None) -> "QuantizedTensor":
        raise NotImplementedError(f"{type(self).__name__} does not implement update_quantized()")

    def make_empty(self, shape, *, dtype: torch.dtype = torch.float32, device=None,
                   requires_grad: bool = False) -> "QuantizedTensor":
        raise NotImplementedError(f"{type(self).__name__} does not implement make_empty()")

    def calibrate(self, tensor: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement calibrate()")

    def copy(self) -> "Quantizer":
        """A shallow copy (TE's): the same scaling-state tensors, its own usages."""
        return copy.copy(self)

    def _get_compatible_recipe(self):
        """The recipe class whose fp8_autocast may run a weight this quantizer made (TE's); None: any."""
        return None

    def __call__(self, x: torch.Tensor) -> QuantizedTensor:
        check_tensor(x, "x")
        return self.quantize(x)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rowwise_usage={self.rowwise_usage}, "
                f"columnwise_usage={self.columnwise_usage})")


# -- saving for backward without keeping tensors on ctx ------------------------------------------
#
#     tensors, objects = prepare_for_saving(x, w_fp8, None)
#     ctx.save_for_backward(*tensors)
#     ctx.tensor_objects = objects            # shells only: no tensor memory
#     ...
#     x, w_fp8, _ = restore_from_saved(ctx.tensor_objects, ctx.saved_tensors)
#     ctx.tensor_objects = None               # the shells now hold buffers again: drop them
#
# The last line is the fix of TransformerEngine's fuser and FP8-attention leaks: autograd frees what
# save_for_backward holds after backward, but a plain ctx attribute lives as long as the graph node,
# one iteration too long.

def prepare_for_saving(*objs) -> Tuple[List[Optional[torch.Tensor]], list]:
    """Split tensors, quantized tensors and Nones into tensors to save and the shells to keep."""
    tensors: List[Optional[torch.Tensor]] = []
    objects: list = []
    for obj in objs:
        if isinstance(obj, QuantizedTensor):
            # Called through the class: dynamo would put a method called on a traced tensor subclass
            # into the graph as an op, and an op cannot return the shell.
            parts, shell = type(obj).prepare_for_saving(obj)
            tensors.extend(parts)
            objects.append(shell)
        elif obj is None or isinstance(obj, torch.Tensor):
            tensors.append(obj)
            objects.append(None)
        else:
            raise TypeError(f"prepare_for_saving takes tensors, quantized tensors or None, got {type(obj).__name__}")
    return tensors, objects


def restore_from_saved(objects: Sequence[object], saved: Sequence[Optional[torch.Tensor]]) -> list:
    """Inverse of prepare_for_saving: the original objects, in order.

    A shell is the emptied QuantizedTensor itself, or under torch.compile a record of its metadata
    (a traced subclass cannot be emptied in place), which rebuilds a new one."""
    needed = sum(1 if shell is None else shell.SAVED_TENSORS for shell in objects)
    if needed != len(saved):
        raise RuntimeError(f"restore_from_saved: {len(saved)} saved tensors but the objects use {needed}")
    out = []
    pos = 0
    for shell in objects:
        if shell is None:
            out.append(saved[pos])
            pos += 1
            continue
        parts = list(saved[pos:pos + shell.SAVED_TENSORS])
        pos += shell.SAVED_TENSORS
        if isinstance(shell, QuantizedTensor):
            shell.restore_from_saved(parts)
            out.append(shell)
        else:
            out.append(shell.rebuild(parts))
    return out
