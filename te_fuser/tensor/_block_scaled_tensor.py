"""What MXFP8Tensor, Float8BlockwiseQTensor and NVFP4Tensor share: their buffers (rowwise data and
scales, columnwise data and scales, and any a format adds), saving them for backward, moving and
copying them, pickling.

A subclass says how its buffers are made (its quantizer) and read back (`_dequantize_usage`), which
buffers it adds (`_BUFFERS`, passed to the constructor by name and taken by `_set_meta`), what its
data holds (`_check_data`), and which extra metadata it carries (`_meta`).
"""

import copy
from typing import List, Optional, Tuple

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from ..kernels.validate import FLOAT_DTYPES, check_fp8_dtype
from ..te_dtype import DType, fp8_torch_dtype
from . import _block_scaled_rows as row_cuts
from .quantized_tensor import QuantizedTensor, Quantizer, to_op

aten = torch.ops.aten

BUFFERS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv")


def traced_quantizer(quantizer):
    """The quantizer a block-scaled tensor made now keeps: none while dynamo traces, where a tensor subclass made
    in the graph takes tensors and constants only (as a Float8Tensor cast in the graph, it then has nothing to
    requantize with; the graph's tensors are GEMM operands, never written in place)."""
    return None if torch.compiler.is_compiling() else quantizer


def fp8_data(t: "BlockScaledTensor", columnwise: bool = False) -> Optional[torch.Tensor]:
    """A usage's data bytes viewed as t's float8 dtype, as the GEMMs and dequantize kernels take them (None
    when that usage is not held). A function rather than a property: torch.compile reads a property of a
    tensor subclass made in the graph as constant metadata, which a tensor is not; a function is traced."""
    data = t._columnwise_data if columnwise else t._rowwise_data
    return None if data is None else data.view(t._fp8_dtype)


def _as_bytes(data: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """FP8 data as the uint8 bytes TE keeps: a view of the same bytes, never a conversion of values."""
    return data if data is None or data.dtype == torch.uint8 else data.view(torch.uint8)


class BlockScaledTensor(QuantizedTensor):
    """A tensor quantized to FP8 with per-block scales, in one or both usages.

    _rowwise_data, _rowwise_scale_inv:       the data in the tensor's layout and its scales
    _columnwise_data, _columnwise_scale_inv: the data scaled along the other dimension (the
                                             weight-gradient GEMM's operand) and its scales
    The data are uint8 bytes, as TE keeps them (given as bytes or in the FP8 dtype); fp8_data() views them
    as the FP8 dtype.
    _fp8_dtype:  the dtype of the data's codes; _quantizer: what requantizes it (copy_, in-place ops)
    dtype:       the nominal dtype it stands for
    """

    _BUFFERS = BUFFERS
    SAVED_TENSORS = len(BUFFERS)

    @staticmethod
    def __new__(cls, shape, dtype: torch.dtype, *, rowwise_data=None, rowwise_scale_inv=None,
                columnwise_data=None, columnwise_scale_inv=None, fp8_dtype=torch.float8_e4m3fn, quantizer=None,
                requires_grad: bool = False, **meta):
        if isinstance(fp8_dtype, DType):  # TE's enum, as TE's constructors take it
            fp8_dtype = fp8_torch_dtype(fp8_dtype)
        cls._check_data(fp8_dtype, rowwise_data, columnwise_data)
        rowwise_data, columnwise_data = _as_bytes(rowwise_data), _as_bytes(columnwise_data)
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype (the nominal dtype) must be one of {FLOAT_DTYPES}, got {dtype}")
        buffers = (rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv)
        if (rowwise_data is None) != (rowwise_scale_inv is None) or \
                (columnwise_data is None) != (columnwise_scale_inv is None):
            raise ValueError("each usage needs both its data and its scale_inv (or neither)")
        held = next((b for b in buffers if b is not None), None)
        device = held.device if held is not None else torch.device("cpu")
        self = super().__new__(cls, tuple(shape), dtype, device, requires_grad)
        (self._rowwise_data, self._rowwise_scale_inv, self._columnwise_data,
         self._columnwise_scale_inv) = buffers
        self._fp8_dtype = fp8_dtype
        self._quantizer = quantizer
        self._set_meta(**meta)
        return self

    # -- what a format defines ----------------------------------------------------------------
    @classmethod
    def _check_data(cls, fp8_dtype, rowwise_data, columnwise_data) -> None:
        check_fp8_dtype(fp8_dtype)
        for name, data in (("rowwise_data", rowwise_data), ("columnwise_data", columnwise_data)):
            if data is not None and data.dtype not in (torch.uint8, fp8_dtype):
                raise ValueError(f"{name} must hold uint8 bytes or {fp8_dtype}, got {data.dtype}")

    def _set_meta(self, **meta) -> None:
        if meta:
            raise TypeError(f"{type(self).__name__} got unexpected arguments {sorted(meta)}")

    def _meta(self) -> dict:
        return {}

    def _dequantize_usage(self, columnwise: bool, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    # -- reading ------------------------------------------------------------------------------
    def _buffers(self) -> List[Optional[torch.Tensor]]:
        return [getattr(self, name) for name in self._BUFFERS]

    def _live(self) -> "BlockScaledTensor":
        if self._rowwise_data is None and self._columnwise_data is None:
            raise RuntimeError(f"this {type(self).__name__} holds no data: it is a shell left by "
                               "prepare_for_saving() or its buffers were released after backward")
        return self

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The values as a `dtype` tensor (default: the nominal dtype), from the rowwise data when it is
        there, else from the columnwise data (whose blocks run the other way: other values)."""
        self._live()
        dtype = dtype or self.dtype
        kernel_dtype = dtype if dtype in FLOAT_DTYPES else torch.float32
        out = self._dequantize_usage(self._rowwise_data is None, kernel_dtype)
        return out if out.dtype == dtype else out.to(dtype)

    def columnwise_dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The columnwise data's values in the tensor's own shape."""
        if self._columnwise_data is None:
            raise RuntimeError(f"this {type(self).__name__} was quantized without columnwise data")
        return self._dequantize_usage(True, dtype or self.dtype)

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """Keep (True) or drop (False) each usage's data and scales, TE's method; None keeps what is held. A
        usage that is not held can be turned on only where the other one holds the same values (a 128x128-scaled
        Float8BlockwiseQTensor's columnwise data: its rowwise bytes transposed); else ValueError."""
        self._live()
        held_rowwise, held_columnwise = self._rowwise_data is not None, self._columnwise_data is not None
        rowwise = held_rowwise if rowwise_usage is None else bool(rowwise_usage)
        columnwise = held_columnwise if columnwise_usage is None else bool(columnwise_usage)
        if not (rowwise or columnwise):
            raise ValueError("update_usage: rowwise_usage and columnwise_usage are both False: a "
                             f"{type(self).__name__} must keep one of them")
        if rowwise and not held_rowwise:
            raise ValueError(f"update_usage: rowwise_usage=True, but this {type(self).__name__} holds no rowwise "
                             "data, and its columnwise data has other scales: quantize again with both usages")
        if columnwise and not held_columnwise:
            made = type(self)._columnwise_from_rowwise_buffers(self)
            if made is None:
                raise ValueError(f"update_usage: columnwise_usage=True, but this {type(self).__name__} holds no "
                                 "columnwise data, and its rowwise data has other scales: quantize again with "
                                 "both usages")
            self._columnwise_data, self._columnwise_scale_inv = made
        if not rowwise:
            self._rowwise_data = self._rowwise_scale_inv = None
        if not columnwise:
            self._columnwise_data = self._columnwise_scale_inv = None

    def _adopt(self, other: "BlockScaledTensor") -> None:
        for name in self._BUFFERS:
            setattr(self, name, getattr(other, name))
        self._fp8_dtype, self._quantizer = other._fp8_dtype, other._quantizer
        self._set_meta(**other._meta())

    def _columnwise_from_rowwise_buffers(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """(columnwise data, columnwise scale_inv) made from the rowwise usage where a format's two usages
        hold the same values, else None."""
        return None

    def quantize_(self, src: torch.Tensor) -> "BlockScaledTensor":
        """Requantize src (high precision) into this tensor's buffers with its quantizer."""
        self._live()
        if self._same_layout(src):  # the bytes and scales as they are (how a checkpoint loads)
            for mine, theirs in zip(self._buffers(), src._live()._buffers()):
                if mine is not None:
                    mine.view(torch.uint8).copy_(theirs.view(torch.uint8))
            return self
        if self._quantizer is None:
            raise RuntimeError(f"this {type(self).__name__} has no quantizer to requantize with")
        if isinstance(src, QuantizedTensor):
            src = src.dequantize()
        src = src.detach().to(self.device)
        if src.dtype not in FLOAT_DTYPES:
            src = src.to(torch.float32)
        fresh = self._quantizer.quantize(src.expand(self.shape).contiguous())
        for name in self._BUFFERS:
            mine, new = getattr(self, name), getattr(fresh, name)
            if mine is not None and new is not None:
                mine.view(torch.uint8).copy_(new.view(torch.uint8))
        return self

    def _same_layout(self, src) -> bool:
        """Whether src holds this tensor's format, shape and at least its usages."""
        return (type(src) is type(self) and src.shape == self.shape and src._fp8_dtype == self._fp8_dtype
                and src._meta() == self._meta() and src.device == self.device
                and all(theirs is not None for mine, theirs in zip(self._buffers(), src._buffers())
                        if mine is not None))

    # -- saving for backward --------------------------------------------------------------------
    def prepare_for_saving(self) -> Tuple[List[Optional[torch.Tensor]], object]:
        """Hand the buffers over for ctx.save_for_backward; self becomes an empty shell (under
        torch.compile, a record of the metadata that rebuilds a new tensor)."""
        cls = type(self)  # (methods through the class: dynamo puts a method of a traced tensor into the graph)
        tensors = cls._buffers(self)
        if torch.compiler.is_compiling():
            return tensors, BlockScaledRecord(cls, tuple(self.shape), self.dtype, self._fp8_dtype,
                                              traced_quantizer(self._quantizer), cls._meta(self))
        self.clear()
        return tensors, self

    def restore_from_saved(self, tensors: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        """Take back the buffers given by prepare_for_saving(); returns the tensors left over."""
        for name, t in zip(self._BUFFERS, tensors):
            setattr(self, name, t)
        return list(tensors[len(self._BUFFERS):])

    def clear(self) -> None:
        """Drop every buffer reference (what backward does once it is done with the tensor)."""
        for name in self._BUFFERS:
            setattr(self, name, None)

    # -- ops that keep the format (everything else dequantizes: QuantizedTensor) --------------
    def _with_buffers(self, fn, **kwargs) -> "BlockScaledTensor":
        """A tensor of this kind whose buffers are fn(buffer) (None stays None)."""
        moved = {name[1:]: None if b is None else fn(b) for name, b in zip(self._BUFFERS, self._buffers())}
        return type(self)(self.shape, self.dtype, fp8_dtype=self._fp8_dtype, quantizer=self._quantizer, **moved,
                          **self._meta(), **kwargs)

    @classmethod
    def _handled_op(cls, func, args, kwargs):
        for t in args:
            if isinstance(t, BlockScaledTensor):
                t._live()
        handler = _OPS.get(func)
        return NotImplemented if handler is None else handler(func, args, kwargs)

    # -- FSDP2: shards along dim 0 between row blocks, gathered in the low-precision bytes (_block_scaled_rows) --
    _ROW_BLOCK = 1  # a format's rows per block along dim 0, in either usage

    def _row_layout(self) -> dict:
        """{buffer name: (the dimension the matrix rows run along, rows per index)}; absent: not cut by rows."""
        raise NotImplementedError(f"{type(self).__name__} does not define its row layout")

    def _buffer_shape(self, name: str, shape) -> Tuple[int, ...]:
        """The (padded) shape buffer `name` has in a tensor of this format and usages of `shape`."""
        raise NotImplementedError(f"{type(self).__name__} does not define its buffer shapes")

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This shard's buffers as bytes, rows first and unpadded (TE's hook)."""
        del outer_stride, module, mp_policy
        return row_cuts.fsdp_pre_all_gather(self._live(), mesh, outer_size)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The unsharded tensor over the gathered bytes (TE's hook; out=: later gathers refresh it)."""
        return row_cuts.fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, out)

    # -- torch.compile, pickling, deepcopy ------------------------------------------------------
    def __tensor_flatten__(self):
        names = [name for name in self._BUFFERS if getattr(self, name) is not None]
        return names, (self._fp8_dtype, self.dtype, self._meta())

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        del outer_stride
        fp8_dtype, dtype, extra = meta
        return cls(outer_size, dtype, fp8_dtype=fp8_dtype, **{name[1:]: inner.get(name) for name in cls._BUFFERS},
                   **extra)

    def __reduce_ex__(self, protocol):
        self._live()
        # The buffers as bytes with their dtypes: plain pickle cannot rebuild a float8 tensor's storage. A weight
        # parameter's quantizer (optimizer steps write through it) and plain attributes (Parameter's _is_param,
        # tensor-parallel tags) travel too.
        buffers = self._buffers()
        attributes = {k: v for k, v in vars(self).items() if (not k.startswith("_") or k == "_is_param")
                      and isinstance(v, (bool, int, float, str, type(None)))}
        return (_rebuild_block_scaled, (type(self), tuple(self.shape), self.dtype, self._fp8_dtype,
                                        [None if b is None else b.view(torch.uint8) for b in buffers], self._meta(),
                                        self.requires_grad, [None if b is None else b.dtype for b in buffers],
                                        self._quantizer, attributes))

    def __deepcopy__(self, memo):
        self._live()
        out = self._with_buffers(torch.clone, requires_grad=self.requires_grad)
        out._quantizer = copy.deepcopy(self._quantizer, memo)
        memo[id(self)] = out
        for name, value in vars(self).items():  # as torch copies a subclass's __dict__: a parameter's flag,
            if name not in vars(out):           # the attributes TP code sets on a weight
                setattr(out, name, copy.deepcopy(value, memo))
        return out

    def __repr__(self, *, tensor_contents=None) -> str:
        usages = [u for u, name in (("rowwise", "_rowwise_data"), ("columnwise", "_columnwise_data"))
                  if getattr(self, name, None) is not None]
        return (f"{type(self).__name__}(shape={tuple(self.shape)}, fp8_dtype={getattr(self, '_fp8_dtype', None)}, "
                f"dtype={self.dtype}, usages={usages or '<empty shell>'})")


class BlockScaledRecord:
    """What prepare_for_saving keeps of a block-scaled tensor under torch.compile: its metadata only."""

    def __init__(self, cls, shape, dtype, fp8_dtype, quantizer, meta):
        self.SAVED_TENSORS = cls.SAVED_TENSORS
        self.cls, self.shape, self.dtype, self.fp8_dtype, self.quantizer, self.meta = (
            cls, shape, dtype, fp8_dtype, quantizer, meta)

    def rebuild(self, tensors):
        buffers = dict(zip([name[1:] for name in self.cls._BUFFERS], tensors))
        return self.cls(self.shape, self.dtype, fp8_dtype=self.fp8_dtype, quantizer=self.quantizer, **buffers,
                        **self.meta)


def _rebuild_block_scaled(cls, shape, dtype, fp8_dtype, buffers, meta, requires_grad, buffer_dtypes=None,
                          quantizer=None, attributes=None):
    if buffer_dtypes is not None:  # (the last three are absent from what the first versions wrote)
        buffers = [b if b is None else b.view(d) for b, d in zip(buffers, buffer_dtypes)]
    out = cls(shape, dtype, fp8_dtype=fp8_dtype, requires_grad=requires_grad, quantizer=quantizer,
              **{name[1:]: b for name, b in zip(cls._BUFFERS, buffers)}, **meta)
    for name, value in (attributes or {}).items():
        setattr(out, name, value)
    return out


class BlockScaledQuantizer(Quantizer):
    """A quantizer whose tensors may carry either usage alone (TE's rowwise / columnwise usages)."""

    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        rowwise = self.rowwise_usage if rowwise is None else bool(rowwise)
        columnwise = self.columnwise_usage if columnwise is None else bool(columnwise)
        if not (rowwise or columnwise):
            raise ValueError("at least one of rowwise and columnwise usage must be on")
        self.rowwise_usage, self.columnwise_usage = rowwise, columnwise

    def with_usage(self, *, rowwise: bool, columnwise: bool) -> "BlockScaledQuantizer":
        """This quantizer when it has these usages, else a copy with them. The GEMMs ask for theirs this way, not
        with set_usage: under torch.compile a write into a quantizer is a side effect of the traced function,
        refused in a backward, and in a forward it makes dynamo hand the saved buffers to the backward as graph
        outputs, which may not alias each other."""
        if (self.rowwise_usage, self.columnwise_usage) == (bool(rowwise), bool(columnwise)):
            return self
        out = self.copy()
        out.set_usage(rowwise=rowwise, columnwise=columnwise)
        return out

    @property
    def rowwise(self) -> bool:
        return self.rowwise_usage

    @property
    def columnwise(self) -> bool:
        return self.columnwise_usage

    def copy(self):
        return copy.copy(self)

    def update_quantized(self, src: torch.Tensor, dst: BlockScaledTensor) -> BlockScaledTensor:
        """Write src into dst's buffers (TE's name for copy_ through a quantizer)."""
        return dst.quantize_(src)


# -- the op table ------------------------------------------------------------------------------
def _alias(func, args, kwargs):
    t = args[0]
    return return_and_correct_aliasing(func, args, kwargs, t._with_buffers(lambda b: b))


def _clone(func, args, kwargs):
    return args[0]._with_buffers(torch.clone)


def _copy(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, BlockScaledTensor):
        return dst.copy_(src.dequantize(dst.dtype))
    return dst.quantize_(src)


def _to(func, args, kwargs):
    return to_op(func, args, kwargs, lambda t, device: t._with_buffers(lambda b: b.to(device, copy=True)))


def _bound(func, args, kwargs) -> dict:
    return {**dict(zip([a.name for a in func._schema.arguments], args)), **kwargs}


def _split(func, args, kwargs):
    """Dim-0 splits of a 2-D tensor (torch.chunk: how FSDP2 shards) between row blocks keep the format; other
    dims dequantize; a cut inside a block is refused."""
    bound = _bound(func, args, kwargs)
    t, dim = bound["self"], bound.get("dim", 0)
    if t.dim() != 2 or dim not in (0, -2):
        return NotImplemented
    sizes = bound.get("split_sizes", bound.get("split_size"))
    if isinstance(sizes, int):
        sizes = [min(sizes, t.shape[0] - start) for start in range(0, t.shape[0], sizes)] or [0]
    row_cuts.check_cuts(t, list(sizes))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [row_cuts.rows(t, start, start + size) for start, size in zip(starts, sizes)]


def _new_zeros(func, args, kwargs):
    shape = tuple(_bound(func, args, kwargs)["size"])
    return row_cuts.zeros_like_layout(args[0], shape) if len(shape) == 2 else NotImplemented


def _whole_view(func, args, kwargs):
    """slice / as_strided that keep every element in place (FSDP2's narrow of a whole shard, its as_strided of
    the unsharded tensor) alias the tensor; other views dequantize."""
    bound, t = _bound(func, args, kwargs), args[0]
    if func is aten.slice.Tensor:
        start, end = bound.get("start") or 0, bound.get("end")
        whole = bound.get("step", 1) == 1 and start == 0 and (end is None or end >= t.shape[bound.get("dim", 0)])
    else:
        whole = (tuple(bound["size"]) == tuple(t.shape) and tuple(bound["stride"]) == tuple(t.stride())
                 and not bound.get("storage_offset"))
    return _alias(func, args, kwargs) if whole else NotImplemented


def _view(func, args, kwargs):
    viewed = row_cuts.view(args[0], args[1])
    if viewed is args[0]:
        return _alias(func, args, kwargs)
    return NotImplemented if viewed is None else viewed


_OPS = {
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.new_zeros.default: _new_zeros,
    aten.slice.Tensor: _whole_view,
    aten.as_strided.default: _whole_view,
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.clone.default: _clone,
    aten.copy_.default: _copy,
    aten._to_copy.default: _to,
    aten.to.dtype_layout: _to,
    aten.to.device: _to,
    aten.to.dtype: _to,
    aten.to.other: _to,
}
