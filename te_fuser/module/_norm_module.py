"""What the LayerNorm and RMSNorm modules share: TE's constructor over a norm op run by a fuser."""

from typing import Optional

import torch

from ._linear_base import FusedModule


def _shape(normalized_shape, hidden_size, module_name: str):
    """normalized_shape, or hidden_size: TE's older name for it, which Megatron's TENorm still passes."""
    if (normalized_shape is None) == (hidden_size is None):
        raise TypeError(f"te_fuser.{module_name} takes normalized_shape or hidden_size (its older name): "
                        f"exactly one, got normalized_shape={normalized_shape!r}, hidden_size={hidden_size!r}")
    return normalized_shape if hidden_size is None else hidden_size


class NormModule(FusedModule):
    """A norm over the last dimension with parameters weight (and bias) kept on the module.

    sequence_parallel: TE's legacy flag, set as the `sequence_parallel` attribute of the
    parameters (Megatron all-reduces their gradients across the TP group when True).
    sm_margin (CUDA SMs left free for communication kernels) has no CPU meaning; only 0 is
    accepted.
    """

    def __init__(self, op_type, module_name: str, normalized_shape, eps: float, sequence_parallel,
                 params_dtype: Optional[torch.dtype], zero_centered_gamma: bool, device, dtype, sm_margin):
        super().__init__()
        if params_dtype is not None and dtype is not None:
            raise ValueError(f"te_fuser.{module_name}: give params_dtype or dtype, not both")
        if sm_margin not in (0, None) and not (isinstance(sm_margin, dict) and not any(sm_margin.values())):
            raise NotImplementedError(f"te_fuser.{module_name} does not support sm_margin (only 0)")
        if not float(eps) >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        op = op_type(normalized_shape, eps, zero_centered_gamma=zero_centered_gamma, create_params=False)
        self.normalized_shape = (op.size,)
        self.eps = op.eps
        self.zero_centered_gamma = op.zero_centered_gamma
        self.sequence_parallel = sequence_parallel
        self.params_dtype = next(d for d in (params_dtype, dtype, torch.get_default_dtype()) if d is not None)
        self._set_ops([op])
        self._build_parameters(device)

    def _create_parameters(self, device) -> None:
        op = self._ops[0]
        self.weight = torch.nn.Parameter(torch.empty(op.size, device=device, dtype=self.params_dtype))
        bias = torch.nn.Parameter(torch.empty(op.size, device=device, dtype=self.params_dtype)) if op.with_bias \
            else None
        self.register_parameter("bias", bias)

    def reset_parameters(self, defer_init: Optional[bool] = None) -> None:
        """weight = 1 (0 with zero_centered_gamma), bias = 0, materializing meta parameters first."""
        if defer_init:
            return
        self._materialize_parameters()
        self._ops[0].init_params(self.weight, self.bias)
        if self.sequence_parallel is not None:
            for param in (self.weight, self.bias):
                if param is not None:
                    param.sequence_parallel = bool(self.sequence_parallel)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # pylint: disable=redefined-builtin  (TE's name)
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
        kwargs = {"weight": self.weight}
        if self._ops[0].with_bias:
            kwargs["bias"] = self.bias
        return self._fuser(input, [kwargs])
