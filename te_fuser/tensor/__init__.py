"""Quantized tensor types and their quantizers (TransformerEngine's `pytorch.tensor` names)."""

from ..float8_tensor import Float8Tensor
from ..quantized_tensor import QuantizedTensor
from ..quantizer import Float8CurrentScalingQuantizer, Float8Quantizer

__all__ = ["Float8CurrentScalingQuantizer", "Float8Quantizer", "Float8Tensor", "QuantizedTensor"]
