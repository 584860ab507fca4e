"""te_fuser: FP8 layers, fused attention and an op fuser that free memory as soon as it is dead."""

from . import _extension  # noqa: F401  (loads the kernels)
from . import memory, ops, recipe
from .attention import DotProductAttention
from .float8_tensor import Float8Tensor
from .fp8_state import autocast, checkpoint, fp8_autocast, FP8GlobalState
from .module.grouped_linear import GroupedLinear
from .module.linear import Linear
from .module.multi_head_attention import MultiheadAttention
from .quantizer import Float8CurrentScalingQuantizer, Float8Quantizer
from .saved_tensors import prepare_for_saving, restore_from_saved

__version__ = "0.1.0"

__all__ = [
    "DotProductAttention",
    "Float8CurrentScalingQuantizer",
    "Float8Quantizer",
    "Float8Tensor",
    "FP8GlobalState",
    "GroupedLinear",
    "Linear",
    "MultiheadAttention",
    "autocast",
    "checkpoint",
    "fp8_autocast",
    "memory",
    "ops",
    "prepare_for_saving",
    "recipe",
    "restore_from_saved",
]
