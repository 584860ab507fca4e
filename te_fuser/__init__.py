"""te_fuser: FP8 layers, fused attention and an op fuser that free memory as soon as it is dead."""

from . import _extension  # noqa: F401  (loads the kernels)
from . import distributed, export, fp8, graph, jit, memory, ops, quantization, recipe, tensor, utils
from .attention import DotProductAttention, InferenceParams, MultiheadAttention, RotaryPositionEmbedding
from .cpu_offload import get_cpu_offload_context
from .cross_entropy import parallel_cross_entropy
from .distributed import CudaRNGStatesTracker
from .export import onnx_export
from .graph import make_graphed_callables
from .quantization import (FP8GlobalState, FP8GlobalStateManager, autocast, checkpoint, fp8_autocast, fp8_model_init,
                           quantized_model_init)
from .tensor.utils import cast_master_weights_to_fp8
from .permutation import (moe_permute, moe_permute_with_probs, moe_sort_chunks_by_index,
                          moe_sort_chunks_by_index_with_probs, moe_unpermute)
from .module import Fp8Padding, Fp8Unpadding, GroupedLinear, LayerNorm, LayerNormLinear, LayerNormMLP, Linear, RMSNorm
from .transformer import TransformerLayer
from .tensor import (Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor, QuantizedTensor, prepare_for_saving,
                     restore_from_saved)

__version__ = "0.1.0"

__all__ = [
    "CudaRNGStatesTracker",
    "DotProductAttention",
    "Float8CurrentScalingQuantizer",
    "Float8Quantizer",
    "Float8Tensor",
    "Fp8Padding",
    "Fp8Unpadding",
    "FP8GlobalState",
    "FP8GlobalStateManager",
    "GroupedLinear",
    "InferenceParams",
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "make_graphed_callables",
    "MultiheadAttention",
    "QuantizedTensor",
    "autocast",
    "cast_master_weights_to_fp8",
    "checkpoint",
    "distributed",
    "export",
    "fp8",
    "fp8_autocast",
    "fp8_model_init",
    "get_cpu_offload_context",
    "graph",
    "memory",
    "moe_permute",
    "moe_permute_with_probs",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
    "moe_unpermute",
    "onnx_export",
    "ops",
    "parallel_cross_entropy",
    "prepare_for_saving",
    "quantized_model_init",
    "recipe",
    "restore_from_saved",
    "RMSNorm",
    "RotaryPositionEmbedding",
    "TransformerLayer",
    "tensor",
]
