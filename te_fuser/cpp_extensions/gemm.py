"""TE's `cpp_extensions.general_gemm` / `general_grouped_gemm`: its GEMM entry points with cuBLAS's operand
convention, for code and tests that call them directly (te_fuser's own layers use te_fuser.ops.gemm).

layout "XY": X says whether A is transposed, Y whether B is: out = op(B) @ op(A) on row-major tensors, so "TN"
is input @ weight.T (forward), "NN" grad_output @ weight (dgrad) and "NT" grad_output.T @ input (wgrad).
Quantized operands are read as their exact values and the product is summed in float32 (torch's float32 GEMM),
then bias, GELU (forward: out = gelu(out + bias), its input returned; with grad: out *= gelu'(gelu_in)) and
accumulate (out += result, in float32) are applied, and the result is rounded once to out_dtype (or quantized by
quantization_params). use_split_accumulator and the workspace change nothing here; userbuffer overlap (ub) is not
provided.
"""

from typing import List, Optional

import torch

from ..jit import _tanh_gelu_derivative
from ..tensor.quantized_tensor import QuantizedTensor

__all__ = ["general_gemm", "general_grouped_gemm"]

LAYOUTS = ("TN", "NN", "NT")


def _values(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize(dtype=torch.float32) if isinstance(t, QuantizedTensor) else t.float()


def general_gemm(A: torch.Tensor, B: torch.Tensor, workspace: Optional[torch.Tensor] = None,
                 out_dtype: Optional[torch.dtype] = None, quantization_params=None, gelu: bool = False,
                 gelu_in: Optional[torch.Tensor] = None, accumulate: bool = False, layout: str = "TN",
                 out: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                 use_split_accumulator: bool = False, grad: bool = False, ub=None, ub_type=None,
                 extra_output: Optional[torch.Tensor] = None, bulk_overlap: bool = False):
    """(out, bias_grad, gelu_input, extra_output), TE's signature and results (see the module docstring)."""
    del workspace, use_split_accumulator, bulk_overlap
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if ub is not None or ub_type is not None:
        raise NotImplementedError("general_gemm: userbuffer overlap (ub, ub_type) is not provided by te_fuser")
    if out is not None and not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if grad and gelu and gelu_in is None:
        raise ValueError("gelu with grad=True needs gelu_in, the forward's pre-activation")
    a, b = _values(A), _values(B)
    a = a.t() if layout[0] == "T" else a
    b = b.t() if layout[1] == "T" else b
    if b.shape[-1] != a.shape[0]:
        raise ValueError(f"A {tuple(A.shape)} and B {tuple(B.shape)} do not multiply in layout {layout!r}")
    result = b @ a
    bias_grad = gelu_input = None
    if grad:
        if gelu:
            result = result * _tanh_gelu_derivative(gelu_in.float())
        if bias is not None:
            bias_grad = _values(B).sum(0).to(bias.dtype)
    else:
        if bias is not None:
            result = result + bias.float()
        if gelu:
            gelu_input = result
            result = torch.nn.functional.gelu(result, approximate="tanh")
    dtype = out.dtype if out is not None else (out_dtype or (B.dtype if B.dtype.is_floating_point else torch.float32))
    if gelu_input is not None:
        gelu_input = gelu_input.to(dtype)
    if accumulate:
        if out is None:
            raise ValueError("accumulate=True needs out, the tensor to add into")
        result = out.float() + result
    if quantization_params is not None:
        result = quantization_params(result.to(dtype))
        if out is not None:
            raise ValueError("out and quantization_params: give one of them")
        return result, bias_grad, gelu_input, extra_output
    if out is None:
        return result.to(dtype), bias_grad, gelu_input, extra_output
    out.copy_(result)
    return out, bias_grad, gelu_input, extra_output


def general_grouped_gemm(A: List[torch.Tensor], B: List[torch.Tensor], out: List[torch.Tensor],
                         out_dtype: torch.dtype, workspaces=None, layout: str = "TN",
                         m_splits: Optional[List[int]] = None, gelu: bool = False, grad: bool = False,
                         accumulate: bool = False, bias: Optional[List[torch.Tensor]] = None, use_bias: bool = False,
                         use_split_accumulator: bool = False, D_dtype=None, single_output: bool = False):
    """(out, bias or bias gradients, gelu inputs): general_gemm on each (A[i], B[i]); with single_output, out[0]
    holds the results one under the other, m_splits rows each."""
    del workspaces, D_dtype
    if len(A) != len(B):
        raise ValueError(f"A and B must be lists of the same length, got {len(A)} and {len(B)}")
    if single_output:
        if m_splits is None or len(m_splits) != len(A):
            raise ValueError("single_output needs m_splits, one row count per GEMM")
        targets = list(torch.split(out[0], list(m_splits)))
    else:
        if len(out) != len(A):
            raise ValueError(f"out must hold one tensor per GEMM ({len(A)}), got {len(out)}")
        targets = list(out)
    biases, gelu_inputs = [], []
    for i, (a, b, target) in enumerate(zip(A, B, targets)):
        chunk = torch.empty_like(target) if single_output else target
        if single_output:
            chunk.copy_(target)
        result, bias_grad, gelu_input, _ = general_gemm(
            a, b, None, out_dtype, gelu=gelu, accumulate=accumulate, layout=layout, out=chunk,
            bias=bias[i] if use_bias else None, use_split_accumulator=use_split_accumulator, grad=grad)
        if single_output:
            target.copy_(result)
        biases.append(bias_grad if grad else (bias[i] if use_bias else None))
        gelu_inputs.append(gelu_input)
    return out, biases, gelu_inputs
