"""te_fuser.ops: basic and fused operations, the OperationFuser and the Sequential container."""

from ..kernels import fused as _fused_kernels  # noqa: F401  (registers the fake kernels)
from .basic.activation import GEGLU, GELU, QGEGLU, QGELU, ReGLU, ReLU, SiLU, SReGLU, SReLU, SwiGLU
from .basic.add_extra_input import AddExtraInput, AddInPlace
from .basic.bias import Bias
from .basic.collectives import AllGather, AllReduce, ReduceScatter
from .basic.constant_scale import ConstantScale
from .basic.dropout import Dropout
from .basic.extra_output import MakeExtraOutput
from .basic.grouped_linear import GroupedBasicLinear
from .basic.identity import Identity
from .basic.l2normalization import L2Normalization
from .basic.linear import BasicLinear
from .basic.norm import LayerNorm, RMSNorm
from .basic.quantize import Quantize
from .basic.reshape import Reshape
from .fused.activation_bias_grad import ActivationBiasGrad
from .fused.linear_bias_activation import LinearBiasActivation
from .fuser import OperationFuser
from .linear import Linear
from .op import BasicOperation, FusedOperation, FusibleOperation, OperationContext
from .sequential import Sequential

__all__ = [
    "ActivationBiasGrad",
    "AddExtraInput",
    "AddInPlace",
    "AllGather",
    "AllReduce",
    "BasicLinear",
    "BasicOperation",
    "Bias",
    "ConstantScale",
    "Dropout",
    "FusedOperation",
    "FusibleOperation",
    "GEGLU",
    "GELU",
    "GroupedBasicLinear",
    "Identity",
    "L2Normalization",
    "LayerNorm",
    "Linear",
    "LinearBiasActivation",
    "MakeExtraOutput",
    "OperationContext",
    "OperationFuser",
    "QGEGLU",
    "QGELU",
    "Quantize",
    "ReduceScatter",
    "ReGLU",
    "ReLU",
    "Reshape",
    "RMSNorm",
    "Sequential",
    "SiLU",
    "SReGLU",
    "SReLU",
    "SwiGLU",
]
