"""How ops hand FP8 tensors to each other: direct FP8 kernel outputs and the transposed data."""

from typing import Optional

import torch

from ..float8_tensor import Float8Tensor, fp8_transpose
from ..quantizer import Float8Quantizer


def direct_fp8_args(quantizer) -> Optional[tuple]:
    """(fp8_dtype, scale, amax) for a kernel to write FP8 itself, or None.

    Only delayed scaling qualifies: its scale is known before the output
    exists. A current-scaling quantizer needs the output's amax first, so the
    op writes high precision and the consumer quantizes.
    """
    if isinstance(quantizer, Float8Quantizer):
        return quantizer.fp8_dtype, quantizer.scale, quantizer.amax
    return None


def wrap_kernel_output(data: torch.Tensor, quantizer: Float8Quantizer, nominal_dtype: torch.dtype) -> Float8Tensor:
    """A Float8Tensor around FP8 codes a kernel wrote with quantizer's scale."""
    transpose = fp8_transpose(data) if quantizer.columnwise else None
    return Float8Tensor(data, torch.reciprocal(quantizer.scale), quantizer.fp8_dtype, nominal_dtype, transpose)


def with_transpose(t: Float8Tensor) -> Float8Tensor:
    """t, given its transposed data when it came without (byte transpose, no requantization)."""
    if t._transpose is None:
        t._transpose = fp8_transpose(t._data)
    return t


def high_precision(x):
    """x as a plain tensor (dequantized when it is a Float8Tensor)."""
    return x.dequantize() if isinstance(x, Float8Tensor) else x
