"""TE's `pytorch.optimizers`: the multi-tensor applier and kernels. TE's FusedAdam and FusedSGD (and their
multi_tensor_adam* / multi_tensor_sgd kernels) are not provided yet."""

from ..kernels.multi_tensor import multi_tensor_l2norm, multi_tensor_scale, multi_tensor_unscale_l2norm
from .multi_tensor_apply import MultiTensorApply, multi_tensor_applier

__all__ = ["MultiTensorApply", "multi_tensor_applier", "multi_tensor_l2norm", "multi_tensor_scale",
           "multi_tensor_unscale_l2norm"]
