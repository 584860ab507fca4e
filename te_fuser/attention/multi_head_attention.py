"""TE 2.6's `attention.multi_head_attention`: te_fuser's MultiheadAttention (te_fuser/module/multi_head_attention.py,
where it sits with the other modules whose linear layers it composes)."""

from ..module.multi_head_attention import MultiheadAttention

__all__ = ["MultiheadAttention"]
