"""torch.autocast (native AMP) in te_fuser's modules and ops, as in TransformerEngine.

Inside `torch.autocast(device_type, dtype)` a module computes in `dtype`, as TE's modules do
(their activation dtype): its input and its parameters are cast to `dtype`, and its output is
in `dtype`. Under FP8 the weights are quantized from the parameters as they are, not through
`dtype`, and the FP8 GEMMs write `dtype`. The parameters' gradients come back in the
parameters' own dtype. The kernels then run with autocast off, so torch's per-op casting
cannot change the dtypes chosen here.

Where it happens: the op fuser (every fused module: Linear, LayerNormLinear, LayerNormMLP,
GroupedLinear, LayerNorm, RMSNorm, and te_fuser.ops) casts the chain's input and hands the
dtype to the ops, which cast their parameters; DotProductAttention casts q, k and v;
TransformerLayer casts its input, so its residual stream is in `dtype` too (TE's behaviour).
"""

import contextlib
from typing import Optional

import torch

from .tensor import QuantizedTensor


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """torch.autocast's dtype on device_type while autocast is enabled there, else None (also on a device
    autocast does not know, such as meta)."""
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def cast(t: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """t in dtype (TE's cast_if_needed); t itself when dtype is None or t has it. A quantized tensor
    of another nominal dtype is dequantized to dtype (outside autograd: for the ops' parameters)."""
    if t is None or dtype is None or t.dtype == dtype:
        return t
    if isinstance(t, QuantizedTensor):
        return t.dequantize(dtype=dtype)
    return t.to(dtype)


def cast_input(t: torch.Tensor) -> torch.Tensor:
    """A module's high-precision input in the autocast dtype of its device (unchanged outside autocast,
    and when it is quantized: an FP8 input goes to the FP8 kernels as it is)."""
    if isinstance(t, QuantizedTensor):
        return t
    return cast(t, autocast_dtype(t.device.type))


def autocast_off(device_type: str, dtype: Optional[torch.dtype]):
    """Autocast disabled on device_type while a module runs its kernels in dtype (a no-op when dtype is None)."""
    return torch.autocast(device_type, enabled=False) if dtype is not None else contextlib.nullcontext()
