"""Drop-in replacements for TransformerEngine's PyTorch modules."""

from .linear import Linear

__all__ = ["Linear"]
