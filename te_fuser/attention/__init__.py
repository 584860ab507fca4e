"""Fused attention: te_fuser.DotProductAttention and its autograd Function."""

from .dot_product_attention import DotProductAttention
from .function import FusedAttentionFunction
from .inference import InferenceParams
from .rope import RotaryPositionEmbedding

__all__ = ["DotProductAttention", "FusedAttentionFunction", "InferenceParams", "RotaryPositionEmbedding"]
