"""te_fuser.LayerNorm: TransformerEngine's LayerNorm module (parameters weight and bias)."""

from typing import Optional

import torch

from ..ops.basic.norm import LayerNorm as LayerNormOp
from ._norm_module import NormModule, _shape


class LayerNorm(NormModule):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dimension
    (weight + 1 with zero_centered_gamma), with TransformerEngine's constructor."""

    def __init__(self, normalized_shape=None, eps: float = 1e-5, sequence_parallel: Optional[bool] = None,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 device=None, dtype: Optional[torch.dtype] = None, sm_margin=0,
                 hidden_size: Optional[int] = None):
        shape = _shape(normalized_shape, hidden_size, "LayerNorm")
        super().__init__(LayerNormOp, "LayerNorm", shape, eps, sequence_parallel, params_dtype,
                         zero_centered_gamma, device, dtype, sm_margin)
