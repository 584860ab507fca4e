"""Attention: te_fuser.DotProductAttention and its autograd Function, MultiheadAttention, RoPE, the KV cache."""

from .dot_product_attention import DotProductAttention
from .function import FusedAttentionFunction
from .inference import InferenceParams
from .multi_head_attention import MultiheadAttention
from .rope import RotaryPositionEmbedding

__all__ = ["DotProductAttention", "FusedAttentionFunction", "InferenceParams", "MultiheadAttention",
           "RotaryPositionEmbedding"]
