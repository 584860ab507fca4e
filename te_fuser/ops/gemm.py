"""The GEMMs of the linear op.

High precision: torch.mm / addmm in the parameters' dtype, except bf16 and fp16 on a CPU without a
bf16 dot-product instruction (te_fuser.kernels.cpu tier below avx512_bf16, e.g. AVX2-only x86): torch
has no fast 16-bit GEMM there (its bf16 GEMMs ran at 0.2 to 9 GFLOP/s on an AVX2 Zen 1, against 15
to 35 for float32, depending on the operands' layout), so the operands are widened to float32 (exact),
multiplied by torch's float32 GEMM and the result rounded once to the output dtype. That is the
arithmetic of torch's own 16-bit CPU GEMM (exact products, float32 sums, one rounding); only the
order of the float32 sums may differ. The float32 copies are transient (freed when the GEMM returns)
but raise a step's peak; WIDEN_16BIT_ON_CPU = False keeps torch's 16-bit GEMMs.

FP8: every GEMM is `a @ b.T` with both operands row-major FP8 and their
per-tensor scale_inv, which is the layout cuBLASLt's FP8 GEMM wants (TN):
    forward  y  = x  @ W.T      a = x data,     b = W data
    dgrad    dx = dy @ W        a = dy data,    b = W transposed data
    wgrad    dW = dy.T @ x      a = dy transposed data, b = x transposed data
The transposed data come from cast-transpose, so no GEMM needs a transpose pass.
On CUDA it runs torch._scaled_mm (cuBLASLt): bias and output dtype in its epilogue, and TE's
accumulation modes: fast accumulation (use_fast_accum=True, Hopper's tensor cores keep fewer
accumulator bits between K chunks) in the forward GEMM, a full float32 accumulator for dgrad and
wgrad, whose sums run over the whole batch (TE's use_split_accumulator). On the CPU te_fuser's own
FP8 GEMM (te_fuser.kernels.gemm: exact bf16 decode, AMX/AVX512-BF16/AVX2/C with float32
accumulation, scale and bias in a float32 epilogue), with the same semantics; fast_accum changes
nothing there.

FP8 GEMMs need every dimension divisible by 16 (the tensor cores' FP8 tile):
check_fp8_gemm_dims raises a ValueError naming the offending dimension.
"""

from typing import Optional

import torch

from ..kernels import cpu
from ..kernels import fp8 as fp8_kernels
from ..kernels import gemm as gemm_kernels
from ..tensor.quantized_tensor import QuantizedTensor

FP8_GEMM_ALIGNMENT = 16


def check_fp8_gemm_dims(**dims: int) -> None:
    for name, value in dims.items():
        if value % FP8_GEMM_ALIGNMENT:
            raise ValueError(
                f"te_fuser FP8 GEMM: {name} = {value} is not divisible by {FP8_GEMM_ALIGNMENT}; FP8 GEMMs need "
                f"every dimension to be a multiple of {FP8_GEMM_ALIGNMENT} (pad it, or run this layer outside "
                "fp8_autocast)"
            )


def runs_on_cublaslt(a: torch.Tensor) -> bool:
    """Whether fp8_gemm_nt hands operands like a to torch._scaled_mm."""
    return a.is_cuda


def fp8_gemm_nt(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None, *,
                fast_accum: bool = False) -> torch.Tensor:
    """(a * a_scale_inv) @ (b * b_scale_inv).T for row-major FP8 matrices a (M, K) and b (N, K).

    fast_accum: cuBLASLt's fast FP8 accumulation (the forward GEMM's mode; see the module docstring)."""
    both_e5m2 = a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2
    if runs_on_cublaslt(a) and not both_e5m2:  # cuBLASLt has no E5M2 x E5M2 GEMM
        fused_bias = bias if out_dtype != torch.float32 else None
        out = torch._scaled_mm(a, b.t(), scale_a=a_scale_inv, scale_b=b_scale_inv, bias=fused_bias,
                               out_dtype=out_dtype, use_fast_accum=fast_accum)
        return out if bias is None or fused_bias is not None else out + bias
    if a.is_cuda:  # E5M2 x E5M2 on CUDA: dequantize, then a float32 GEMM
        out = torch.mm(fp8_kernels.dequantize(a, a_scale_inv), fp8_kernels.dequantize(b, b_scale_inv).t())
        if bias is not None:
            out += bias.float()
        return out if out_dtype == torch.float32 else out.to(out_dtype)
    return gemm_kernels.fp8_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias)


WIDEN_16BIT_ON_CPU = True
_WIDENED_DTYPES = (torch.bfloat16, torch.float16)
_TIERS_WITHOUT_BF16_DOT = frozenset(cpu.TIERS[: cpu.TIERS.index("avx512_bf16")])


def widens_to_float32(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether mm() computes a @ b in float32: 16-bit CPU operands (a quantized one, e.g. an FP8 weight
    outside fp8_autocast, is widened from its exact dequantized values), on a CPU without bf16 dot products."""
    return (WIDEN_16BIT_ON_CPU and cpu.current_isa() in _TIERS_WITHOUT_BF16_DOT and a.dtype in _WIDENED_DTYPES
            and b.dtype == a.dtype and a.is_cpu)


def mm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None,
       out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """a @ b (+ bias) for 2-D a and b of one dtype (either may be a transposed view), in out_dtype
    (default: the operands' dtype). See the module docstring for when the GEMM runs in float32."""
    out_dtype = a.dtype if out_dtype is None else out_dtype
    # A float32 result of 16-bit operands comes from a float32 GEMM too: torch's 16-bit GEMM would round it to
    # 16 bits first (CPUs have no 16-bit GEMM with a float32 output in torch).
    if widens_to_float32(a, b) or (out_dtype == torch.float32 and a.dtype in _WIDENED_DTYPES):
        a, b = (t.dequantize().float() if isinstance(t, QuantizedTensor) else t.float() for t in (a, b))
        bias = None if bias is None else bias.float()
    out = torch.addmm(bias, a, b) if bias is not None else torch.mm(a, b)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def gemm_nt(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a @ b.T (+ bias) in the operands' dtype."""
    return mm(a, b.t(), bias)
