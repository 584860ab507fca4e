"""Float8Tensor: FP8 bytes with their inverse scale, and how they are saved for backward."""

from typing import List, Optional, Tuple

import torch

from .kernels import fp8 as fp8_kernels
from .quantized_tensor import QuantizedTensor


class Float8Tensor(QuantizedTensor):
    """A tensor quantized to FP8 with one per-tensor scale.

    It is a plain container (a QuantizedTensor, not a torch.Tensor subclass): the FP8 GEMMs and
    kernels consume its parts directly, and `dequantize()` gives a tensor back.

    _data:      the FP8 values (torch.float8_e4m3fn / float8_e5m2), the tensor's shape
    _scale_inv: float32 tensor of one element, 1 / scale
    _fp8_dtype: the dtype of _data
    _transpose: optional FP8 transpose of _data viewed as a matrix (cast-transpose output)
    dtype:      the nominal (high-precision) dtype it stands for
    """

    __slots__ = ("_data", "_scale_inv", "_fp8_dtype", "_transpose", "dtype")

    def __init__(self, data: Optional[torch.Tensor], scale_inv: Optional[torch.Tensor],
                 fp8_dtype: torch.dtype, dtype: torch.dtype, transpose: Optional[torch.Tensor] = None):
        self._data = data
        self._scale_inv = scale_inv
        self._fp8_dtype = fp8_dtype
        self._transpose = transpose
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return self._live()._data.shape

    @property
    def device(self) -> torch.device:
        return self._live()._data.device

    def size(self, dim: Optional[int] = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self._live()._data.numel()

    def _live(self) -> "Float8Tensor":
        if self._data is None:
            raise RuntimeError(
                "this Float8Tensor holds no data: it is a shell left by prepare_for_saving() "
                "or its buffers were released after backward"
            )
        return self

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The values as a `dtype` tensor (default: the nominal dtype)."""
        self._live()
        return fp8_kernels.dequantize(self._data, self._scale_inv, dtype or self.dtype)

    def transpose_dequantized(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The cast-transpose data dequantized (the transpose of the 2-D view of the values)."""
        if self._transpose is None:
            raise RuntimeError("this Float8Tensor was quantized without its transpose (columnwise=False)")
        return fp8_kernels.dequantize(self._transpose, self._scale_inv, dtype or self.dtype)

    def prepare_for_saving(self) -> Tuple[List[Optional[torch.Tensor]], "Float8Tensor"]:
        """Hand the buffers over for ctx.save_for_backward; self becomes an empty shell."""
        tensors = [self._data, self._transpose, self._scale_inv]
        self._data = self._transpose = self._scale_inv = None
        return tensors, self

    def restore_from_saved(self, tensors: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        """Take back the buffers given by prepare_for_saving(); returns the tensors left over."""
        self._data, self._transpose, self._scale_inv = tensors[0], tensors[1], tensors[2]
        return tensors[3:]

    def clear(self) -> None:
        """Drop every buffer reference (what backward does once it is done with the tensor)."""
        self._data = self._transpose = self._scale_inv = None

    def __repr__(self) -> str:
        if self._data is None:
            return f"Float8Tensor(<empty shell>, fp8_dtype={self._fp8_dtype}, dtype={self.dtype})"
        return (f"Float8Tensor(shape={tuple(self._data.shape)}, fp8_dtype={self._fp8_dtype}, "
                f"dtype={self.dtype}, scale_inv={self._scale_inv.item():.6g}, "
                f"transpose={'yes' if self._transpose is not None else 'no'})")
