"""Identity: passes its input on."""

from ..op import BasicOperation


class Identity(BasicOperation):
    """y = x, dx = dy."""

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer):
        del ctx, prev_op_grad_output_quantizer, next_op_input_quantizer
        return input_

    def op_backward(self, ctx, grad_output):
        return grad_output, ()

    def onnx_forward(self, input_):
        return input_, ()
