"""Fused attention: te_fuser.DotProductAttention and its autograd Function."""

from .dot_product_attention import DotProductAttention
from .function import FusedAttentionFunction

__all__ = ["DotProductAttention", "FusedAttentionFunction"]
