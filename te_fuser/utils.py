"""TransformerEngine's `pytorch.utils` names that client code calls: SplitAlongDim,
is_non_tn_fp8_gemm_supported."""

from typing import Sequence, Union

import torch

from .tensor.float8_tensor import Float8Tensor


def is_non_tn_fp8_gemm_supported() -> bool:
    """Whether FP8 GEMMs take their operands in any layout (TE: Blackwell's). te_fuser's FP8 GEMMs (its C
    GEMM, torch._scaled_mm) take the "TN" layout only, so a Float8Tensor carries its transposed bytes for
    the gradient GEMMs: False on every device."""
    return False


def _sizes(length: int, split_size_or_sections: Union[int, Sequence[int]]) -> list:
    if isinstance(split_size_or_sections, int):
        if split_size_or_sections <= 0:
            raise ValueError(f"split_size_or_sections must be positive, got {split_size_or_sections}")
        full, rest = divmod(length, split_size_or_sections)
        return [split_size_or_sections] * full + ([rest] if rest else [])
    sizes = [int(s) for s in split_size_or_sections]
    if sum(sizes) != length or any(s < 0 for s in sizes):
        raise ValueError(f"split_size_or_sections {sizes} must be non-negative and sum to the dim's size {length}")
    return sizes


class SplitAlongDim(torch.autograd.Function):
    """torch.split along any dim that keeps a Float8Tensor in FP8 (TE's name and arguments).

    A Float8Tensor's parts are Float8Tensors viewing its bytes, with its scale (Float8Tensor's own
    split dequantizes along dims other than 0; the fused QKV projection's FP8 output is split along
    the head dims). A plain tensor is split as torch.split does. The backward concatenates the
    parts' gradients (zeros for parts without one). Saves nothing for backward.
    """

    @staticmethod
    def forward(ctx, mixed_x_layer: torch.Tensor, split_dim: int, split_size_or_sections):
        dim = split_dim % mixed_x_layer.dim()
        sizes = _sizes(mixed_x_layer.shape[dim], split_size_or_sections)
        ctx.dim, ctx.sizes = dim, sizes
        if isinstance(mixed_x_layer, Float8Tensor):
            t = mixed_x_layer._live()
            return tuple(Float8Tensor(part, t._scale_inv, t.fp8_dtype, t.dtype)
                         for part in t._data.split(sizes, dim))
        return mixed_x_layer.split(sizes, dim)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        parts = []
        for grad in grads:
            parts.append(grad.dequantize() if isinstance(grad, Float8Tensor) else grad)
        like = next(g for g in parts if g is not None)
        for i, size in enumerate(ctx.sizes):
            if parts[i] is None:
                shape = list(like.shape)
                shape[ctx.dim] = size
                parts[i] = like.new_zeros(shape)
        return torch.cat(parts, dim=ctx.dim), None, None
