"""Fused operations: stateless, several basic ops in one step."""

from .activation_bias_grad import ActivationBiasGrad
from .backward_linear_add import BackwardLinearAdd
from .forward_linear_bias_add import ForwardLinearBiasAdd
from .linear_bias_activation import LinearBiasActivation

# TE's names of the two fusions te_fuser names after what they compute.
BackwardBiasActivation = ActivationBiasGrad
ForwardLinearBiasActivation = LinearBiasActivation
