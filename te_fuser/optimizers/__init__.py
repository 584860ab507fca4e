"""TE's `pytorch.optimizers`: FusedAdam, FusedSGD, the multi-tensor applier and kernels."""

from ..kernels.multi_tensor import multi_tensor_l2norm, multi_tensor_scale, multi_tensor_unscale_l2norm
from .fused_adam import FusedAdam
from .fused_sgd import FusedSGD
from .multi_tensor_apply import MultiTensorApply, multi_tensor_applier

__all__ = ["FusedAdam", "FusedSGD", "MultiTensorApply", "multi_tensor_applier", "multi_tensor_l2norm",
           "multi_tensor_scale", "multi_tensor_unscale_l2norm"]
