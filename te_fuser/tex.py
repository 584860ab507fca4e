"""What te_fuser provides of `transformer_engine_torch`, TransformerEngine's compiled module (which TE
code imports as `tex`); te_fuser.compat's alias resolves that name to this module.

Only what te_fuser honours with its own kernels is here (the multi-tensor ones in torch:
kernels/multi_tensor.py); any other name of TE's module (its GEMMs, userbuffers, the fused optimizers'
kernels, ...) raises an AttributeError under the alias that names it.
"""

import enum
from typing import Optional

import torch

from .kernels import fp8 as fp8_kernels
from .kernels.multi_tensor import (multi_tensor_compute_scale_and_scale_inv, multi_tensor_l2norm, multi_tensor_scale,
                                   multi_tensor_unscale_l2norm)
from .kernels.validate import FLOAT_DTYPES
from .te_dtype import TORCH_DTYPE, DType, fp8_torch_dtype
from .tensor.float8_blockwise_tensor import Float8BlockScaleTensorFormat
from .tensor.quantized_tensor import QuantizedTensor


class FP8FwdTensors(enum.IntEnum):
    """TE's names of the forward FP8 slots of a module's scaling state, three per GEMM."""

    GEMM1_INPUT = 0
    GEMM1_WEIGHT = 1
    GEMM1_OUTPUT = 2
    GEMM2_INPUT = 3
    GEMM2_WEIGHT = 4
    GEMM2_OUTPUT = 5
    GEMM3_INPUT = 6
    GEMM3_WEIGHT = 7
    GEMM3_OUTPUT = 8


class FP8BwdTensors(enum.IntEnum):
    """TE's names of the backward FP8 slots, two per GEMM."""

    GRAD_OUTPUT1 = 0
    GRAD_INPUT1 = 1
    GRAD_OUTPUT2 = 2
    GRAD_INPUT2 = 3
    GRAD_OUTPUT3 = 4
    GRAD_INPUT3 = 5


class FP8TensorMeta:
    """TE's holder of one delayed-scaling state's tensors: `scale`, `scale_inv` and `amax_history`
    (history_len, n), each None until assigned."""

    def __init__(self):
        self.scale = None
        self.scale_inv = None
        self.amax_history = None

    def __repr__(self) -> str:
        shapes = {name: None if t is None else tuple(t.shape)
                  for name, t in (("scale", self.scale), ("scale_inv", self.scale_inv),
                                  ("amax_history", self.amax_history))}
        return f"FP8TensorMeta({', '.join(f'{k}={v}' for k, v in shapes.items())})"


def quantize(tensor: torch.Tensor, quantizer, output: Optional[QuantizedTensor] = None,
             noop: Optional[torch.Tensor] = None) -> QuantizedTensor:
    """tensor cast by quantizer (TE's signature); written into `output` when given. noop: TE's float32
    flag, 1 skips the cast (an output made here is then left uninitialized, as in TE)."""
    if output is None and noop is None:
        return quantizer.quantize(tensor)
    if output is None:
        output = quantizer.make_empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return quantizer.update_quantized(tensor, output, noop_flag=noop)


def dequantize(input: QuantizedTensor, otype: DType) -> torch.Tensor:  # noqa: A002 (TE's keyword)
    """input's values as a tensor of TE dtype `otype` (kFloat32, kFloat16 or kBFloat16)."""
    if not isinstance(input, QuantizedTensor):
        raise TypeError(f"input must be a quantized tensor, got {type(input).__name__}")
    dtype = TORCH_DTYPE.get(otype) if isinstance(otype, DType) else None
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"otype must be DType.kFloat32, kFloat16 or kBFloat16, got {otype!r}")
    return input.dequantize(dtype)


def fused_amax_and_scale_update_after_reduction(amax_reduction_buffer: Optional[torch.Tensor], amax_histories,
                                                scales, amax_compute_algo: str, fp8_dtype: DType,
                                                margin: float) -> None:
    """TE's delayed-scaling update after the amax all-reduce, in place, on te_fuser's kernel.

    amax_histories: (history_len, n_i) float32 tensors in TE's layout (row 0 the recorded amaxes);
    scales: their (n_i,) scales. The buffer, when given, holds the reduced amaxes of all of them one
    after another; a non-zero entry stands for its history's row 0. A tensor that recorded nothing
    keeps its history and scale; the others' windows are reduced with amax_compute_algo ("max" or
    "most_recent"), rolled up a row, and their scales set to fp8_max(fp8_dtype) / amax / 2^margin."""
    amax_histories, scales = list(amax_histories), list(scales)
    if len(amax_histories) != len(scales):
        raise ValueError(f"amax_histories has {len(amax_histories)} tensors but scales {len(scales)}")
    fp8_max = fp8_kernels.fp8_max(fp8_torch_dtype(fp8_dtype))
    total = sum(h.shape[1] for h in amax_histories)
    if amax_reduction_buffer is not None and amax_reduction_buffer.numel() != total:
        raise ValueError(f"amax_reduction_buffer has {amax_reduction_buffer.numel()} elements, the histories "
                         f"{total} columns")
    offset = 0
    for history, scale in zip(amax_histories, scales):
        n = history.shape[1]
        if amax_reduction_buffer is not None:
            reduced = amax_reduction_buffer.reshape(-1)[offset:offset + n]
            history[0].copy_(torch.where(reduced != 0, reduced, history[0]))
        offset += n
        fp8_kernels.delayed_scaling_update(history, scale, torch.empty_like(scale), fp8_max, margin,
                                           amax_compute_algo)


__all__ = ["DType", "FP8BwdTensors", "FP8FwdTensors", "FP8TensorMeta", "Float8BlockScaleTensorFormat", "dequantize",
           "fused_amax_and_scale_update_after_reduction", "multi_tensor_compute_scale_and_scale_inv",
           "multi_tensor_l2norm", "multi_tensor_scale", "multi_tensor_unscale_l2norm", "quantize"]
