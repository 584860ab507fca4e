"""Float8BlockwiseQTensor and Float8BlockQuantizer: FP8 values with a float32 scale per 1x128 tile
(activations, gradients) or 128x128 block (weights), TransformerEngine's Float8BlockScaling
(docs/block_scaling.md).

Rowwise data has the tensor's shape; columnwise data is transposed, (shape[-1], *shape[:-1]), as
TE's GEMMs take it: 128x1 tiles of the tensor for 1D scaling, the same 128x128 blocks for 2D.
Data are the FP8 codes as uint8 bytes, as TE keeps them; scales are float32 scale_inv in TE's "GEMM ready"
layouts (1D ones transposed).

A 1D quantizer with all_gather_usage=True writes TE's COMPACT format instead, what an all-gather sends:
columnwise data in the tensor's own shape, scales unpadded and untransposed, rowwise (rows, cols / 128) and
columnwise (rows / 128, cols). Such a tensor dequantizes, changes usages, pickles and copies; the GEMMs take
the GEMM-ready format (gemm_ready() converts).
"""

import enum
import math
from typing import Optional, Tuple

import torch
from torch._prims_common import infer_size
from torch.utils._python_dispatch import return_and_correct_aliasing

from ..kernels import fp8_block as kernels
from ..recipe import Float8BlockScaling
from ..te_dtype import fp8_torch_dtype
from ._block_scaled_tensor import BlockScaledQuantizer, BlockScaledTensor, fp8_data, traced_quantizer

BLOCK_LEN = kernels.BLOCK_LEN
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


class Float8BlockScaleTensorFormat(enum.Enum):
    """TE's layouts of a Float8BlockwiseQTensor (transformer_engine_torch.Float8BlockScaleTensorFormat)."""

    GEMM_READY = 0
    COMPACT = 1


def _matrix(shape) -> Tuple[int, int]:
    """(rows, cols) of a tensor of `shape` as a matrix; a 0-d tensor is 1 x 1."""
    return (math.prod(shape[:-1]), shape[-1]) if len(shape) else (1, 1)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """A copy of t with row-major strides (contiguous() keeps a transposed view whose dims of size 1 make it
    count as contiguous, and such strides cannot be viewed as bytes)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


class Float8BlockwiseQTensor(BlockScaledTensor):
    """A tensor quantized with Float8 block scaling; `_is_2D_scaled` says 128x128 blocks (else 1x128
    tiles), `_data_format` TE's layout (the module docstring). See BlockScaledTensor for the buffers."""

    def _set_meta(self, is_2D_scaled: bool = False,
                  data_format: Float8BlockScaleTensorFormat = Float8BlockScaleTensorFormat.GEMM_READY) -> None:
        data_format = Float8BlockScaleTensorFormat(data_format)
        if is_2D_scaled and data_format is Float8BlockScaleTensorFormat.COMPACT:
            raise NotImplementedError("the COMPACT format (all_gather_usage) is implemented for 1D block scaling only")
        self._is_2D_scaled = bool(is_2D_scaled)
        self._data_format = data_format

    def _meta(self) -> dict:
        return {"is_2D_scaled": self._is_2D_scaled, "data_format": self._data_format}

    @property
    def _compact(self) -> bool:
        return self._data_format is Float8BlockScaleTensorFormat.COMPACT

    @classmethod
    def _handled_op(cls, func, args, kwargs):
        if func in _VIEWS and isinstance(args[0], Float8BlockwiseQTensor):
            viewed = args[0]._live()._viewed(args[1])
            if viewed is not None:
                return return_and_correct_aliasing(func, args, kwargs, viewed)
        return super()._handled_op(func, args, kwargs)

    def _viewed(self, shape):
        """This tensor viewed as `shape`, its buffers viewed with it, when the last dimension stays (the
        scales follow the (rows, last dim) matrix, which such a view leaves as it is); else None."""
        shape = tuple(infer_size(tuple(shape), self.numel()))
        if not shape or not self.dim() or shape[-1] != self.shape[-1] or self._compact:
            return None
        data, data_t = self._rowwise_data, self._columnwise_data
        return Float8BlockwiseQTensor(
            shape, self.dtype, fp8_dtype=self._fp8_dtype, quantizer=self._quantizer, is_2D_scaled=self._is_2D_scaled,
            rowwise_data=None if data is None else data.view(shape), rowwise_scale_inv=self._rowwise_scale_inv,
            columnwise_data=None if data_t is None else data_t.view((shape[-1], *shape[:-1])),
            columnwise_scale_inv=self._columnwise_scale_inv)

    def _dequantize_usage(self, columnwise: bool, dtype: torch.dtype) -> torch.Tensor:
        rows, cols = _matrix(self.shape)
        if self._compact:  # both usages in the tensor's shape, scales (rows, col blocks) / (row blocks, cols)
            data = fp8_data(self, columnwise)
            scale = self._columnwise_scale_inv if columnwise else self._rowwise_scale_inv
            block = (BLOCK_LEN, 1) if columnwise else (1, BLOCK_LEN)
            out = kernels.block_dequantize(data.reshape(rows, cols), scale, *block, scale_transposed=False,
                                           dtype=dtype)
            return out.reshape(self.shape)
        block = (BLOCK_LEN, BLOCK_LEN) if self._is_2D_scaled else (1, BLOCK_LEN)
        if not columnwise:
            out = kernels.block_dequantize(fp8_data(self).reshape(rows, cols), self._rowwise_scale_inv, *block,
                                           scale_transposed=not self._is_2D_scaled, dtype=dtype)
            return out.reshape(self.shape)
        out_t = kernels.block_dequantize(fp8_data(self, True).reshape(cols, rows), self._columnwise_scale_inv,
                                         *block, scale_transposed=not self._is_2D_scaled, dtype=dtype)
        return out_t.t().reshape(self.shape)

    def gemm_ready(self) -> "Float8BlockwiseQTensor":
        """This tensor in the GEMM-ready format: itself when it is; else a new tensor over re-laid copies of
        the COMPACT buffers (the same bytes and scales, as TE converts them after an all-gather)."""
        if not self._compact:
            return self
        self._live()
        rows, cols = _matrix(self.shape)
        buffers = {}
        if self._rowwise_data is not None:
            scale = self._rowwise_scale_inv.new_zeros(kernels.fp8_block_scale_shape(tuple(self.shape), 1, False))
            scale[:, :rows] = self._rowwise_scale_inv.t()
            buffers.update(rowwise_data=self._rowwise_data, rowwise_scale_inv=scale)
        if self._columnwise_data is not None:
            data_t = self._columnwise_data.reshape(rows, cols).t().contiguous()
            scale_t = self._columnwise_scale_inv.new_zeros(kernels.fp8_block_scale_shape(tuple(self.shape), 1, True))
            scale_t[:, :cols] = self._columnwise_scale_inv
            buffers.update(columnwise_data=data_t.view((cols, *self.shape[:-1]) if self.dim() else ()),
                           columnwise_scale_inv=scale_t)
        return Float8BlockwiseQTensor(self.shape, self.dtype, fp8_dtype=self._fp8_dtype, quantizer=self._quantizer,
                                      is_2D_scaled=False, **buffers)


    _ROW_BLOCK = BLOCK_LEN

    def _row_layout(self) -> dict:
        if self._compact:
            raise NotImplementedError("a COMPACT Float8BlockwiseQTensor (all_gather_usage) is not cut by rows: "
                                      "convert it with gemm_ready() first")
        # Data: rowwise (rows, cols), columnwise (cols, rows). Scales: 2-D (row blocks, col blocks) and transposed;
        # 1-D tiles in TE's GEMM-ready layout, rowwise (col blocks, rows), columnwise (row blocks, cols).
        if self._is_2D_scaled:
            scales = {"_rowwise_scale_inv": (0, BLOCK_LEN), "_columnwise_scale_inv": (1, BLOCK_LEN)}
        else:
            scales = {"_rowwise_scale_inv": (1, 1), "_columnwise_scale_inv": (0, BLOCK_LEN)}
        return {"_rowwise_data": (0, 1), "_columnwise_data": (1, 1), **scales}

    def _buffer_shape(self, name: str, shape) -> Tuple[int, ...]:
        shape = tuple(shape)
        if name == "_rowwise_data":
            return shape
        if name == "_columnwise_data":
            return (shape[-1], *shape[:-1])
        return kernels.fp8_block_scale_shape(shape, 2 if self._is_2D_scaled else 1, name.startswith("_columnwise"))

    def _columnwise_from_rowwise_buffers(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """A 128x128-scaled tensor's columnwise data is its rowwise bytes transposed, under the same scales
        (what a quantizer with both usages writes); 1x128 tiles have other scales: None."""
        if not self._is_2D_scaled or self._rowwise_data is None:
            return None
        rows, cols = _matrix(self.shape)
        data_t = self._rowwise_data.reshape(rows, cols).t().contiguous().view((cols, *self.shape[:-1]))
        row_blocks, col_blocks = -(-rows // BLOCK_LEN), -(-cols // BLOCK_LEN)
        scale_t = self._rowwise_scale_inv.new_zeros(kernels.fp8_block_scale_shape(tuple(self.shape), 2, True))
        scale_t[:col_blocks, :row_blocks] = self._rowwise_scale_inv[:row_blocks, :col_blocks].t()
        return data_t, scale_t

    def columnwise_from_rowwise(self) -> "Float8BlockwiseQTensor":
        """A new tensor holding only the columnwise usage, made from this 128x128-scaled tensor's rowwise
        usage without requantizing (_columnwise_from_rowwise_buffers). A weight keeps its rowwise usage only
        and its dgrad reads this."""
        made = self._columnwise_from_rowwise_buffers()
        if made is None:
            raise ValueError("columnwise_from_rowwise() needs the rowwise usage of a 128x128-scaled tensor")
        return Float8BlockwiseQTensor(self.shape, self.dtype, fp8_dtype=self._fp8_dtype,
                                      quantizer=traced_quantizer(self._quantizer), is_2D_scaled=True,
                                      columnwise_data=made[0], columnwise_scale_inv=made[1])

class Float8BlockQuantizer(BlockScaledQuantizer):
    """Quantizes a high-precision tensor with Float8 block scaling (TE's Float8BlockQuantizer):
    block_scaling_dim 1 (1x128 tiles) or 2 (128x128 blocks); amax_epsilon floors each block's amax;
    force_pow_2_scales rounds each scale down to a power of two. fp8_dtype: a torch float8 dtype or TE's
    DType.kFloat8E4M3 / kFloat8E5M2."""

    def __init__(self, fp8_dtype, *, rowwise: bool, columnwise: bool, amax_epsilon: float = 0.0,
                 force_pow_2_scales: bool = True, block_scaling_dim: int = 2, all_gather_usage: bool = False):
        fp8_dtype = fp8_torch_dtype(fp8_dtype)
        if block_scaling_dim not in (1, 2):
            raise ValueError(f"block_scaling_dim must be 1 or 2, got {block_scaling_dim!r}")
        self.all_gather_usage = bool(all_gather_usage)
        if not 0.0 <= amax_epsilon < math.inf:
            raise ValueError(f"amax_epsilon must be finite and >= 0, got {amax_epsilon}")
        self.dtype = fp8_dtype
        self.block_len = BLOCK_LEN
        self.amax_epsilon = float(amax_epsilon)
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.block_scaling_dim = block_scaling_dim
        super().__init__(rowwise=rowwise, columnwise=columnwise)

    @property
    def _data_format(self) -> Float8BlockScaleTensorFormat:
        return (Float8BlockScaleTensorFormat.COMPACT if self.all_gather_usage
                else Float8BlockScaleTensorFormat.GEMM_READY)

    def _get_compatible_recipe(self):
        return Float8BlockScaling

    def quantize(self, x: torch.Tensor) -> Float8BlockwiseQTensor:
        if self.all_gather_usage and self.block_scaling_dim == 2:
            raise NotImplementedError("all_gather_usage (TE's COMPACT format) is implemented for 1D block "
                                      "scaling only (block_scaling_dim=1)")
        shape = x.shape
        data, s_inv, data_t, s_inv_t = kernels.fp8_block_quantize(
            x.detach().reshape(shape if x.dim() else (1,)).contiguous(), self.dtype, self.block_scaling_dim,
            self.amax_epsilon, self.force_pow_2_scales, self.rowwise, self.columnwise)
        rows, cols = _matrix(shape)
        if data is not None:
            data = data.view(shape)
        if data_t is not None:
            data_t = data_t.view(self.get_columnwise_shape(shape) if not self.all_gather_usage else (cols, rows))
        if self.all_gather_usage:  # TE's COMPACT layouts (the module docstring), in fresh row-major buffers
            s_inv = None if s_inv is None else _row_major(s_inv[:, :rows].t())
            s_inv_t = None if s_inv_t is None else _row_major(s_inv_t[:, :cols])
            data_t = None if data_t is None else _row_major(data_t.reshape(cols, rows).t()).view(shape)
        return Float8BlockwiseQTensor(shape, x.dtype, rowwise_data=data, rowwise_scale_inv=s_inv,
                                      columnwise_data=data_t, columnwise_scale_inv=s_inv_t, fp8_dtype=self.dtype,
                                      quantizer=traced_quantizer(self), is_2D_scaled=self.block_scaling_dim == 2,
                                      data_format=self._data_format)

    def make_empty(self, shape, *, dtype: torch.dtype = torch.float32, device=None,
                   requires_grad: bool = False) -> Float8BlockwiseQTensor:
        """An uninitialized Float8BlockwiseQTensor of `shape` with this quantizer's usages, for
        update_quantized to fill."""
        shape = tuple(int(n) for n in shape)
        device = torch.device("cpu") if device is None else torch.device(device)
        buffers = {}
        for usage, data_shape, columnwise in (("rowwise", shape, False),
                                              ("columnwise", self.get_columnwise_shape(shape), True)):
            if getattr(self, usage):
                buffers[f"{usage}_data"] = torch.empty(data_shape, dtype=torch.uint8, device=device)
                buffers[f"{usage}_scale_inv"] = torch.empty(self.get_scale_shape(shape, columnwise),
                                                            dtype=torch.float32, device=device)
        return Float8BlockwiseQTensor(shape, dtype, fp8_dtype=self.dtype, quantizer=self,
                                      is_2D_scaled=self.block_scaling_dim == 2, requires_grad=requires_grad,
                                      data_format=self._data_format, **buffers)

    def get_scale_shape(self, shape, columnwise: bool) -> Tuple[int, int]:
        if self.all_gather_usage and self.block_scaling_dim == 1:
            rows, cols = _matrix(tuple(shape))
            return (-(-rows // BLOCK_LEN), cols) if columnwise else (rows, -(-cols // BLOCK_LEN))
        return kernels.fp8_block_scale_shape(tuple(shape), self.block_scaling_dim, columnwise)

    def get_columnwise_shape(self, shape) -> Tuple[int, ...]:
        shape = tuple(shape)
        if self.all_gather_usage and self.block_scaling_dim == 1:
            return shape
        return (shape[-1], *shape[:-1]) if shape else ()

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """TE's test: both matrix dimensions multiples of 128 (te_fuser's kernels also take other sizes)."""
        return inp.dim() >= 2 and inp.shape[-1] % BLOCK_LEN == 0 and math.prod(inp.shape[:-1]) % BLOCK_LEN == 0

    def __repr__(self) -> str:
        return (f"Float8BlockQuantizer(fp8_dtype={self.dtype}, rowwise={self.rowwise}, columnwise={self.columnwise}, "
                f"block_scaling_dim={self.block_scaling_dim}, amax_epsilon={self.amax_epsilon}, "
                f"force_pow_2_scales={self.force_pow_2_scales}, all_gather_usage={self.all_gather_usage})")


torch.serialization.add_safe_globals([Float8BlockwiseQTensor, Float8BlockQuantizer, Float8BlockScaleTensorFormat])
