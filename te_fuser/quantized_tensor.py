"""QuantizedTensor: the base of te_fuser's quantized tensors, under TransformerEngine's name.

Client code tests `isinstance(x, QuantizedTensor)` to find quantized
parameters and activations. te_fuser's Float8Tensor derives from it. It is
not (yet) a torch.Tensor subclass, so nothing outside te_fuser's kernels
computes with it; FP8 weights (te_fuser issue 15) will make it one.
"""

from typing import Optional

import torch


class QuantizedTensor:
    """A tensor held in a quantized format; `dequantize()` gives it back in high precision."""

    __slots__ = ()

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not implement dequantize()")
