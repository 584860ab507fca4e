"""L2Normalization: each vector along the last dimension scaled to unit L2 norm (QK normalization)."""

from typing import Optional

import torch

from .._fp8_io import high_precision
from ..op import BasicOperation


class L2Normalization(BasicOperation):
    """y = x * rsqrt(sum(x^2) + eps) over the last dimension; no parameters.

    seq_length and micro_batch_size are TE's keywords for warming up its JIT kernels; te_fuser has
    none to warm up, so they are checked and otherwise unused. Computed in float32 at least; the
    backward keeps x and the (rows, 1) reciprocal norms r: dx = r * dy - x * r^3 * sum(dy * x).
    """

    def __init__(self, *, eps: float = 1e-6, seq_length: Optional[int] = None,
                 micro_batch_size: Optional[int] = None):
        super().__init__()
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"eps must be a non-negative number, got {eps!r}")
        for name, value in (("seq_length", seq_length), ("micro_batch_size", micro_batch_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        self.eps = float(eps)

    @staticmethod
    def _compute_dtype(x: torch.Tensor) -> torch.dtype:
        return torch.promote_types(x.dtype, torch.float32)

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer):
        del prev_op_grad_output_quantizer, next_op_input_quantizer
        x = high_precision(input_)
        xc = x.to(self._compute_dtype(x))
        rsqrt_norm = torch.rsqrt(xc.square().sum(-1, keepdim=True) + self.eps)
        if ctx.input_requires_grad:
            ctx.save_for_backward(x, rsqrt_norm)
        return (xc * rsqrt_norm).to(x.dtype)

    def op_backward(self, ctx, grad_output):
        x, r = ctx.saved_tensors
        xc = x.to(r.dtype)
        dy = high_precision(grad_output).to(r.dtype)
        dx = r * dy - xc * (r.pow(3) * (dy * xc).sum(-1, keepdim=True))
        return dx.to(x.dtype), ()

    def onnx_forward(self, input_):
        xc = input_.to(self._compute_dtype(input_))
        return (xc * torch.rsqrt(xc.square().sum(-1, keepdim=True) + self.eps)).to(input_.dtype), ()
