"""TE's `pytorch.transformer` module path: TransformerLayer (te_fuser.module.transformer_layer)."""

from .module.transformer_layer import TransformerLayer

__all__ = ["TransformerLayer"]
