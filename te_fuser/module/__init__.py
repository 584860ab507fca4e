"""Drop-in replacements for TransformerEngine's PyTorch modules."""

from .grouped_linear import GroupedLinear
from .linear import Linear
from .multi_head_attention import MultiheadAttention

__all__ = ["GroupedLinear", "Linear", "MultiheadAttention"]
