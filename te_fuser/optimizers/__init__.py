"""TE's `pytorch.optimizers`: the multi-tensor applier. TE's FusedAdam and FusedSGD are not provided yet."""

from .multi_tensor_apply import MultiTensorApply, multi_tensor_applier

__all__ = ["MultiTensorApply", "multi_tensor_applier"]
