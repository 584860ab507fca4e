"""Drop-in replacements for TransformerEngine's PyTorch modules."""

from .grouped_linear import GroupedLinear
from .layernorm import LayerNorm
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .rmsnorm import RMSNorm

__all__ = ["GroupedLinear", "LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear", "RMSNorm"]
