"""Quantized tensor types and their quantizers (TransformerEngine's `pytorch.tensor` package)."""

from .float8_blockwise_tensor import Float8BlockQuantizer, Float8BlockwiseQTensor
from .float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor
from .mxfp8_tensor import MXFP8Quantizer, MXFP8Tensor
from .nvfp4_tensor import NVFP4Quantizer, NVFP4Tensor
from .quantized_tensor import QuantizedTensor, Quantizer, prepare_for_saving, restore_from_saved

__all__ = ["Float8BlockQuantizer", "Float8BlockwiseQTensor", "Float8CurrentScalingQuantizer", "Float8Quantizer",
           "Float8Tensor", "MXFP8Quantizer", "MXFP8Tensor", "NVFP4Quantizer", "NVFP4Tensor", "QuantizedTensor",
           "Quantizer", "prepare_for_saving", "restore_from_saved"]
