"""TE's `pytorch.cpp_extensions`, as far as te_fuser provides it: the fused-attention backend names
(fused_attn.py) and the GEMM entry points (gemm.py)."""

from .fused_attn import FusedAttnBackend, NVTE_Fused_Attn_Backend, fused_attn_bwd, fused_attn_fwd
from .gemm import general_gemm, general_grouped_gemm

__all__ = ["FusedAttnBackend", "NVTE_Fused_Attn_Backend", "fused_attn_bwd", "fused_attn_fwd", "general_gemm",
           "general_grouped_gemm"]
