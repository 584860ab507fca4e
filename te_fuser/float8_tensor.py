"""Float8Tensor at its older path, which TransformerEngine 2.x keeps beside `tensor.float8_tensor`."""

from .tensor.float8_tensor import Float8Tensor

__all__ = ["Float8Tensor"]
