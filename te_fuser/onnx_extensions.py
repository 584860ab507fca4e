"""The operators te_fuser's ONNX export puts in a graph, and their ONNX translations.

Under te_fuser.export.onnx_export(True) the modules run an inference forward of plain torch operators
(the basic ops' onnx_forward, te_fuser/ops/_onnx_forward.py) that torch.onnx.export translates on its own,
plus the FP8 quantize / dequantize pairs below. ONNX has no MX format and TensorRT reads FP8 through its own
operators, so those pairs become TensorRT's operators in the "trt" domain, the ones TransformerEngine exports:
  TRT_FP8QuantizeLinear(x float, scale_inv float[1]) -> uint8     E4M3 codes of x / scale_inv
  TRT_FP8DequantizeLinear(q uint8, scale_inv float[1]) -> float   q * scale_inv
  TRT_MXFP8QuantizeLinear(x float) -> (uint8 codes, uint8 E8M0 scales of each 32 values of the last dim)
  TRT_MXFP8DequantizeLinear(q uint8, scales uint8) -> float
Each operator here is a torch.library op with a CPU/CUDA kernel (te_fuser's own quantizers, so the exported
graph's values are the ones the modules compute) and a fake kernel for tracing. The translations need
onnxscript (and onnx); they are built on first use, so te_fuser imports without them.
"""

import functools
from typing import Tuple

import torch

from .kernels.fp8_block import mxfp8_scale_shape
from .tensor.float8_tensor import Float8Quantizer, Float8Tensor
from .tensor.mxfp8_tensor import MXFP8Quantizer, MXFP8Tensor

_E4M3 = torch.float8_e4m3fn


@torch.library.custom_op("te_fuser::onnx_fp8_quantize", mutates_args=())
def onnx_fp8_quantize(x: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """E4M3 codes (uint8) of x / scale_inv, saturating as te_fuser's FP8 cast does."""
    scale = torch.reciprocal(scale_inv.float().reshape(1))
    quantizer = Float8Quantizer(scale, torch.zeros(1, device=x.device), _E4M3, columnwise=False)
    return quantizer(x.float())._data  # TE's layout: the E4M3 codes as uint8


@onnx_fp8_quantize.register_fake
def _(x, scale_inv):
    del scale_inv
    return torch.empty(x.shape, dtype=torch.uint8, device=x.device)


@torch.library.custom_op("te_fuser::onnx_fp8_dequantize", mutates_args=())
def onnx_fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """float32 values of E4M3 codes q times scale_inv."""
    return Float8Tensor(q.view(_E4M3), scale_inv.float().reshape(1), _E4M3, torch.float32).dequantize()


@onnx_fp8_dequantize.register_fake
def _(q, scale_inv):
    del scale_inv
    return torch.empty(q.shape, dtype=torch.float32, device=q.device)


@torch.library.custom_op("te_fuser::onnx_mxfp8_quantize", mutates_args=())
def onnx_mxfp8_quantize(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 E4M3 codes (uint8) of x in 32-value blocks of the last dimension, and their E8M0 scales."""
    xq = MXFP8Quantizer(_E4M3, columnwise=False)(x.float())
    return xq._rowwise_data, xq._rowwise_scale_inv


@onnx_mxfp8_quantize.register_fake
def _(x):
    return (torch.empty(x.shape, dtype=torch.uint8, device=x.device),
            torch.empty(mxfp8_scale_shape(x.shape, columnwise=False), dtype=torch.uint8, device=x.device))


@torch.library.custom_op("te_fuser::onnx_mxfp8_dequantize", mutates_args=())
def onnx_mxfp8_dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values of MXFP8 E4M3 codes q with their E8M0 block scales."""
    return MXFP8Tensor(q.shape, torch.float32, rowwise_data=q, rowwise_scale_inv=scales,
                       columnwise_data=None, columnwise_scale_inv=None, fp8_dtype=_E4M3).dequantize()


@onnx_mxfp8_dequantize.register_fake
def _(q, scales):
    del scales
    return torch.empty(q.shape, dtype=torch.float32, device=q.device)


@functools.lru_cache(maxsize=None)
def translation_table() -> dict:
    """{te_fuser's export operator: its ONNX translation}, for torch.onnx.export's custom_translation_table."""
    import onnxscript  # pylint: disable=import-outside-toplevel
    from onnx import defs  # pylint: disable=import-outside-toplevel

    trt = onnxscript.values.Opset("trt", version=1)

    def trt_op(name: str, inputs, outputs):
        schema = defs.OpSchema(
            name=name, domain="trt", since_version=1, doc=f"TensorRT's {name}",
            inputs=[defs.OpSchema.FormalParameter(n, t) for n, t in inputs],
            outputs=[defs.OpSchema.FormalParameter(n, t) for n, t in outputs])
        return onnxscript.values.Op(opset=trt, name=name, op_schema=schema)

    fp8_q = trt_op("TRT_FP8QuantizeLinear", [("x", "tensor(float)"), ("scale_inv", "tensor(float)")],
                   [("q", "tensor(uint8)")])
    fp8_dq = trt_op("TRT_FP8DequantizeLinear", [("q", "tensor(uint8)"), ("scale_inv", "tensor(float)")],
                    [("y", "tensor(float)")])
    mx_q = trt_op("TRT_MXFP8QuantizeLinear", [("x", "tensor(float)")],
                  [("q", "tensor(uint8)"), ("scales", "tensor(uint8)")])
    mx_dq = trt_op("TRT_MXFP8DequantizeLinear", [("q", "tensor(uint8)"), ("scales", "tensor(uint8)")],
                   [("y", "tensor(float)")])

    from onnxscript.onnx_types import FLOAT, UINT8  # pylint: disable=import-outside-toplevel

    def fp8_quantize(x: FLOAT, scale_inv: FLOAT) -> UINT8:
        return fp8_q(x, scale_inv)

    def fp8_dequantize(q: UINT8, scale_inv: FLOAT) -> FLOAT:
        return fp8_dq(q, scale_inv)

    def mxfp8_quantize(x: FLOAT) -> Tuple[UINT8, UINT8]:
        return mx_q(x)

    def mxfp8_dequantize(q: UINT8, scales: UINT8) -> FLOAT:
        return mx_dq(q, scales)

    ops = torch.ops.te_fuser
    return {ops.onnx_fp8_quantize.default: fp8_quantize, ops.onnx_fp8_dequantize.default: fp8_dequantize,
            ops.onnx_mxfp8_quantize.default: mxfp8_quantize, ops.onnx_mxfp8_dequantize.default: mxfp8_dequantize}
