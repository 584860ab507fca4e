"""Fp8Unpadding: TransformerEngine's removal of the rows Fp8Padding added to a grouped GEMM's output."""

from typing import List, Optional

import torch

from ..quantization import FP8GlobalStateManager, get_align_size_for_quantization
from .fp8_padding import check_alignment_args, pad_rows, rows_of, splits_and_padded, unpad_rows


class _UnpadRows(torch.autograd.Function):
    """Forward keeps the first m rows of each padded row group; backward pads the gradient with zero rows.
    Saves no tensor."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, splits: List[int], padded: List[int]) -> torch.Tensor:
        ctx.splits, ctx.padded = splits, padded
        return unpad_rows(x, splits, padded)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return pad_rows(grad_output, ctx.splits, ctx.padded), None, None


class Fp8Unpadding(torch.nn.Module):
    """Undoes Fp8Padding on a grouped GEMM's output: given the unpadded m_splits, each row group, padded up
    to a multiple of align_size, loses its padding rows.

    align_size: None takes it from the FP8 recipe at the first forward (get_align_size_for_quantization).
    forward(inp, m_splits) returns the (sum(m_splits), features) output; the input itself when no group was
    padded. The backward pads the gradient back with zero rows.
    """

    def __init__(self, num_gemms: int, align_size: Optional[int] = None) -> None:
        super().__init__()
        check_alignment_args(num_gemms, align_size)
        self.num_gemms = num_gemms
        self.align_size = align_size

    def forward(self, inp: torch.Tensor, m_splits: List[int]) -> torch.Tensor:
        if self.align_size is None:
            self.align_size = get_align_size_for_quantization(FP8GlobalStateManager.get_fp8_recipe())
        splits, padded = splits_and_padded(m_splits, self.num_gemms, self.align_size)
        matrix = rows_of(inp, sum(padded), "the padded m_splits")
        if splits == padded:
            return inp
        return _UnpadRows.apply(matrix, splits, padded)


__all__ = ["Fp8Unpadding"]
