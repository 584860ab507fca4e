"""Drop-in replacements for TransformerEngine's PyTorch modules."""

from .fp8_padding import Fp8Padding
from .fp8_unpadding import Fp8Unpadding
from .grouped_linear import GroupedLinear
from .layernorm import LayerNorm
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .rmsnorm import RMSNorm

__all__ = ["Fp8Padding", "Fp8Unpadding", "GroupedLinear", "LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear",
           "RMSNorm"]
