"""The query/key normalization of MultiheadAttention: TE 2.6's use_qk_norm and later TE's qk_norm_type."""

from typing import Optional, Tuple

import torch

from ..ops.basic.l2normalization import L2Normalization
from ..module.layernorm import LayerNorm
from ..module.rmsnorm import RMSNorm

QK_NORM_TYPES = ("L2Normalization", "RMSNorm", "LayerNorm")


def make_qk_norms(use_qk_norm: bool, qk_norm_type: Optional[str], eps: float, head_dim: int,
                  seq_length: Optional[int], micro_batch_size: Optional[int], params_dtype: torch.dtype,
                  device) -> Tuple[Optional[torch.nn.Module], Optional[torch.nn.Module]]:
    """(q_norm, k_norm) over each head's channels, or (None, None).

    use_qk_norm=True (TE 2.6) is qk_norm_type="L2Normalization". L2Normalization has no parameters, so q and k
    share one; RMSNorm and LayerNorm get one module each, with head_dim weights (later TE's layout)."""
    if use_qk_norm and qk_norm_type is not None:
        raise ValueError(f"use_qk_norm=True (TE 2.6) and qk_norm_type={qk_norm_type!r} (later TE) are two ways to ask "
                         "for the same thing: give one of them")
    if use_qk_norm:
        qk_norm_type = "L2Normalization"
    if qk_norm_type is None:
        return None, None
    if qk_norm_type == "L2Normalization":
        norm = L2Normalization(eps=eps, seq_length=seq_length, micro_batch_size=micro_batch_size)
        return norm, norm
    if qk_norm_type in ("RMSNorm", "LayerNorm"):
        cls = RMSNorm if qk_norm_type == "RMSNorm" else LayerNorm
        return tuple(cls(normalized_shape=head_dim, eps=eps, device=device, params_dtype=params_dtype)
                     for _ in range(2))
    raise ValueError(f"qk_norm_type must be None or one of {QK_NORM_TYPES}, got {qk_norm_type!r}")
