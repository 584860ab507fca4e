"""Float8Tensor (FP8 bytes with their inverse scale, as a torch.Tensor, and how it is saved for backward)
and its quantizers: Float8Quantizer (delayed scaling) and Float8CurrentScalingQuantizer.

A quantizer holds its scaling state as tensors (scale, amax) and updates amax in place each time it is
called, so recipe code can reduce and roll amaxes without the quantizer's help.
"""

import copy
import weakref
from typing import List, Optional, Tuple

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from ..kernels import fp8 as fp8_kernels
from ..kernels.validate import FLOAT_DTYPES as _HIGH_PRECISION  # what the FP8 kernels read and write
from ..kernels.validate import check_fp8_dtype, check_scalar_f32
from .quantized_tensor import QuantizedTensor, Quantizer

aten = torch.ops.aten


def fp8_transpose(data: torch.Tensor) -> torch.Tensor:
    """Transpose of FP8 data viewed as (numel / last dim, last dim): one pass over the bytes (on the
    CPU te_fuser's kernel, about four times faster there than torch's transpose of bytes)."""
    if data.device.type == "cpu" and data.dim() >= 1:
        return fp8_kernels.transpose(data.contiguous())
    d2 = data.reshape(-1, data.shape[-1])
    return d2.view(torch.uint8).t().contiguous().view(data.dtype)


class Float8Tensor(QuantizedTensor):
    """A tensor quantized to FP8 with one per-tensor scale.

    It is a torch.Tensor of the nominal (high-precision) dtype and shape; its values are
    `_data * _scale_inv`. FP8 GEMMs and kernels consume its parts directly; every other op sees
    it dequantized (QuantizedTensor's rules; Float8Tensor.OPS lists the ops that stay in FP8).

    _data:      the FP8 values (torch.float8_e4m3fn / float8_e5m2), the tensor's shape
    _scale_inv: float32 tensor of one element, 1 / scale
    _fp8_dtype: the dtype of _data
    _transpose: optional FP8 transpose of _data viewed as a matrix (cast-transpose output)
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
    def __new__(cls, data: Optional[torch.Tensor], scale_inv: Optional[torch.Tensor], fp8_dtype: torch.dtype,
                dtype: torch.dtype, transpose: Optional[torch.Tensor] = None, *, shape=None,
                quantizer=None, requires_grad: bool = False):
        if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
        if dtype not in _HIGH_PRECISION:
            raise ValueError(f"dtype (the nominal dtype) must be one of {_HIGH_PRECISION}, got {dtype}")
        if scale_inv is not None and (scale_inv.dtype != torch.float32 or scale_inv.numel() != 1):
            raise ValueError(f"scale_inv must be a float32 tensor of one element, got {scale_inv.dtype} "
                             f"with {scale_inv.numel()} elements")
        if data is not None and transpose is not None and data.dim() > 0:
            rows = data.numel() // data.shape[-1] if data.shape[-1] else 0
            if tuple(transpose.shape) != (data.shape[-1], rows) or transpose.dtype != fp8_dtype:
                raise ValueError(f"transpose must be a {fp8_dtype} tensor of shape {(data.shape[-1], rows)}, "
                                 f"got {transpose.dtype} {tuple(transpose.shape)}")
        if data is not None:
            if data.dtype != fp8_dtype:
                raise ValueError(f"data must hold {fp8_dtype}, got {data.dtype}")
            if shape is not None and tuple(shape) != tuple(data.shape):
                raise ValueError(f"shape {tuple(shape)} does not match data's shape {tuple(data.shape)}")
            shape, device, strides = data.shape, data.device, data.stride()
        elif shape is None:
            raise ValueError("a Float8Tensor without data needs its shape")
        else:
            held = transpose if transpose is not None else scale_inv
            device = held.device if held is not None else torch.device("cpu")
            strides = None
        self = super().__new__(cls, shape, dtype, device, requires_grad, strides)
        self._data = data
        self._scale_inv = scale_inv
        self._fp8_dtype = fp8_dtype
        self._transpose = transpose
        self._quantizer = quantizer
        self._whole = None
        return self

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
        return Float8Tensor(self._data, self._scale_inv, self._fp8_dtype, self.dtype)

    def _like(self, data, transpose, scale_inv=None, requires_grad=False) -> "Float8Tensor":
        return Float8Tensor(data, self._scale_inv if scale_inv is None else scale_inv, self._fp8_dtype, self.dtype,
                            transpose, quantizer=self._quantizer, requires_grad=requires_grad)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The values as a `dtype` tensor (default: the nominal dtype)."""
        self._live()
        if dtype == torch.float64:  # exact: an FP8 value times a float32 scale fits a double
            return self._data.to(torch.float64) * self._scale_inv.to(torch.float64)
        if dtype not in (None, *_HIGH_PRECISION):
            return self.dequantize().to(dtype)
        data = self._data
        if not data.is_contiguous():  # a part or a strided view: the kernel reads contiguous bytes
            data = data.view(torch.uint8).contiguous().view(self._fp8_dtype)
        return fp8_kernels.dequantize(data, self._scale_inv, dtype or self.dtype)

    def transpose_dequantized(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The cast-transpose data dequantized (the transpose of the 2-D view of the values)."""
        if self._transpose is None:
            raise RuntimeError("this Float8Tensor was quantized without its transpose (columnwise=False)")
        return fp8_kernels.dequantize(self._transpose, self._scale_inv, dtype or self.dtype)

    def quantize_(self, src: torch.Tensor) -> "Float8Tensor":
        """Write src's values into this tensor's FP8 buffers (its quantizer's scale, else its own)."""
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
                self._data.view(torch.uint8).copy_(src._live()._data.view(torch.uint8))
                self._scale_inv.copy_(src._scale_inv)
                self._refresh_transpose()
                return self
            src = src.dequantize()
        src = src.to(self.device).contiguous()
        if self._quantizer is not None:
            fresh = self._quantizer.quantize(src)
            if fresh._fp8_dtype != self._fp8_dtype:
                raise ValueError(f"this Float8Tensor holds {self._fp8_dtype} but its quantizer casts to "
                                 f"{fresh._fp8_dtype}")
            self._data.view(torch.uint8).copy_(fresh._data.view(torch.uint8))
            self._scale_inv.copy_(fresh._scale_inv)
        else:
            scale = torch.reciprocal(self._scale_inv)
            scratch_amax = torch.zeros_like(self._scale_inv)
            self._data.copy_(fp8_kernels.quantize(src, scale, scratch_amax, self._fp8_dtype))
        self._refresh_transpose()
        return self

    def _refresh_transpose(self) -> None:
        if self._transpose is not None:
            self._transpose.copy_(fp8_transpose(self._data))

    def _quantize_part_(self, src: torch.Tensor) -> "Float8Tensor":
        """quantize_ of a part: the bytes outside it keep their values, read with the whole's scale."""
        whole, whole_transpose = self._whole
        if isinstance(src, Float8Tensor) and src._fp8_dtype == self._fp8_dtype and \
                torch.equal(src._live()._scale_inv, self._scale_inv):
            self._data.view(torch.uint8).copy_(src._data.view(torch.uint8))
        elif self._quantizer is None or not whole.is_contiguous():
            # The whole keeps its scale: only this part's bytes change (values beyond it saturate).
            values = (src.dequantize() if isinstance(src, Float8Tensor) else src).to(self.device)
            codes = fp8_kernels.quantize(values.contiguous(), torch.reciprocal(self._scale_inv),
                                         torch.zeros_like(self._scale_inv), self._fp8_dtype)
            self._data.view(torch.uint8).copy_(codes.view(torch.uint8))
        else:
            # The quantizer's scale is the whole's: requantize all of it, with this part's new values.
            values = Float8Tensor(whole, self._scale_inv, self._fp8_dtype, torch.float32).dequantize()
            part = values.as_strided(self.shape, self._data.stride(),
                                     self._data.storage_offset() - whole.storage_offset())
            part.copy_(src.dequantize(torch.float32) if isinstance(src, Float8Tensor) else src)
            fresh = self._quantizer.quantize(values)
            if fresh._fp8_dtype != self._fp8_dtype:
                raise ValueError(f"this Float8Tensor holds {self._fp8_dtype} but its quantizer casts to "
                                 f"{fresh._fp8_dtype}")
            whole.view(torch.uint8).copy_(fresh._data.view(torch.uint8))
            self._scale_inv.copy_(fresh._scale_inv)
        transpose = None if whole_transpose is None else whole_transpose()
        if transpose is not None:
            transpose.copy_(fp8_transpose(whole))
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

        Under torch.compile a traced tensor subclass cannot be emptied in place: the shell is then
        a Float8Record (metadata only), and restoring builds a new Float8Tensor.
        """
        tensors = [self._data, self._transpose, self._scale_inv]
        if torch.compiler.is_compiling():
            return tensors, Float8Record(self._fp8_dtype, self.dtype, self._quantizer)
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
        data = self._data.view(torch.uint8)
        if data.shape[0] < padded_rows:  # an uneven last shard: FSDP gathers equal sizes
            padded = data.new_zeros((padded_rows, *data.shape[1:]))
            padded[:data.shape[0]].copy_(data)
            data = padded
        return (data,), (self._scale_inv.clone(), self._fp8_dtype, self._quantizer)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The unsharded weight as a Float8Tensor over the gathered bytes (no copy)."""
        (gathered,) = all_gather_outputs
        scale_inv, fp8_dtype, quantizer = metadata
        if out is not None:  # later all-gathers land in the same storage: refresh the scale
            out._scale_inv.copy_(scale_inv)
            return None
        data = gathered.view(fp8_dtype)
        return Float8Tensor(data, scale_inv, fp8_dtype, param_dtype, quantizer=quantizer), ()

    # -- torch.compile, pickling, deepcopy --------------------------------------------------
    def __tensor_flatten__(self):
        names = ["_data", "_scale_inv"] + (["_transpose"] if self._transpose is not None else [])
        return names, (self._fp8_dtype, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        del outer_stride
        fp8_dtype, dtype = meta
        return Float8Tensor(inner["_data"], inner["_scale_inv"], fp8_dtype, dtype, inner.get("_transpose"),
                            shape=outer_size)

    def __reduce_ex__(self, protocol):
        self._live()
        return (_rebuild_float8_tensor,
                (self._data, self._scale_inv, self._fp8_dtype, self.dtype, self._transpose, self.requires_grad))

    def __deepcopy__(self, memo):
        self._live()
        out = Float8Tensor(self._data.clone(), self._scale_inv.clone(), self._fp8_dtype, self.dtype,
                           None if self._transpose is None else self._transpose.clone(),
                           quantizer=copy.deepcopy(self._quantizer, memo), requires_grad=self.requires_grad)
        memo[id(self)] = out
        return out

    def __repr__(self, *, tensor_contents=None) -> str:
        data = getattr(self, "_data", None)  # also called by torch.compile on half-built or traced objects
        fp8_dtype = getattr(self, "_fp8_dtype", None)
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


def _rebuild_float8_tensor(data, scale_inv, fp8_dtype, dtype, transpose, requires_grad):
    return Float8Tensor(data, scale_inv, fp8_dtype, dtype, transpose, requires_grad=requires_grad)


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
    # The transpose is of the (rows, last dim) matrix: still right while the last dim is unchanged.
    same_rows = data.dim() > 0 and t._data.dim() > 0 and data.shape[-1] == t._data.shape[-1]
    return _same_bytes(t, data, t._transpose if same_rows else None)


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


def _to(func, args, kwargs):
    """to / _to_copy: another dtype dequantizes; another device (or a copy) keeps FP8."""
    bound = _bound(func, args, kwargs)
    t, other = bound["self"], bound.get("other")
    dtype = other.dtype if other is not None else bound.get("dtype")
    device = other.device if other is not None else bound.get("device")
    device = torch.device(device) if device is not None else t.device
    if dtype is not None and dtype != t.dtype:
        return t.dequantize(dtype).to(device)
    if device == t.device and func != aten._to_copy.default and not bound.get("copy", False):
        return t
    move = lambda b: None if b is None else b.to(device, copy=True)  # noqa: E731
    return Float8Tensor(move(t._data), move(t._scale_inv), t._fp8_dtype, t.dtype, move(t._transpose),
                        quantizer=t._quantizer)


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
    data = torch.zeros(size, dtype=t._fp8_dtype, device=device)
    return Float8Tensor(data, t._scale_inv.to(device, copy=True), t._fp8_dtype, t.dtype, quantizer=t._quantizer)


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
    """What both FP8 quantizers share: the FP8 dtype and the cast with a given scale."""

    def __init__(self, fp8_dtype: torch.dtype, rowwise: bool = True, columnwise: bool = False):
        check_fp8_dtype(fp8_dtype)
        self.fp8_dtype = fp8_dtype
        super().__init__(rowwise, columnwise)

    def _cast(self, x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor) -> Float8Tensor:
        x = x.contiguous()
        if self.columnwise and x.dim() >= 2:
            data, data_t = fp8_kernels.cast_transpose(x, scale, amax, self.fp8_dtype)
        else:
            data, data_t = fp8_kernels.quantize(x, scale, amax, self.fp8_dtype), None
        return Float8Tensor(data, torch.reciprocal(scale), self.fp8_dtype, x.dtype, transpose=data_t)


class Float8Quantizer(_Float8Quantizer):
    """Delayed scaling: casts with a scale fixed beforehand and records amax = max(amax, max|x|).

    scale and amax are float32 tensors of one element, usually views into a
    recipe state's buffers, so every update lands there.
    """

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype,
                 rowwise: bool = True, columnwise: bool = False, *, slot: Optional[tuple] = None):
        super().__init__(fp8_dtype, rowwise, columnwise)
        check_scalar_f32(scale, "scale", scale, "scale")
        check_scalar_f32(amax, "amax", scale, "scale")
        self.scale = scale
        self.amax = amax
        self._slot = slot  # (scale buffer, amax buffer, i) when scale and amax are their element i

    def scaling(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(scale, amax). Under torch.compile a slot of buffers is cut from them inside the graph: AOTAutograd
        cannot take graph inputs that alias each other and are written next to tensor-subclass inputs
        (FP8 weights)."""
        if self._slot is not None and torch.compiler.is_compiling():
            scale, amax, i = self._slot
            return scale[i:i + 1], amax[i:i + 1]
        return self.scale, self.amax

    def quantize(self, x: torch.Tensor) -> Float8Tensor:
        scale, amax = self.scaling()
        if x.device != scale.device:
            raise ValueError(f"x is on {x.device} but the quantizer's scale is on {scale.device}")
        return self._cast(x, scale, amax)

    def scale_for_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """The scale to cast a tensor of this amax with (e.g. reduced over shards), recording the amax as
        a call would: the scale fixed beforehand; amax = max(amax, the tensor's)."""
        scale, own_amax = self.scaling()
        torch.maximum(own_amax, amax, out=own_amax)
        return scale


class Float8CurrentScalingQuantizer(_Float8Quantizer):
    """Current scaling: each call computes amax of x, then scale = fp8_max / amax, then casts.

    The quantizer's `amax` and `scale` tensors hold the values of the last call.
    """

    def __init__(self, fp8_dtype: torch.dtype, device=None, rowwise: bool = True, columnwise: bool = False,
                 force_pow_2_scales: bool = False, amax_epsilon: float = 0.0):
        super().__init__(fp8_dtype, rowwise, columnwise)
        if amax_epsilon < 0:
            raise ValueError(f"amax_epsilon must be >= 0, got {amax_epsilon}")
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.amax = torch.zeros(1, dtype=torch.float32, device=device)
        self.scale = torch.ones(1, dtype=torch.float32, device=device)
        self.force_pow_2_scales = force_pow_2_scales
        self.amax_epsilon = amax_epsilon

    def quantize(self, x: torch.Tensor) -> Float8Tensor:
        if x.device != self.amax.device:
            # Follow the data: the scaling state is tiny.
            self.amax = self.amax.to(x.device)
            self.scale = self.scale.to(x.device)
        amax = fp8_kernels.compute_amax(x.contiguous())
        return self._cast(x, self.scale_for_amax(amax), amax.clone())

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
torch.serialization.add_safe_globals([Float8Tensor, _rebuild_float8_tensor])
