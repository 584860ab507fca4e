"""Concatenation of split parameters that share one storage, without a copy."""

from typing import Sequence

import torch


class _NoopCat(torch.autograd.Function):
    """Views the adjacent slices of one storage as a single tensor; backward splits the gradient."""

    @staticmethod
    def forward(ctx, full_shape, *tensors):
        ctx.sizes = [t.shape[0] for t in tensors]
        first = tensors[0]
        out = first.new_empty(0)
        out.set_(first.untyped_storage(), first.storage_offset(), full_shape, first.stride())
        out.activation_offloading = False  # the parameters' own bytes: CPU offload leaves them on the device
        return out

    @staticmethod
    def backward(ctx, grad):
        return (None, *grad.split(ctx.sizes, dim=0))


def adjacent_in_one_storage(tensors: Sequence[torch.Tensor]) -> bool:
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != offset or t.shape[1:] != first.shape[1:]):
            return False
        offset += t.numel()
    return True


def noop_cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """torch.cat(tensors, dim=0), as a view when the tensors are adjacent in one storage."""
    if len(tensors) == 1:
        return tensors[0]
    # Under torch.compile the storage checks and set_() do not trace: the compiler gets the concatenation
    # (inductor folds it into its consumers; the values and gradients are the same).
    if torch.compiler.is_compiling() or not adjacent_in_one_storage(tensors):
        return torch.cat(list(tensors), dim=0)
    full_shape = (sum(t.shape[0] for t in tensors),) + tuple(tensors[0].shape[1:])
    return _NoopCat.apply(full_shape, *tensors)
