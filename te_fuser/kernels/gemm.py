"""The CPU FP8 GEMM: validated entry point and fake kernel of torch.ops.te_fuser.fp8_gemm.

    out = (a @ b.T) * (a_scale_inv * b_scale_inv) + bias, rounded once to out_dtype

with a (M, K) and b (N, K) row-major FP8 (E4M3/E5M2, any mix): the FP8 values are decoded exactly
to bfloat16, multiplied on the CPU's best engine (AMX, AVX512-BF16, AVX2 or plain C; see
te_fuser.kernels.cpu) with float32 accumulation, and the scale and bias are applied in float32.
These are torch._scaled_mm's semantics; only the float32 summation order differs between engines
(see csrc/gemm/fp8_gemm.h for the bound).
"""

from typing import Optional

import torch

from .validate import FP8_DTYPES, call_checked, check_contiguous, check_dtype, check_float_dtype, check_scalar_f32

_ops = torch.ops.te_fuser


def _check_operand(t, name):
    check_dtype(t, name, FP8_DTYPES)
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU for te_fuser's fp8_gemm, got {t.device}")
    check_contiguous(t, name)


def fp8_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
             out_dtype: torch.dtype = torch.float32, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(a * a_scale_inv) @ (b * b_scale_inv).T (+ bias) for row-major FP8 a (M, K) and b (N, K), on the CPU.
    The Python checks run only when the binding refuses the arguments (see fp8.quantize)."""
    return call_checked(lambda: _check_fp8_gemm_args(a, a_scale_inv, b, b_scale_inv, out_dtype, bias),
                        _ops.fp8_gemm, a, a_scale_inv, b, b_scale_inv, out_dtype, bias)


def _check_fp8_gemm_args(a, a_scale_inv, b, b_scale_inv, out_dtype, bias):
    _check_operand(a, "a")
    _check_operand(b, "b")
    if b.shape[1] != a.shape[1]:
        raise ValueError(f"b must have a.shape[1] = {a.shape[1]} columns (b is (N, K)), got shape {tuple(b.shape)}")
    check_scalar_f32(a_scale_inv, "a_scale_inv", a, "a")
    check_scalar_f32(b_scale_inv, "b_scale_inv", b, "b")
    check_float_dtype(out_dtype, "out_dtype")
    if bias is not None:
        check_dtype(bias, "bias")
        if bias.shape != (b.shape[0],):
            raise ValueError(f"bias must have shape ({b.shape[0]},) (one value per row of b), got {tuple(bias.shape)}")
        if bias.device != a.device:
            raise ValueError(f"bias is on {bias.device} but a is on {a.device}; they must be on the same device")
        check_contiguous(bias, "bias")


@torch.library.register_fake("te_fuser::fp8_gemm")
def _(a, a_scale_inv, b, b_scale_inv, out_dtype, bias=None):
    # Meta tensors reach this kernel outside tracing too; the binding takes CPU tensors only.
    if any(t is not None and t.device.type != "cpu" for t in (a, a_scale_inv, b, b_scale_inv, bias)):
        raise RuntimeError("te_fuser::fp8_gemm takes CPU tensors")
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
