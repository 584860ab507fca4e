"""Backward fusion: activation gradient and bias gradient (e.g. dGELU + dbias) in one pass."""

from ..basic.activation import _BiasActivation
from ..basic.bias import Bias
from ..op import FusedOperation


class ActivationBiasGrad(FusedOperation):
    """Backward of Bias followed by an element-wise activation (GELU, QGELU, ReLU, SReLU, SiLU): one
    kernel reads dy and the saved input once, writes dx (FP8 when the previous op takes FP8
    gradients) and reduces dbias."""

    def __init__(self, bias: Bias, activation: _BiasActivation):
        super().__init__((bias, activation))

    def fuser_backward(self, ctxs, grad_output):
        bias_ctx, act_ctx = ctxs
        activation: _BiasActivation = self._basic_ops[1]
        dx, dbias = activation.backward_with_bias(act_ctx, grad_output, bias_ctx.bias_requires_grad,
                                                       bias_ctx.grad_input_quantizer)
        return dx, [(dbias,), ()]
