"""ONNX export, with TransformerEngine's names (transformer_engine.pytorch.export).

    from te_fuser.export import onnx_export, te_translation_table

    model(x)                                   # a forward under the recipe first (its FP8 scales)
    with torch.inference_mode(), te_fuser.fp8_autocast(enabled=fp8, fp8_recipe=recipe), onnx_export(True):
        torch.onnx.export(model, (x,), "model.onnx", dynamo=True,
                          custom_translation_table=te_translation_table)

Inside onnx_export(True) te_fuser's modules run an inference forward of torch operators that torch.onnx
translates, with FP8 as quantize / dequantize pairs (TensorRT's operators, te_fuser/onnx_extensions.py):
DelayedScaling (the scales of the last forward, fixed in the graph), Float8CurrentScaling (the scale
computed in the graph) and MXFP8BlockScaling. Float8BlockScaling and NVFP4BlockScaling have no ONNX form and
raise NotImplementedError, as do tensor parallelism and the KV cache. The forward is an inference one:
dropout off, no tensor saved for backward. te_translation_table needs onnxscript, the package torch.onnx's
exporter itself needs.
"""

import contextlib
from typing import Iterator

_state = {"enabled": False}


@contextlib.contextmanager
def onnx_export(enabled: bool = False) -> Iterator[None]:
    """Run te_fuser's modules in their ONNX-exportable form while the context is active (when enabled)."""
    previous = _state["enabled"]
    _state["enabled"] = bool(enabled)
    try:
        yield
    finally:
        _state["enabled"] = previous


def is_in_onnx_export_mode() -> bool:
    """Whether an onnx_export(True) context is active."""
    return _state["enabled"]


def __getattr__(name: str):
    if name == "te_translation_table":
        from .onnx_extensions import translation_table  # pylint: disable=import-outside-toplevel

        return translation_table()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
