"""Fused operations: stateless, several basic ops in one step."""
