"""Float8Tensor (FP8 bytes with their inverse scale, as a torch.Tensor, and how it is saved for backward)
and its quantizers: Float8Quantizer (delayed scaling) and Float8CurrentScalingQuantizer.

Both follow TransformerEngine 2.6: its constructors, attributes (`_data` and `_transpose` as uint8 bytes,
`_fp8_dtype` and a quantizer's `dtype` as TE's DType) and methods. te_fuser's own code reads the
typed views (`fp8_data`, `fp8_data_transpose`, `fp8_dtype`), and passes torch float8 dtypes where TE
passes a DType; both spellings are accepted everywhere.

A quantizer holds its scaling state as tensors (scale, amax) and updates amax in place each time it is
called, so recipe code can reduce and roll amaxes without the quantizer's help.
"""

import copy
import math
import weakref
from typing import Iterable, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from ..kernels import fp8 as fp8_kernels
from ..kernels.validate import FLOAT_DTYPES as _HIGH_PRECISION  # what the FP8 kernels read and write
from ..kernels.validate import check_scalar_f32, check_tensor
from ..recipe import DelayedScaling, Float8CurrentScaling
from ..te_dtype import TORCH_DTYPE, DType, fp8_torch_dtype, te_dtype
from .quantized_tensor import QuantizedTensor, Quantizer, to_op

aten = torch.ops.aten


def fp8_transpose(data: torch.Tensor) -> torch.Tensor:
    """Transpose of FP8 data viewed as (numel / last dim, last dim): one pass over the bytes (on the
    CPU te_fuser's kernel, about four times faster there than torch's transpose of bytes)."""
    if data.device.type == "cpu" and data.dim() >= 1:
        return fp8_kernels.transpose(data.contiguous())
    d2 = data.reshape(-1, data.shape[-1])
    return d2.view(torch.uint8).t().contiguous().view(data.dtype)


def columnwise_bytes(data: torch.Tensor) -> torch.Tensor:
    """The transposed data as TE's quantize lays it out: uint8 bytes of shape (last dim, *leading dims),
    the transpose of the (numel / last dim, last dim) matrix; a vector's or a scalar's are its own bytes."""
    if data.dim() <= 1:
        return data.view(torch.uint8).clone()
    return fp8_transpose(data).view(torch.uint8).view(data.shape[-1], *data.shape[:-1])


def _transpose_shapes(shape) -> tuple:
    """The shapes a Float8Tensor's transposed bytes may have: TE's quantize's (last dim, *leading dims)
    and TE's make_empty's (last dim, numel / last dim)."""
    if len(shape) == 0:
        return ((), (1, 1))
    rows = math.prod(shape[:-1])
    return ((shape[-1], *shape[:-1]), (shape[-1], rows))


def fp8_data(t: "Float8Tensor") -> Optional[torch.Tensor]:
    """t's bytes viewed as its float8 dtype (None when it holds none).

    The ops call this rather than the property: torch.compile reads a property of a tensor subclass made
    in the graph as constant metadata, which a tensor is not; a function is traced."""
    return None if t._data is None else t._data.view(TORCH_DTYPE[t._fp8_dtype])


def fp8_data_transpose(t: "Float8Tensor") -> Optional[torch.Tensor]:
    """t's transposed bytes as the 2-D (last dim, numel / last dim) matrix in its float8 dtype, or None."""
    data_t = t._transpose
    if data_t is None:
        return None
    return data_t.view(TORCH_DTYPE[t._fp8_dtype]).reshape(data_t.shape[0] if data_t.dim() else 1, -1)


class Float8Tensor(QuantizedTensor):
    """A tensor quantized to FP8 with one per-tensor scale.

    It is a torch.Tensor of the nominal (high-precision) dtype and shape; its values are
    `fp8_data * _scale_inv`. FP8 GEMMs and kernels consume its parts directly; every other op sees
    it dequantized (QuantizedTensor's rules; Float8Tensor.OPS lists the ops that stay in FP8).

    Made as te_fuser does, `Float8Tensor(data, scale_inv, fp8_dtype, dtype, transpose)`, or with TE's
    keywords, `Float8Tensor(shape=, dtype=, data=, fp8_scale_inv=, fp8_dtype=, data_transpose=,
    quantizer=, requires_grad=)`; data and transpose as uint8 bytes or in the FP8 dtype.

    _data:      the FP8 bytes (uint8, as TE keeps them), the tensor's shape; fp8_data views them as
                fp8_dtype (torch.float8_e4m3fn / float8_e5m2)
    _scale_inv: float32 tensor of one element, 1 / scale
    _fp8_dtype: the format as TE's DType (kFloat8E4M3 / kFloat8E5M2); fp8_dtype is its torch dtype
    _transpose: optional bytes of the transpose of the data viewed as a (numel / last dim, last dim)
                matrix (cast-transpose output), shaped as TE's quantize shapes them, (last dim,
                *leading dims), or as its make_empty does, (last dim, numel / last dim);
                fp8_data_transpose views them as that 2-D matrix in fp8_dtype
    _quantizer: optional quantizer that writes new high-precision values into it (copy_, in-place
                ops); without one, they are quantized with the tensor's own scale. A Float8Tensor
                of the same FP8 format is copied as it is (bytes and scale)
    _whole:     set on a part (slice, select, split, as_strided): the bytes of the tensor it was cut
                from and a weak reference to that tensor's transpose. The scale belongs to the whole,
                so a write into a part requantizes the whole when the quantizer picks a new scale,
                and refreshes the whole's transpose (quantize_)
    dtype:      the nominal dtype it stands for
    """

    @staticmethod
    def __new__(cls, data: Optional[torch.Tensor] = None, scale_inv: Optional[torch.Tensor] = None,
                fp8_dtype=None, dtype: Optional[torch.dtype] = None, transpose: Optional[torch.Tensor] = None, *,
                shape=None, quantizer=None, requires_grad: bool = False, fp8_scale_inv: Optional[torch.Tensor] = None,
                data_transpose: Optional[torch.Tensor] = None, device=None):
        scale_inv = _one_of(scale_inv, "scale_inv", fp8_scale_inv, "fp8_scale_inv")
        transpose = _one_of(transpose, "transpose", data_transpose, "data_transpose")
        fp8_dtype = fp8_torch_dtype(fp8_dtype)
        if dtype not in _HIGH_PRECISION:
            raise ValueError(f"dtype (the nominal dtype) must be one of {_HIGH_PRECISION}, got {dtype}")
        if scale_inv is not None and (scale_inv.dtype != torch.float32 or scale_inv.numel() != 1):
            raise ValueError(f"scale_inv must be a float32 tensor of one element, got {scale_inv.dtype} "
                             f"with {scale_inv.numel()} elements")
        data = _as_bytes(data, fp8_dtype, "data")
        transpose = _as_bytes(transpose, fp8_dtype, "transpose")
        if data is not None and transpose is not None:
            shapes = _transpose_shapes(tuple(data.shape))
            if tuple(transpose.shape) not in shapes:
                raise ValueError(f"transpose must have shape {' or '.join(map(str, shapes))}, got "
                                 f"{tuple(transpose.shape)}")
        if data is not None:
            if shape is not None and tuple(shape) != tuple(data.shape):
                raise ValueError(f"shape {tuple(shape)} does not match data's shape {tuple(data.shape)}")
            shape, held, strides = data.shape, data, data.stride()
        elif shape is None:
            raise ValueError("a Float8Tensor without data needs its shape")
        else:
            held, strides = transpose if transpose is not None else scale_inv, None
        if held is not None:
            if device is not None and torch.device(device) != held.device:
                raise ValueError(f"device {device} does not match the buffers' device {held.device}")
            device = held.device
        self = super().__new__(cls, shape, dtype, torch.device(device or "cpu"), requires_grad, strides)
        self._data = data
        self._scale_inv = scale_inv
        self._fp8_dtype = te_dtype(fp8_dtype)
        self._transpose = transpose
        self._quantizer = quantizer
        self._whole = None
        return self

    # -- te_fuser's typed views of TE's attributes ------------------------------------------
    @property
    def fp8_dtype(self) -> torch.dtype:
        """The format as a torch float8 dtype (_fp8_dtype is TE's DType)."""
        return TORCH_DTYPE[self._fp8_dtype]

    @property
    def fp8_data(self) -> Optional[torch.Tensor]:
        """_data viewed as fp8_dtype (None when the tensor holds no data)."""
        return fp8_data(self)

    @property
    def fp8_data_transpose(self) -> Optional[torch.Tensor]:
        """_transpose viewed as the 2-D (last dim, numel / last dim) matrix in fp8_dtype, or None."""
        return fp8_data_transpose(self)

    @property
    def _transpose_invalid(self) -> bool:
        """TE's flag: te_fuser keeps a transpose up to date or holds none."""
        return self._transpose is None

    def _get_quantizer(self):
        """The quantizer that writes into this tensor (TE's accessor); ValueError when it has none."""
        if self._quantizer is None:
            raise ValueError("this Float8Tensor has no quantizer")
        return self._quantizer

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """Make (columnwise_usage=True) or drop (False) the transposed data; the row-major data stays."""
        if rowwise_usage is not None and not rowwise_usage:
            raise ValueError("rowwise_usage cannot be turned off: te_fuser always keeps the row-major data")
        self._live()
        if columnwise_usage is None:
            return
        if not columnwise_usage:
            self._transpose = None
        elif self._transpose is None:
            self._transpose = columnwise_bytes(self.fp8_data)

    def _adopt(self, other: "Float8Tensor") -> None:
        self._data, self._scale_inv, self._transpose = other._data, other._scale_inv, other._transpose
        self._fp8_dtype, self._quantizer, self._whole = other._fp8_dtype, other._quantizer, other._whole

    def _live(self) -> "Float8Tensor":
        if self._data is None:
            raise RuntimeError(
                "this Float8Tensor holds no data: it is a shell left by prepare_for_saving() "
                "or its buffers were released after backward"
            )
        return self

    def rewrapped(self) -> "Float8Tensor":
        """A new Float8Tensor over the same bytes and scale, without the transpose: what an op saves of a
        tensor that lives on, since prepare_for_saving() empties the wrapper it is given."""
        self._live()
        return Float8Tensor(self._data, self._scale_inv, self.fp8_dtype, self.dtype)

    def _like(self, data, transpose, scale_inv=None, requires_grad=False) -> "Float8Tensor":
        return Float8Tensor(data, self._scale_inv if scale_inv is None else scale_inv, self.fp8_dtype, self.dtype,
                            transpose, quantizer=self._quantizer, requires_grad=requires_grad)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The values as a `dtype` tensor (default: the nominal dtype)."""
        self._live()
        if dtype == torch.float64:  # exact: an FP8 value times a float32 scale fits a double
            return self.fp8_data.to(torch.float64) * self._scale_inv.to(torch.float64)
        if dtype not in (None, *_HIGH_PRECISION):
            return self.dequantize().to(dtype)
        data = self._data
        if not data.is_contiguous():  # a part or a strided view: the kernel reads contiguous bytes
            data = data.contiguous()
        return fp8_kernels.dequantize(data.view(self.fp8_dtype), self._scale_inv, dtype or self.dtype)

    def transpose_dequantized(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The cast-transpose data dequantized (the transpose of the 2-D view of the values)."""
        if self._transpose is None:
            raise RuntimeError("this Float8Tensor was quantized without its transpose (columnwise=False)")
        return fp8_kernels.dequantize(self.fp8_data_transpose, self._scale_inv, dtype or self.dtype)

    def quantize_(self, src: torch.Tensor, *, noop_flag: Optional[torch.Tensor] = None) -> "Float8Tensor":
        """Write src's values into this tensor's FP8 buffers (its quantizer's scale, else its own).

        noop_flag: TE's float32 flag of one element; 1 skips the write."""
        if _skips(noop_flag):
            return self
        self._live()
        if tuple(src.shape) != tuple(self.shape):
            try:  # copy_ broadcasts its source
                src = src.expand(self.shape)
            except RuntimeError:
                raise ValueError(f"src has shape {tuple(src.shape)}, this Float8Tensor {tuple(self.shape)}") from None
        src = src.detach()
        if not isinstance(src, Float8Tensor) and src.dtype not in _HIGH_PRECISION:
            src = src.to(torch.float32)  # float64, integers, bool: the quantizers take float32
        if self._whole is not None:
            return self._quantize_part_(src)
        if isinstance(src, Float8Tensor):
            # FP8 into FP8 of the same format: the bytes and scale as they are (exact; how a
            # checkpoint of FP8 weights loads, whatever the receiving quantizer's scale is).
            if src._fp8_dtype == self._fp8_dtype and src.device == self.device:
                self._data.copy_(src._live()._data)
                self._scale_inv.copy_(src._scale_inv)
                self._refresh_transpose()
                return self
            src = src.dequantize()
        src = src.to(self.device).contiguous()
        if self._quantizer is not None:
            fresh = self._quantizer._cast(src, columnwise=False)
            if fresh._fp8_dtype != self._fp8_dtype:
                raise ValueError(f"this Float8Tensor holds {self.fp8_dtype} but its quantizer casts to "
                                 f"{fresh.fp8_dtype}")
            self._data.copy_(fresh._data)
            self._scale_inv.copy_(fresh._scale_inv)
        else:
            scale = torch.reciprocal(self._scale_inv)
            scratch_amax = torch.zeros_like(self._scale_inv)
            self._data.copy_(fp8_kernels.quantize(src, scale, scratch_amax, self.fp8_dtype).view(torch.uint8))
        self._refresh_transpose()
        return self

    def _refresh_transpose(self) -> None:
        """Rewrite the transposed bytes from the data: this tensor's own, or a part's whole's."""
        if self._whole is not None:
            whole, whole_transpose = self._whole
            transpose = None if whole_transpose is None else whole_transpose()
            if transpose is not None:
                transpose.copy_(columnwise_bytes(whole.view(self.fp8_dtype)).view(transpose.shape))
        elif self._transpose is not None:
            self._transpose.copy_(columnwise_bytes(self.fp8_data).view(self._transpose.shape))

    def _quantize_part_(self, src: torch.Tensor) -> "Float8Tensor":
        """quantize_ of a part: the bytes outside it keep their values, read with the whole's scale."""
        whole = self._whole[0]
        if isinstance(src, Float8Tensor) and src._fp8_dtype == self._fp8_dtype and \
                torch.equal(src._live()._scale_inv, self._scale_inv):
            self._data.copy_(src._data)
        elif self._quantizer is None or not whole.is_contiguous():
            # The whole keeps its scale: only this part's bytes change (values beyond it saturate).
            values = (src.dequantize() if isinstance(src, Float8Tensor) else src).to(self.device)
            codes = fp8_kernels.quantize(values.contiguous(), torch.reciprocal(self._scale_inv),
                                         torch.zeros_like(self._scale_inv), self.fp8_dtype)
            self._data.copy_(codes.view(torch.uint8))
        else:
            # The quantizer's scale is the whole's: requantize all of it, with this part's new values.
            values = Float8Tensor(whole, self._scale_inv, self.fp8_dtype, torch.float32).dequantize()
            part = values.as_strided(self.shape, self._data.stride(),
                                     self._data.storage_offset() - whole.storage_offset())
            part.copy_(src.dequantize(torch.float32) if isinstance(src, Float8Tensor) else src)
            fresh = self._quantizer._cast(values, columnwise=False)
            if fresh._fp8_dtype != self._fp8_dtype:
                raise ValueError(f"this Float8Tensor holds {self.fp8_dtype} but its quantizer casts to "
                                 f"{fresh.fp8_dtype}")
            whole.copy_(fresh._data)
            self._scale_inv.copy_(fresh._scale_inv)
        self._refresh_transpose()
        return self

    # -- the ops that keep FP8 (everything else dequantizes: QuantizedTensor) --------------
    @classmethod
    def _handled_op(cls, func, args, kwargs):
        for t in args:
            if isinstance(t, Float8Tensor):
                t._live()
        handler = _FP8_OPS.get(func)
        if handler is None:
            return NotImplemented
        return handler(func, args, kwargs)

    # -- saving for backward without keeping anything on ctx --------------------------------
    SAVED_TENSORS = 3  # _data, _transpose, _scale_inv

    def prepare_for_saving(self) -> Tuple[List[Optional[torch.Tensor]], "Float8Tensor"]:
        """Hand the buffers over for ctx.save_for_backward; self becomes an empty shell.

        Under torch.compile a traced tensor subclass cannot be emptied in place, and a view (a part
        cut from a bigger Float8Tensor, a reshape of one) keeps the tensor it views alive through
        autograd's view link, which emptying does not cut: the shell is then a Float8Record (metadata
        only), and restoring builds a new Float8Tensor.
        """
        tensors = [self._data, self._transpose, self._scale_inv]
        if torch.compiler.is_compiling() or self._base is not None:
            return tensors, Float8Record(self.fp8_dtype, self.dtype, self._quantizer)
        self._data = self._transpose = self._scale_inv = self._whole = None
        return tensors, self

    def restore_from_saved(self, tensors: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        """Take back the buffers given by prepare_for_saving(); returns the tensors left over."""
        self._data, self._transpose, self._scale_inv = tensors[0], tensors[1], tensors[2]
        return tensors[3:]

    def clear(self) -> None:
        """Drop every buffer reference (what backward does once it is done with the tensor)."""
        self._data = self._transpose = self._scale_inv = self._whole = None

    # -- FSDP2 (fully_shard): all-gather the FP8 bytes, not the nominal dtype ----------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This shard's bytes (uint8, padded to FSDP's padded shard size) and its scale_inv.

        Every rank must hold the same scale (weights quantized before sharding, or delayed scaling
        with its amaxes reduced over the group): the gathered bytes are read with this rank's."""
        del outer_stride, module, mp_policy
        self._live()
        world = mesh.size()
        padded_rows = -(-outer_size[0] // world)
        data = self._data
        if data.shape[0] < padded_rows:  # an uneven last shard: FSDP gathers equal sizes
            padded = data.new_zeros((padded_rows, *data.shape[1:]))
            padded[:data.shape[0]].copy_(data)
            data = padded
        return (data,), (self._scale_inv.clone(), self.fp8_dtype, self._quantizer)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The unsharded weight as a Float8Tensor over the gathered bytes (no copy)."""
        (gathered,) = all_gather_outputs
        scale_inv, fp8_dtype, quantizer = metadata
        if out is not None:  # later all-gathers land in the same storage: refresh the scale
            out._scale_inv.copy_(scale_inv)
            return None
        return Float8Tensor(gathered, scale_inv, fp8_dtype, param_dtype, quantizer=quantizer), ()

    # -- torch.compile, pickling, deepcopy --------------------------------------------------
    def __tensor_flatten__(self):
        names = ["_data", "_scale_inv"] + (["_transpose"] if self._transpose is not None else [])
        return names, (self.fp8_dtype, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        del outer_stride
        fp8_dtype, dtype = meta
        return Float8Tensor(inner["_data"], inner["_scale_inv"], fp8_dtype, dtype, inner.get("_transpose"),
                            shape=outer_size)

    def __reduce_ex__(self, protocol):
        self._live()
        # As the block-scaled tensors pickle: a weight parameter's quantizer (optimizer steps write through it;
        # its scale and amax are views of the module's scaling state, which torch.save keeps shared) and plain
        # attributes (Parameter's _is_param, tensor-parallel tags) travel too.
        attributes = {k: v for k, v in vars(self).items() if (not k.startswith("_") or k == "_is_param")
                      and isinstance(v, (bool, int, float, str, type(None)))}
        return (_rebuild_float8_tensor,
                (self._data, self._scale_inv, self.fp8_dtype, self.dtype, self._transpose, self.requires_grad,
                 self._quantizer, attributes))

    def __deepcopy__(self, memo):
        self._live()
        out = Float8Tensor(self._data.clone(), self._scale_inv.clone(), self.fp8_dtype, self.dtype,
                           None if self._transpose is None else self._transpose.clone(),
                           quantizer=copy.deepcopy(self._quantizer, memo), requires_grad=self.requires_grad)
        memo[id(self)] = out
        for name, value in vars(self).items():  # as torch copies a subclass's __dict__: a parameter's flag,
            if name not in vars(out):           # the attributes TP code sets on a weight
                setattr(out, name, copy.deepcopy(value, memo))
        return out

    def __repr__(self, *, tensor_contents=None) -> str:
        data = getattr(self, "_data", None)  # also called by torch.compile on half-built or traced objects
        fp8_dtype = getattr(self, "_fp8_dtype", None)
        fp8_dtype = TORCH_DTYPE.get(fp8_dtype, fp8_dtype)
        if data is None:
            return f"Float8Tensor(<empty shell>, shape={tuple(self.shape)}, fp8_dtype={fp8_dtype}, dtype={self.dtype})"
        try:
            scale_inv = f"{self._scale_inv.item():.6g}"
        except (TypeError, RuntimeError, AttributeError):  # a traced (fake or symbolic) scale
            scale_inv = "traced"
        transpose = "yes" if getattr(self, "_transpose", None) is not None else "no"
        return (f"Float8Tensor(shape={tuple(self.shape)}, fp8_dtype={fp8_dtype}, dtype={self.dtype}, "
                f"scale_inv={scale_inv}, transpose={transpose})")


class Float8Record:
    """What prepare_for_saving keeps of a Float8Tensor under torch.compile: its metadata only."""

    SAVED_TENSORS = Float8Tensor.SAVED_TENSORS

    def __init__(self, fp8_dtype: torch.dtype, dtype: torch.dtype, quantizer):
        self.fp8_dtype, self.dtype, self.quantizer = fp8_dtype, dtype, quantizer

    def rebuild(self, tensors: List[Optional[torch.Tensor]]) -> Float8Tensor:
        data, transpose, scale_inv = tensors
        return Float8Tensor(data, scale_inv, self.fp8_dtype, self.dtype, transpose, quantizer=self.quantizer)


def _rebuild_float8_tensor(data, scale_inv, fp8_dtype, dtype, transpose, requires_grad, quantizer=None,
                           attributes=None):
    out = Float8Tensor(data, scale_inv, fp8_dtype, dtype, transpose, requires_grad=requires_grad, quantizer=quantizer)
    for name, value in (attributes or {}).items():
        setattr(out, name, value)
    return out


def _one_of(value, name: str, te_value, te_name: str):
    """An argument given under te_fuser's name or TE's, not both."""
    if value is not None and te_value is not None:
        raise TypeError(f"pass {name} or {te_name}, not both")
    return te_value if value is None else value


def _as_bytes(t: Optional[torch.Tensor], fp8_dtype: torch.dtype, name: str) -> Optional[torch.Tensor]:
    """FP8 data as the uint8 bytes TE keeps (given as bytes, or in the tensor's FP8 dtype)."""
    if t is None:
        return None
    check_tensor(t, name)
    if t.dtype not in (torch.uint8, fp8_dtype):
        raise ValueError(f"{name} must hold uint8 bytes or {fp8_dtype}, got {t.dtype}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _skips(noop_flag: Optional[torch.Tensor]) -> bool:
    """TE's noop_flag: a float32 tensor whose first element is 1 when the write is to be skipped."""
    if noop_flag is None:
        return False
    check_tensor(noop_flag, "noop_flag")
    if noop_flag.numel() < 1:
        raise ValueError("noop_flag must hold at least one element")
    return bool(noop_flag.reshape(-1)[0] == 1.0)


# -- the FP8 op table ------------------------------------------------------------------------
def _same_bytes(t: Float8Tensor, data: torch.Tensor, transpose) -> Float8Tensor:
    """A view of all of t's bytes (alias, detach, view): a part's stays a part of the same whole."""
    out = t._like(data, transpose)
    out._whole = t._whole
    return out


def _alias(func, args, kwargs):
    t = args[0]
    return return_and_correct_aliasing(func, args, kwargs, _same_bytes(t, t._data, t._transpose))


def _reshaped(t: Float8Tensor, size) -> Float8Tensor:
    data = t._data.view(size)
    # The transpose is of the (rows, last dim) matrix: still right while the last dim is unchanged; in TE's
    # quantize layout (last dim, *leading dims) it takes the new leading dims.
    transpose = t._transpose
    if transpose is not None:
        same_rows = data.dim() > 0 and t._data.dim() > 0 and data.shape[-1] == t._data.shape[-1]
        if not same_rows:
            transpose = None
        elif transpose.dim() == t._data.dim():
            transpose = transpose.view(data.shape[-1], *data.shape[:-1])
    return _same_bytes(t, data, transpose)


def _view(func, args, kwargs):
    return return_and_correct_aliasing(func, args, kwargs, _reshaped(args[0], args[1]))


def _clone(func, args, kwargs):
    t = args[0]
    data = t._data.clone(memory_format=kwargs.get("memory_format", torch.preserve_format))
    return t._like(data, None if t._transpose is None else t._transpose.clone(),
                   scale_inv=t._scale_inv.clone())


def _copy(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, Float8Tensor):  # into a plain tensor: the values, dequantized
        return dst.copy_(src.dequantize(dst.dtype))
    return dst.quantize_(src)


def _bound(func, args, kwargs) -> dict:
    """The op's arguments by schema name."""
    names = [argument.name for argument in func._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def _moved(t: Float8Tensor, device: torch.device) -> Float8Tensor:
    move = lambda b: None if b is None else b.to(device, copy=True)  # noqa: E731
    return Float8Tensor(move(t._data), move(t._scale_inv), t.fp8_dtype, t.dtype, move(t._transpose),
                        quantizer=t._quantizer)


def _to(func, args, kwargs):
    return to_op(func, args, kwargs, _moved)


def _part(t: Float8Tensor, data: torch.Tensor) -> Float8Tensor:
    """A Float8Tensor over some of t's bytes, which knows the whole it was cut from (quantize_)."""
    part = t._like(data, None)
    part._whole = t._whole or (t._data, None if t._transpose is None else weakref.ref(t._transpose))
    return part


def _parts(func, args, kwargs):
    """split / unbind: parts along any dim (FSDP shards, chunked weights) stay FP8."""
    t = args[0]
    return [_part(t, data) for data in func(t._data, *args[1:], **kwargs)]


def _cut(func, args, kwargs):
    """slice / select / as_strided of the bytes: a part that writes through (`w[0] = 0` included)."""
    t = args[0]
    return _part(t, func(t._data, *args[1:], **kwargs))


def _new_fp8(func, args, kwargs):
    """new_zeros / new_empty: a Float8Tensor of the given size with this tensor's scale (FSDP2 pads
    shards with it); zero bytes are the value 0 in both FP8 formats."""
    bound = _bound(func, args, kwargs)
    t, size = bound["self"], bound["size"]
    if bound.get("dtype") not in (None, t.dtype):
        return func(t.dequantize(), *args[1:], **kwargs)
    device = t.device if bound.get("device") is None else torch.device(bound["device"])
    data = torch.zeros(size, dtype=torch.uint8, device=device)
    return Float8Tensor(data, t._scale_inv.to(device, copy=True), t.fp8_dtype, t.dtype, quantizer=t._quantizer)


_FP8_OPS = {
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.view.default: _view,
    aten._unsafe_view.default: lambda func, args, kwargs: _reshaped(args[0], args[1]),
    aten.clone.default: _clone,
    aten.copy_.default: _copy,
    aten._to_copy.default: _to,
    aten.to.dtype_layout: _to,
    aten.to.device: _to,
    aten.to.dtype: _to,
    aten.to.other: _to,
    aten.split.Tensor: _parts,
    aten.split_with_sizes.default: _parts,
    aten.unbind.int: _parts,
    aten.slice.Tensor: _cut,
    aten.select.int: _cut,
    aten.as_strided.default: _cut,
    aten.new_zeros.default: _new_fp8,
    aten.new_empty.default: _new_fp8,
}

# -- quantizers ------------------------------------------------------------------------------
class _Float8Quantizer(Quantizer):
    """What both FP8 quantizers share: the FP8 dtype, the cast with a given scale, and TE's methods that
    write into or allocate Float8Tensors.

    fp8_dtype: the format as a torch float8 dtype (te_fuser's); `dtype` is the same as TE's DType.
    """

    def __init__(self, fp8_dtype, *, rowwise: bool, columnwise: bool):
        self.fp8_dtype = fp8_torch_dtype(fp8_dtype)
        super().__init__(rowwise=rowwise, columnwise=columnwise)

    @property
    def dtype(self) -> DType:
        """The format as TE's DType (TE's attribute)."""
        return te_dtype(self.fp8_dtype)

    @dtype.setter
    def dtype(self, value) -> None:
        self.fp8_dtype = fp8_torch_dtype(value, "dtype")

    def _state_device(self) -> torch.device:
        return self.amax.device

    def _cast_with(self, x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                   columnwise: Optional[bool]) -> Float8Tensor:
        """x cast with `scale` (amax recorded into `amax`); the transpose too when columnwise (default:
        the quantizer's usage) and x has 2 dimensions or more."""
        x = x.contiguous()
        columnwise = self.columnwise_usage if columnwise is None else columnwise
        if columnwise and x.dim() >= 2:
            data, data_t = fp8_kernels.cast_transpose(x, scale, amax, self.fp8_dtype)
            data_t = data_t.view(torch.uint8).view(x.shape[-1], *x.shape[:-1])  # TE's layout
        else:
            data = fp8_kernels.quantize(x, scale, amax, self.fp8_dtype)
            data_t = columnwise_bytes(data) if columnwise else None
        return Float8Tensor(data, torch.reciprocal(scale).reshape(1), self.fp8_dtype, x.dtype, transpose=data_t)

    def _cast(self, x: torch.Tensor, columnwise: Optional[bool] = None) -> Float8Tensor:
        raise NotImplementedError

    def _quantize(self, x: torch.Tensor) -> Float8Tensor:
        return self._cast(x)

    def update_quantized(self, src: torch.Tensor, dst: Float8Tensor, *,
                         noop_flag: Optional[torch.Tensor] = None) -> Float8Tensor:
        """Quantize src into dst's buffers in place, with this quantizer's scaling and format (TE's
        method): dst's bytes, its transpose when it has one, its scale_inv and its format.
        noop_flag: TE's float32 flag; 1 skips the write."""
        if not isinstance(dst, Float8Tensor):
            raise TypeError(f"dst must be a Float8Tensor, got {type(dst).__name__}")
        check_tensor(src, "src")
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"src has shape {tuple(src.shape)}, dst {tuple(dst.shape)}")
        if _skips(noop_flag):
            return dst
        dst._live()
        if isinstance(src, Float8Tensor):
            src = src.dequantize()
        if src.dtype not in _HIGH_PRECISION:
            src = src.to(torch.float32)
        fresh = self._cast(src.detach().to(dst.device), columnwise=False)
        dst._data.copy_(fresh._data)
        dst._scale_inv.copy_(fresh._scale_inv)
        dst._fp8_dtype = fresh._fp8_dtype
        dst._refresh_transpose()
        return dst

    def create_tensor_from_data(self, data: torch.Tensor, fake_dtype: torch.dtype = torch.float32,
                                requires_grad: bool = False, internal: bool = False) -> Float8Tensor:
        """TE's: a Float8Tensor over FP8 codes `data` (uint8, or this quantizer's float8 dtype), with
        scale_inv = 1 / the quantizer's scale and dtype fake_dtype. internal is accepted for TE's signature."""
        del internal
        if data.dtype not in (torch.uint8, self.fp8_dtype):
            raise TypeError(f"data must be uint8 or {self.fp8_dtype}, got {data.dtype}")
        scale = self.scaling()[0] if hasattr(self, "scaling") else self.scale  # delayed: its state's slot
        scale_inv = torch.reciprocal(scale.float().reshape(1)).to(data.device)
        out = Float8Tensor(data.view(self.fp8_dtype), scale_inv, self.fp8_dtype, fake_dtype)
        return out.requires_grad_(requires_grad)

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32, device=None,
                   requires_grad: bool = False) -> Float8Tensor:
        """An uninitialized Float8Tensor of this format (TE's method), with its transposed bytes, (last dim,
        numel / last dim) as TE allocates them, when the quantizer's columnwise usage is on; scale_inv 1.
        device defaults to the scaling state's."""
        shape = tuple(int(n) for n in shape)
        device = self._state_device() if device is None else torch.device(device)
        data = torch.empty(shape, dtype=torch.uint8, device=device)
        transpose = None
        if self.columnwise_usage:
            transpose = torch.empty(_transpose_shapes(shape)[1], dtype=torch.uint8, device=device)
        return Float8Tensor(data, torch.ones(1, dtype=torch.float32, device=device), self.fp8_dtype, dtype,
                            transpose, quantizer=self, requires_grad=requires_grad)


class Float8Quantizer(_Float8Quantizer):
    """Delayed scaling: casts with a scale fixed beforehand and records amax = max(amax, max|x|).

    TE's constructor: Float8Quantizer(scale, amax, fp8_dtype, *, rowwise=True, columnwise=True);
    fp8_dtype a DType or a torch float8 dtype. scale and amax are float32 tensors of one element,
    usually views into a recipe state's buffers, so every update lands there.
    """

    # (scale buffer, amax_history, i) when scale and amax are element i of a delayed-scaling state's buffers
    # (set by the state).
    _slot: Optional[tuple] = None

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype, *, rowwise: bool = True,
                 columnwise: bool = True):
        super().__init__(fp8_dtype, rowwise=rowwise, columnwise=columnwise)
        check_scalar_f32(scale, "scale", scale, "scale")
        check_scalar_f32(amax, "amax", scale, "scale")
        self.scale = scale
        self.amax = amax

    def _get_compatible_recipe(self):
        return DelayedScaling

    def scaling(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(scale, amax). Under torch.compile a slot of buffers is cut from them inside the graph: AOTAutograd
        cannot take graph inputs that alias each other and are written next to tensor-subclass inputs
        (FP8 weights)."""
        if self._slot is not None and torch.compiler.is_compiling():
            scale, amax_history, i = self._slot
            return scale[i:i + 1], amax_history[0, i:i + 1]
        return self.scale, self.amax

    def _cast(self, x: torch.Tensor, columnwise: Optional[bool] = None) -> Float8Tensor:
        scale, amax = self.scaling()
        if x.device != scale.device:
            raise ValueError(f"x is on {x.device} but the quantizer's scale is on {scale.device}")
        return self._cast_with(x, scale, amax, columnwise)

    def calibrate(self, tensor: torch.Tensor) -> None:
        """Set amax to max|tensor| without casting (TE's calibration step)."""
        check_tensor(tensor, "tensor")
        self.amax.copy_(fp8_kernels.compute_amax(tensor.detach().contiguous()).reshape(self.amax.shape))

    def scale_for_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """The scale to cast a tensor of this amax with (e.g. reduced over shards), recording the amax as
        a call would: the scale fixed beforehand; amax = max(amax, the tensor's)."""
        scale, own_amax = self.scaling()
        torch.maximum(own_amax, amax.reshape(own_amax.shape), out=own_amax)
        return scale


class Float8CurrentScalingQuantizer(_Float8Quantizer):
    """Current scaling: each call computes amax of x, then scale = fp8_max / amax, then casts.

    TE's constructor: Float8CurrentScalingQuantizer(fp8_dtype, device, *, rowwise=True, columnwise=True,
    with_amax_reduction=False, amax_reduction_group=None, force_pow_2_scales=False, amax_epsilon=0.0).
    device may be None: the state then follows the first tensor quantized. with_amax_reduction=True
    all-reduces (MAX) each tensor's amax over amax_reduction_group (default: the whole world) before
    the scale is taken, so every rank casts with the same scale.

    The quantizer's `amax` and `scale` tensors hold the values of the last call.
    """

    def __init__(self, fp8_dtype, device=None, *, rowwise: bool = True, columnwise: bool = True,
                 with_amax_reduction: bool = False, amax_reduction_group=None, force_pow_2_scales: bool = False,
                 amax_epsilon: float = 0.0):
        super().__init__(fp8_dtype, rowwise=rowwise, columnwise=columnwise)
        if amax_epsilon < 0:
            raise ValueError(f"amax_epsilon must be >= 0, got {amax_epsilon}")
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.amax = torch.zeros(1, dtype=torch.float32, device=device)
        self.scale = torch.ones(1, dtype=torch.float32, device=device)
        self.with_amax_reduction = bool(with_amax_reduction)
        self.amax_reduction_group = amax_reduction_group
        self.force_pow_2_scales = force_pow_2_scales
        self.amax_epsilon = amax_epsilon

    def _get_compatible_recipe(self):
        return Float8CurrentScaling

    def _cast(self, x: torch.Tensor, columnwise: Optional[bool] = None) -> Float8Tensor:
        if x.device != self.amax.device:
            # Follow the data: the scaling state is tiny.
            self.amax = self.amax.to(x.device)
            self.scale = self.scale.to(x.device)
        amax = fp8_kernels.compute_amax(x.contiguous())
        if self.with_amax_reduction:
            if not torch.distributed.is_initialized():
                raise RuntimeError("with_amax_reduction=True needs torch.distributed to be initialized")
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=self.amax_reduction_group)
        return self._cast_with(x, self.scale_for_amax(amax), amax.clone(), columnwise)

    def calibrate(self, tensor: torch.Tensor) -> None:
        """Nothing to calibrate: every cast takes its own amax (TE's behaviour)."""
        del tensor

    def scale_for_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """The scale to cast a tensor of this amax with (e.g. reduced over shards): fp8_max / amax; the
        quantizer's amax and scale hold them afterwards."""
        scale, _ = fp8_kernels.current_scale(amax, fp8_kernels.fp8_max(self.fp8_dtype),
                                             self.amax_epsilon, self.force_pow_2_scales)
        self.amax.copy_(amax)
        self.scale.copy_(scale)
        return scale


# The ops that stay in FP8 (written down for users; the table above is the source of truth).
Float8Tensor.OPS = tuple(sorted(str(op) for op in _FP8_OPS))

# torch.load(weights_only=True), torch's default, may rebuild Float8Tensors (state dicts, checkpoints).
torch.serialization.add_safe_globals([Float8Tensor, _rebuild_float8_tensor, Float8Quantizer, Float8CurrentScalingQuantizer])
