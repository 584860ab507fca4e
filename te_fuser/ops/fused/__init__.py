"""Fused operations: stateless, several basic ops in one step."""

from .backward_linear_add import BackwardLinearAdd
from .forward_linear_bias_add import ForwardLinearBiasAdd
