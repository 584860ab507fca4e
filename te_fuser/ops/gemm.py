"""The GEMMs of the linear op.

High precision: torch.mm / addmm in the parameters' dtype.

FP8: every GEMM is `a @ b.T` with both operands row-major FP8 and their
per-tensor scale_inv, which is the layout cuBLASLt's FP8 GEMM wants (TN):
    forward  y  = x  @ W.T      a = x data,     b = W data
    dgrad    dx = dy @ W        a = dy data,    b = W transposed data
    wgrad    dW = dy.T @ x      a = dy transposed data, b = x transposed data
The transposed data come from cast-transpose, so no GEMM needs a transpose pass.
On CUDA it runs torch._scaled_mm; on the CPU te_fuser's own FP8 GEMM
(te_fuser.kernels.gemm: exact bf16 decode, AMX/AVX512-BF16/AVX2/C with float32
accumulation, scale and bias in a float32 epilogue), with the same semantics.

FP8 GEMMs need every dimension divisible by 16 (the tensor cores' FP8 tile):
check_fp8_gemm_dims raises a ValueError naming the offending dimension.
"""

from typing import Optional

import torch

from ..kernels import fp8 as fp8_kernels
from ..kernels import gemm as gemm_kernels

FP8_GEMM_ALIGNMENT = 16


def check_fp8_gemm_dims(**dims: int) -> None:
    for name, value in dims.items():
        if value % FP8_GEMM_ALIGNMENT:
            raise ValueError(
                f"te_fuser FP8 GEMM: {name} = {value} is not divisible by {FP8_GEMM_ALIGNMENT}; FP8 GEMMs need "
                f"every dimension to be a multiple of {FP8_GEMM_ALIGNMENT} (pad it, or run this layer outside "
                "fp8_autocast)"
            )


def fp8_gemm_nt(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(a * a_scale_inv) @ (b * b_scale_inv).T for row-major FP8 matrices a (M, K) and b (N, K)."""
    both_e5m2 = a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2
    if a.is_cuda and not both_e5m2:  # cuBLASLt has no E5M2 x E5M2 GEMM
        fused_bias = bias if out_dtype != torch.float32 else None
        out = torch._scaled_mm(a, b.t(), scale_a=a_scale_inv, scale_b=b_scale_inv, bias=fused_bias,
                               out_dtype=out_dtype)
        return out if bias is None or fused_bias is not None else out + bias
    if a.is_cuda:  # E5M2 x E5M2 on CUDA: dequantize, then a float32 GEMM
        out = torch.mm(fp8_kernels.dequantize(a, a_scale_inv), fp8_kernels.dequantize(b, b_scale_inv).t())
        if bias is not None:
            out += bias.float()
        return out if out_dtype == torch.float32 else out.to(out_dtype)
    return gemm_kernels.fp8_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias)


def gemm_nt(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a @ b.T (+ bias) in the operands' dtype."""
    return torch.addmm(bias, a, b.t()) if bias is not None else torch.mm(a, b.t())
