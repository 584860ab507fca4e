"""TransformerEngine's activations in float64 torch, written from their definitions
(transformer_engine/common/util/math.h), for the kernels', ops' and modules' tests."""

import torch
import torch.nn.functional as F


def relu64(t):
    """TE's relu, fmaxf(x, 0): torch's relu, except that a NaN gives 0."""
    return torch.where(t > 0, t, 0.0)


# name -> the element-wise activation ("none" is the kernels' identity).
ACTIVATIONS64 = {
    "none": lambda t: t,
    "gelu": lambda t: F.gelu(t, approximate="tanh"),
    "qgelu": lambda t: t * torch.sigmoid(1.702 * t),
    "relu": relu64,
    "srelu": lambda t: relu64(t) ** 2,
    "silu": F.silu,
}
# The gated ones -> the activation applied to the first half of the last dimension (TE's order); the
# second half multiplies it.
GATED64 = {"geglu": "gelu", "qgeglu": "qgelu", "reglu": "relu", "sreglu": "srelu", "swiglu": "silu"}
# Every activation TE's LayerNormMLP, TransformerLayer and te.ops accept.
TE_ACTIVATIONS = [name for name in ACTIVATIONS64 if name != "none"] + list(GATED64)


def activation64(h, activation):
    """The activation `activation` (element-wise or gated) of h."""
    if activation in GATED64:
        a, g = h.chunk(2, dim=-1)
        return ACTIVATIONS64[GATED64[activation]](a) * g
    return ACTIVATIONS64[activation](h)
