"""Fused operations: stateless, several basic ops in one step."""

from .forward_linear_bias_add import ForwardLinearBiasAdd
