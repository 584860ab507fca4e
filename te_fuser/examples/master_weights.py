"""float32 master weights for a model whose linear weights are FP8 (te_fuser.quantized_model_init).

The optimizer steps the masters; after each step `cast_back()` writes them into the model through
te_fuser.tensor.utils.cast_master_weights_to_fp8 (FP8 weights are requantized by their quantizers,
the other parameters are copied into).
"""

from typing import List

import torch

from te_fuser.tensor.float8_tensor import Float8Tensor
from te_fuser.tensor.utils import cast_master_weights_to_fp8


class MasterWeights:
    """One float32 master per model parameter, made from the FP8 weights' preserved initial values
    (quantized_model_init(preserve_high_precision_init_val=True)) when they exist, else from the values."""

    def __init__(self, model: torch.nn.Module):
        self.params: List[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
        self.masters: List[torch.Tensor] = []
        for p in self.params:
            init = p.get_high_precision_init_val() if hasattr(p, "get_high_precision_init_val") else None
            source = init if init is not None else (p.dequantize() if isinstance(p, Float8Tensor) else p.detach())
            self.masters.append(source.to(device=p.device, dtype=torch.float32, copy=True))
            if init is not None:
                p.clear_high_precision_init_val()  # the master holds them now

    def grads_from_model(self) -> None:
        """Each master's grad: its parameter's gradient in float32 (None stays None); frees the model's."""
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.detach().to(torch.float32)
            p.grad = None

    def cast_back(self) -> None:
        cast_master_weights_to_fp8(self.params, self.masters)
