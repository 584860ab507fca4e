"""The op fuser's forward under te_fuser.export.onnx_export(True): each basic op's onnx_forward in turn.

An op's onnx_forward(x, *extra_inputs, **kwargs) returns (output, extra outputs): torch operators that
torch.onnx translates, computing in float32 and returning the chain's dtype, and FP8 as the quantize /
dequantize pairs of te_fuser/onnx_extensions.py with the op's own quantizers (their scales now, nothing
recorded). Nothing is fused and nothing is saved for backward.
"""

from typing import Sequence

import torch

from ..kernels.fp8 import fp8_max
from ..onnx_extensions import onnx_fp8_dequantize, onnx_fp8_quantize, onnx_mxfp8_dequantize, onnx_mxfp8_quantize
from ..quantization import FP8GlobalState, canonical_recipe
from ..recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling
from ..tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer
from ..tensor.mxfp8_tensor import MXFP8Quantizer
from ..tensor.quantized_tensor import QuantizedTensor

_EXPORTABLE_RECIPES = (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling)


def check_exportable_recipe(recipe) -> None:
    if not isinstance(recipe, _EXPORTABLE_RECIPES):
        raise NotImplementedError(
            f"ONNX export supports the DelayedScaling, Float8CurrentScaling and MXFP8BlockScaling recipes; "
            f"{type(recipe).__name__} has no ONNX form")


def run_chain(basic_ops: Sequence, x: torch.Tensor, kwargs_list: Sequence[dict], extra_inputs: Sequence[torch.Tensor]):
    """The chain's output (with its extra outputs after it, as the fuser returns them)."""
    fp8 = FP8GlobalState.is_enabled()
    recipe = canonical_recipe(FP8GlobalState.get_recipe()) if fp8 else None
    if fp8:
        check_exportable_recipe(recipe)
    for op in basic_ops:
        if fp8 or op.fp8_enabled:
            op.setup_fp8(fp8, recipe, FP8GlobalState.get_group(), x.device)
    extras_in, extras_out = iter(extra_inputs), []
    for op, kwargs in zip(basic_ops, kwargs_list):
        x, outs = op.onnx_forward(x, *[next(extras_in) for _ in range(op.num_extra_inputs)], **kwargs)
        extras_out.extend(outs)
    return (x, *extras_out) if extras_out else x


def float32(x: torch.Tensor) -> torch.Tensor:
    if isinstance(x, QuantizedTensor):
        raise NotImplementedError("ONNX export takes high-precision tensors; got a quantized tensor "
                                  f"({type(x).__name__}): export a model without quantized_model_init weights")
    return x.float()


def quantize_dequantize(x: torch.Tensor, quantizer) -> torch.Tensor:
    """float32 values of x (float32) after the quantizer's cast, as a quantize / dequantize pair."""
    if isinstance(quantizer, MXFP8Quantizer):
        if quantizer.dtype != torch.float8_e4m3fn:
            raise NotImplementedError("ONNX export of MXFP8 takes E4M3 (TensorRT's MXFP8 operators)")
        return onnx_mxfp8_dequantize(*onnx_mxfp8_quantize(x))
    if quantizer.fp8_dtype != torch.float8_e4m3fn:
        raise NotImplementedError("ONNX export quantizes the forward in E4M3 (TensorRT's FP8 operators); "
                                  f"this recipe's forward format is {quantizer.fp8_dtype}")
    if isinstance(quantizer, Float8Quantizer):
        scale_inv = torch.reciprocal(quantizer.scaling()[0].detach().clone())
    elif isinstance(quantizer, Float8CurrentScalingQuantizer):
        scale_inv = _current_scale_inv(x, quantizer)
    else:
        raise NotImplementedError(f"ONNX export has no form for {type(quantizer).__name__}")
    return onnx_fp8_dequantize(onnx_fp8_quantize(x, scale_inv), scale_inv)


def _current_scale_inv(x: torch.Tensor, quantizer: Float8CurrentScalingQuantizer) -> torch.Tensor:
    """1 / scale of current scaling, computed in the graph: scale = fp8_max / max(amax, epsilon) (a power of
    two below it with force_pow_2_scales), 1 when that is not a positive finite number."""
    amax = torch.maximum(x.abs().max().reshape(1), torch.full((1,), quantizer.amax_epsilon, device=x.device))
    scale = fp8_max(quantizer.fp8_dtype) / amax
    if quantizer.force_pow_2_scales:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    scale = torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.ones_like(scale))
    return torch.reciprocal(scale)
