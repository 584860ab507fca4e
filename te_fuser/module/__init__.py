"""Drop-in replacements for TransformerEngine's PyTorch modules."""

from .grouped_linear import GroupedLinear
from .linear import Linear

__all__ = ["GroupedLinear", "Linear"]
