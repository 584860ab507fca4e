"""TE 2.6's `attention.dot_product_attention` package: the module (dot_product_attention.py), the shared
record of the last backend choice (_attention_backends) and TE's introspection (utils.py)."""

from .dot_product_attention import DotProductAttention, _attention_backends

__all__ = ["DotProductAttention", "_attention_backends"]
