"""TE's `pytorch.cpp_extensions`, as far as te_fuser provides it: the fused-attention backend names
(fused_attn.py). TE's GEMM entry points (`general_gemm`, `general_grouped_gemm`) are not provided."""

from .fused_attn import FusedAttnBackend, NVTE_Fused_Attn_Backend, fused_attn_bwd, fused_attn_fwd

__all__ = ["FusedAttnBackend", "NVTE_Fused_Attn_Backend", "fused_attn_bwd", "fused_attn_fwd"]
