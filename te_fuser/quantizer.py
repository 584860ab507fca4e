"""Quantizers: turn a high-precision tensor into a Float8Tensor.

A quantizer holds its scaling state as tensors (scale, amax) and updates
amax in place each time it is called, so recipe code can reduce and roll
amaxes without the quantizer's help.
"""

from typing import Optional

import torch

from .float8_tensor import Float8Tensor
from .kernels import fp8 as fp8_kernels
from .kernels.validate import check_fp8_dtype, check_scalar_f32, check_tensor


class Quantizer:
    """Common part: the FP8 dtype and which layouts a quantized tensor carries.

    rowwise:    the data in the tensor's own layout (forward GEMMs)
    columnwise: also the transposed data (the weight-gradient GEMM), from one cast-transpose pass
    """

    def __init__(self, fp8_dtype: torch.dtype, rowwise: bool = True, columnwise: bool = False):
        check_fp8_dtype(fp8_dtype)
        self.fp8_dtype = fp8_dtype
        self.set_usage(rowwise=rowwise, columnwise=columnwise)

    def set_usage(self, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        if rowwise is not None:
            self.rowwise = bool(rowwise)
        if columnwise is not None:
            self.columnwise = bool(columnwise)
        if not self.rowwise:
            raise ValueError("rowwise usage cannot be turned off: te_fuser always keeps the row-major data")

    def _cast(self, x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor) -> Float8Tensor:
        x = x.contiguous()
        if self.columnwise and x.dim() >= 2:
            data, data_t = fp8_kernels.cast_transpose(x, scale, amax, self.fp8_dtype)
        else:
            data, data_t = fp8_kernels.quantize(x, scale, amax, self.fp8_dtype), None
        return Float8Tensor(data, torch.reciprocal(scale), self.fp8_dtype, x.dtype, transpose=data_t)

    def __call__(self, x: torch.Tensor) -> Float8Tensor:
        check_tensor(x, "x")
        return self.quantize(x)


class Float8Quantizer(Quantizer):
    """Delayed scaling: casts with a scale fixed beforehand and records amax = max(amax, max|x|).

    scale and amax are float32 tensors of one element, usually views into a
    recipe state's buffers, so every update lands there.
    """

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype,
                 rowwise: bool = True, columnwise: bool = False):
        super().__init__(fp8_dtype, rowwise, columnwise)
        check_scalar_f32(scale, "scale", scale, "scale")
        check_scalar_f32(amax, "amax", scale, "scale")
        self.scale = scale
        self.amax = amax

    def quantize(self, x: torch.Tensor) -> Float8Tensor:
        if x.device != self.scale.device:
            raise ValueError(f"x is on {x.device} but the quantizer's scale is on {self.scale.device}")
        return self._cast(x, self.scale, self.amax)

    def scale_for_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """The scale to cast a tensor of this amax with (e.g. reduced over shards), recording the amax as
        a call would: the scale fixed beforehand; amax = max(amax, the tensor's)."""
        torch.maximum(self.amax, amax, out=self.amax)
        return self.scale


class Float8CurrentScalingQuantizer(Quantizer):
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
