"""MXFP8Tensor and MXFP8Quantizer: FP8 values in blocks of 32 sharing an E8M0 scale (OCP MX v1.0,
with TransformerEngine's scale rounding; docs/block_scaling.md).

Rowwise data is scaled in 1x32 blocks along the last dimension (the reduction dimension of the
forward GEMMs), columnwise data in 32x1 blocks along the flattened leading dimensions (the
weight-gradient GEMM's); both keep the tensor's shape, and both are computed from the
high-precision values (no requantization). Data are the FP8 codes as uint8 bytes, as TE keeps them;
scales are uint8 E8M0 codes in TE's padded shapes.
"""

import math
from typing import Tuple

import torch

from ..kernels import fp8_block as kernels
from ..recipe import MXFP8BlockScaling
from ..te_dtype import fp8_torch_dtype
from ._block_scaled_tensor import (BlockScaledQuantizer, BlockScaledTensor, _rebuild_block_scaled, fp8_data,
                                   traced_quantizer)

MXFP8_BLOCK_SCALING_SIZE = kernels.MXFP8_BLOCK


class MXFP8Tensor(BlockScaledTensor):
    """A tensor quantized to MXFP8. Its values (rowwise) are `fp8_data(self) * 2^(scale - 127)` per
    1x32 block; see BlockScaledTensor for the buffers."""

    def _dequantize_usage(self, columnwise: bool, dtype: torch.dtype) -> torch.Tensor:
        data = fp8_data(self, columnwise)
        scale = self._columnwise_scale_inv if columnwise else self._rowwise_scale_inv
        cols = self.shape[-1] if self.dim() else 1
        block = (MXFP8_BLOCK_SCALING_SIZE, 1) if columnwise else (1, MXFP8_BLOCK_SCALING_SIZE)
        out = kernels.block_dequantize(data.reshape(-1, cols), scale, *block, dtype=dtype)
        return out.reshape(self.shape)

    _ROW_BLOCK = MXFP8_BLOCK_SCALING_SIZE  # the columnwise blocks

    def _row_layout(self) -> dict:
        return {"_rowwise_data": (0, 1), "_rowwise_scale_inv": (0, 1), "_columnwise_data": (0, 1),
                "_columnwise_scale_inv": (0, MXFP8_BLOCK_SCALING_SIZE)}

    def _buffer_shape(self, name: str, shape) -> Tuple[int, ...]:
        if name.endswith("_data"):
            return tuple(shape)
        return kernels.mxfp8_scale_shape(tuple(shape), name.startswith("_columnwise"))


class MXFP8Quantizer(BlockScaledQuantizer):
    """Quantizes a high-precision tensor to MXFP8 (TE's MXFP8Quantizer: both usages by default).
    fp8_dtype: a torch float8 dtype or TE's DType.kFloat8E4M3 / kFloat8E5M2."""

    def __init__(self, fp8_dtype, *, rowwise: bool = True, columnwise: bool = True):
        fp8_dtype = fp8_torch_dtype(fp8_dtype)
        self.dtype = fp8_dtype
        super().__init__(rowwise=rowwise, columnwise=columnwise)

    def _get_compatible_recipe(self):
        return MXFP8BlockScaling

    def quantize(self, x: torch.Tensor) -> MXFP8Tensor:
        if x.dim() < 1:
            raise ValueError("x must have at least 1 dimension to be quantized to MXFP8")
        src = x.detach().contiguous()
        data, scale, col_data, col_scale = kernels.mxfp8_quantize(src, self.dtype, self.rowwise, self.columnwise)
        return MXFP8Tensor(x.shape, x.dtype, rowwise_data=data, rowwise_scale_inv=scale, columnwise_data=col_data,
                           columnwise_scale_inv=col_scale, fp8_dtype=self.dtype,
                           quantizer=traced_quantizer(self))

    def create_tensor_from_data(self, data: torch.Tensor, scale_inv: torch.Tensor,
                                fake_dtype: torch.dtype = torch.float32, fp8_dtype=None) -> MXFP8Tensor:
        """TE's: an MXFP8Tensor (rowwise usage) over FP8 codes `data` (uint8 or float8) and their E8M0
        scales `scale_inv` (uint8, this quantizer's rowwise scale shape for data's shape)."""
        fp8_dtype = self.dtype if fp8_dtype is None else fp8_torch_dtype(fp8_dtype)
        if data.dtype not in (torch.uint8, fp8_dtype):
            raise TypeError(f"data must be uint8 or {fp8_dtype}, got {data.dtype}")
        expected = tuple(self.get_scale_shape(tuple(data.shape), False))
        if scale_inv.dtype != torch.uint8 or tuple(scale_inv.shape) != expected:
            raise ValueError(f"scale_inv must be uint8 of shape {expected}, got {scale_inv.dtype} "
                             f"{tuple(scale_inv.shape)}")
        return MXFP8Tensor(data.shape, fake_dtype, rowwise_data=data, rowwise_scale_inv=scale_inv,
                           columnwise_data=None, columnwise_scale_inv=None, fp8_dtype=fp8_dtype,
                           quantizer=traced_quantizer(self))

    def make_empty(self, shape, *, dtype: torch.dtype = torch.float32, device=None,
                   requires_grad: bool = False) -> MXFP8Tensor:
        """An uninitialized MXFP8Tensor of `shape` with this quantizer's usages, for update_quantized to fill."""
        shape = tuple(int(n) for n in shape)
        if not shape:
            raise ValueError("shape must have at least 1 dimension to be quantized to MXFP8")
        device = torch.device("cpu") if device is None else torch.device(device)
        buffers = {}
        for usage, columnwise in (("rowwise", False), ("columnwise", True)):
            if getattr(self, usage):
                buffers[f"{usage}_data"] = torch.empty(shape, dtype=torch.uint8, device=device)
                buffers[f"{usage}_scale_inv"] = torch.empty(self.get_scale_shape(shape, columnwise),
                                                            dtype=torch.uint8, device=device)
        return MXFP8Tensor(shape, dtype, fp8_dtype=self.dtype, quantizer=self, requires_grad=requires_grad,
                           **buffers)

    def get_scale_shape(self, shape, columnwise: bool) -> Tuple[int, int]:
        return kernels.mxfp8_scale_shape(tuple(shape), columnwise)

    def get_columnwise_shape(self, shape) -> Tuple[int, ...]:
        return tuple(shape)

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """TE's test: both matrix dimensions multiples of 32 (te_fuser's kernels also take other sizes)."""
        return inp.dim() >= 2 and inp.shape[-1] % MXFP8_BLOCK_SCALING_SIZE == 0 and \
            math.prod(inp.shape[:-1]) % MXFP8_BLOCK_SCALING_SIZE == 0

    def __repr__(self) -> str:
        return f"MXFP8Quantizer(fp8_dtype={self.dtype}, rowwise={self.rowwise}, columnwise={self.columnwise})"


torch.serialization.add_safe_globals([MXFP8Tensor, MXFP8Quantizer, _rebuild_block_scaled])
