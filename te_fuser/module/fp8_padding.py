"""Fp8Padding: TransformerEngine's padding of a grouped GEMM's row splits to the quantization alignment."""

from typing import List, Optional, Tuple

import torch

from ..quantization import FP8GlobalStateManager, get_align_size_for_quantization


def check_alignment_args(num_gemms: int, align_size: Optional[int]) -> None:
    for name, value in (("num_gemms", num_gemms), ("align_size", align_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name} must be a positive int{' or None' if name == 'align_size' else ''}, "
                             f"got {value!r}")


def splits_and_padded(m_splits, num_gemms: int, align_size: int) -> Tuple[List[int], List[int]]:
    """m_splits as ints, and each rounded up to a multiple of align_size."""
    try:
        splits = [int(m) for m in m_splits]
    except (TypeError, ValueError):
        raise TypeError(f"m_splits must be a list of ints, got {m_splits!r}") from None
    if len(splits) != num_gemms:
        raise ValueError(f"m_splits has {len(splits)} entries, expected num_gemms = {num_gemms}")
    if any(m < 0 for m in splits):
        raise ValueError(f"m_splits must be non-negative, got {splits}")
    return splits, [-(-m // align_size) * align_size for m in splits]


def rows_of(inp: torch.Tensor, expected: int, splits_name: str) -> torch.Tensor:
    """inp as a (rows, features) matrix, checked to have `expected` rows."""
    if inp.dim() < 1:
        raise ValueError("inp must have at least one dimension (its last holds the features)")
    matrix = inp.reshape(-1, inp.shape[-1])
    if matrix.shape[0] != expected:
        raise ValueError(f"inp has {matrix.shape[0]} rows (the product of its leading dimensions), "
                         f"but {splits_name} sums to {expected}")
    return matrix


def pad_rows(x: torch.Tensor, splits: List[int], padded: List[int]) -> torch.Tensor:
    """The row groups of x (sizes `splits`), each followed by zero rows up to its size in `padded`."""
    parts = [torch.nn.functional.pad(part, (0, 0, 0, p - m)) for part, m, p in zip(x.split(splits), splits, padded)]
    return torch.cat(parts) if parts else x


def unpad_rows(x: torch.Tensor, splits: List[int], padded: List[int]) -> torch.Tensor:
    """The first `splits[i]` rows of each row group of x (sizes `padded`)."""
    parts = [part[:m] for part, m in zip(x.split(padded), splits)]
    return torch.cat(parts) if parts else x


class _PadRows(torch.autograd.Function):
    """Forward pads each row group with zeros; backward drops the padding rows' gradients. Saves no tensor."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, splits: List[int], padded: List[int]) -> torch.Tensor:
        ctx.splits, ctx.padded = splits, padded
        return pad_rows(x, splits, padded)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return unpad_rows(grad_output, ctx.splits, ctx.padded), None, None


class Fp8Padding(torch.nn.Module):
    """Pads the input of a grouped GEMM: each of its num_gemms row groups (sizes m_splits) gets zero rows
    appended up to a multiple of align_size, so every GEMM's rows can be quantized (FP8 GEMMs take rows
    in multiples of 16, MXFP8 of 32).

    align_size: None takes it from the FP8 recipe at the first forward (get_align_size_for_quantization).
    forward(inp, m_splits) returns (the padded (rows, features) input, the padded m_splits); the input
    itself when no group needs padding. The backward drops the padding rows' gradients.
    """

    def __init__(self, num_gemms: int, align_size: Optional[int] = None) -> None:
        super().__init__()
        check_alignment_args(num_gemms, align_size)
        self.num_gemms = num_gemms
        self.align_size = align_size

    def forward(self, inp: torch.Tensor, m_splits: List[int]) -> Tuple[torch.Tensor, List[int]]:
        if self.align_size is None:
            self.align_size = get_align_size_for_quantization(FP8GlobalStateManager.get_fp8_recipe())
        splits, padded = splits_and_padded(m_splits, self.num_gemms, self.align_size)
        matrix = rows_of(inp, sum(splits), "m_splits")
        if splits == padded:
            return inp, splits
        return _PadRows.apply(matrix, splits, padded), padded


__all__ = ["Fp8Padding"]
