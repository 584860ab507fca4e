"""MakeExtraOutput: hands the tensor flowing through the chain back to the caller as well."""

from .. import _tensor_parallel as tp
from .._fp8_io import high_precision
from ..op import BasicOperation


class MakeExtraOutput(BasicOperation):
    """Passes its input on unchanged and returns it as an extra output of the fuser (e.g. the
    norm output of LayerNormLinear, for a residual taken after the norm). Backward adds the
    extra output's gradient to the chain's.

    sequence_parallel_group: the input is a sequence shard; the op all-gathers it along dim 0,
    returns and passes on the gathered tensor (the next op then skips its own gather), and
    reduce-scatters the gradient of the returned tensor back to the shard.
    """

    num_extra_outputs = 1

    def __init__(self, sequence_parallel_group=None):
        super().__init__()
        self.sequence_parallel_group = sequence_parallel_group

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer):
        del prev_op_grad_output_quantizer, next_op_input_quantizer
        x = high_precision(input_)
        if self.sequence_parallel_group is not None:
            x = tp.all_gather_dim0(x, self.sequence_parallel_group)
        ctx.extra_outputs = (x,)
        return x

    def op_backward(self, ctx, grad_output):
        (grad_extra,) = ctx.grad_extra_outputs
        if self.sequence_parallel_group is not None:
            # A copy: gloo's reduce-scatter all-reduces in place, and the gradient is the caller's.
            grad_extra = tp.reduce_scatter_dim0(grad_extra.clone(), self.sequence_parallel_group)
        dy = high_precision(grad_output)
        return (dy if grad_extra is None else dy + grad_extra.view_as(dy)), ()

    def onnx_forward(self, input_):
        if self.sequence_parallel_group is not None:
            raise NotImplementedError("ONNX export of a sequence-parallel chain")
        return input_, (input_,)
