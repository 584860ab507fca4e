"""TE's names of its FusedAttention sub-backends, which get_attention_backend answers with
(te_fuser/attention/dot_product_attention/utils.py says which of te_fuser's backends they stand for).

TE's raw fused-attention calls, fused_attn_fwd / fused_attn_bwd (cuDNN's packed-argument interface), are
not provided: they raise NotImplementedError; DotProductAttention runs te_fuser's fused kernels.
"""

import enum


class NVTE_Fused_Attn_Backend(enum.IntEnum):  # noqa: N801 (TE's name)
    """TE's fused-attention sub-backends, with TE's values."""

    NVTE_No_Backend = -1
    NVTE_F16_max512_seqlen = 0
    NVTE_F16_arbitrary_seqlen = 1
    NVTE_FP8 = 2


FusedAttnBackend = {
    "F16_max512_seqlen": NVTE_Fused_Attn_Backend.NVTE_F16_max512_seqlen,
    "F16_arbitrary_seqlen": NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen,
    "FP8": NVTE_Fused_Attn_Backend.NVTE_FP8,
    "No_Backend": NVTE_Fused_Attn_Backend.NVTE_No_Backend,
}


def _not_provided(name: str):
    raise NotImplementedError(f"cpp_extensions.fused_attn.{name} (TE's raw cuDNN fused-attention call) is not "
                              "provided by te_fuser; use DotProductAttention, which runs te_fuser's fused kernels")


def fused_attn_fwd(*args, **kwargs):
    """Not provided: raises NotImplementedError naming it."""
    del args, kwargs
    _not_provided("fused_attn_fwd")


def fused_attn_bwd(*args, **kwargs):
    """Not provided: raises NotImplementedError naming it."""
    del args, kwargs
    _not_provided("fused_attn_bwd")


__all__ = ["FusedAttnBackend", "NVTE_Fused_Attn_Backend", "fused_attn_bwd", "fused_attn_fwd"]
