"""What te_fuser provides of `transformer_engine_torch`, TransformerEngine's compiled module (which TE
code imports as `tex`); te_fuser.compat's alias resolves that name to this module.

Only what te_fuser honours with its own kernels is here; any other name of TE's module (its GEMMs,
userbuffers, multi-tensor kernels, ...) raises an AttributeError under the alias that names it.
"""

import enum
from typing import Optional

import torch

from .kernels.validate import FLOAT_DTYPES
from .te_dtype import TORCH_DTYPE, DType
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


__all__ = ["DType", "FP8BwdTensors", "FP8FwdTensors", "FP8TensorMeta", "dequantize", "quantize"]
