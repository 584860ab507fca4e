"""Backward fusion: MakeExtraOutput followed by BasicLinear, the extra output's gradient added by the dgrad GEMM."""

from ..basic.extra_output import MakeExtraOutput
from ..basic.linear import BasicLinear
from ..op import FusedOperation


class BackwardLinearAdd(FusedOperation):
    """dx = dy @ W + d(extra output) (TE's BackwardLinearAdd): in high precision one GEMM accumulates
    into the extra output's gradient (beta = 1) instead of a dgrad output and a separate sum."""

    def __init__(self, extra_output: MakeExtraOutput, linear: BasicLinear):
        super().__init__((extra_output, linear))

    @staticmethod
    def applies_to(extra_output: MakeExtraOutput, linear: BasicLinear) -> bool:
        # A gathering extra output reduce-scatters its gradient; a column-parallel dgrad is reduced over ranks.
        return (extra_output.sequence_parallel_group is None
                and (linear.tensor_parallel_mode != "column" or linear.tensor_parallel_size == 1))

    def fuser_backward(self, ctxs, grad_output):
        extra_ctx, linear_ctx = ctxs
        (grad_extra,) = extra_ctx.grad_extra_outputs
        linear: BasicLinear = self._basic_ops[1]
        dx, (dw,) = linear.op_backward(linear_ctx, grad_output, grad_input_addend=grad_extra)
        return dx, [(), (dw,)]
