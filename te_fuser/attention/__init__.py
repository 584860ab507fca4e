"""Fused attention: te_fuser.DotProductAttention and its autograd Function."""

from .dot_product_attention import DotProductAttention
from .function import FusedAttentionFunction
from .rope import RotaryPositionEmbedding

__all__ = ["DotProductAttention", "FusedAttentionFunction", "MultiheadAttention", "RotaryPositionEmbedding"]


def __getattr__(name):
    # Imported on first use: te_fuser.module.multi_head_attention imports this package.
    if name == "MultiheadAttention":
        from .multi_head_attention import MultiheadAttention
        return MultiheadAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
