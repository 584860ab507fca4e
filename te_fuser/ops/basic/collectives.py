"""AllGather, AllReduce, ReduceScatter: TE's collective ops, along the first dimension.

process_group=None is the default (world) group, as in TE; without an initialized process group
the world is this process alone and the ops pass their input on.
"""

import torch
import torch.distributed as dist

from .. import _tensor_parallel as tp
from .._fp8_io import high_precision
from ..op import BasicOperation


def _group(process_group):
    if process_group is not None or not dist.is_initialized():
        return process_group
    return dist.group.WORLD


def _check_group(process_group) -> None:
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, "
                        f"got {type(process_group).__name__}")


def _scratch(x: torch.Tensor, group) -> torch.Tensor:
    """x, or a copy of it where the collective would write into x (all-reduce; reduce-scatter on gloo,
    which all-reduces): x is the caller's."""
    if tp.world_size(group) == 1:
        return x
    return x.clone()


class _Collective(BasicOperation):

    def __init__(self, process_group=None):
        super().__init__()
        _check_group(process_group)
        self.process_group = process_group

    @property
    def process_group_size(self) -> int:
        return tp.world_size(_group(self.process_group))


class AllGather(_Collective):
    """y = the ranks' inputs concatenated along dim 0; backward reduce-scatters the gradient."""

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer):
        del ctx, prev_op_grad_output_quantizer, next_op_input_quantizer
        return tp.all_gather_dim0(high_precision(input_), _group(self.process_group))

    def op_backward(self, ctx, grad_output):
        group = _group(self.process_group)
        return tp.reduce_scatter_dim0(_scratch(high_precision(grad_output), group), group), ()


class ReduceScatter(_Collective):
    """y = this rank's dim-0 chunk of the sum over ranks; backward all-gathers the gradient."""

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer):
        del ctx, prev_op_grad_output_quantizer, next_op_input_quantizer
        group = _group(self.process_group)
        return tp.reduce_scatter_dim0(_scratch(high_precision(input_), group), group)

    def op_backward(self, ctx, grad_output):
        return tp.all_gather_dim0(high_precision(grad_output), _group(self.process_group)), ()


class AllReduce(_Collective):
    """y = the sum of the ranks' inputs. As in TE, the ops after it are taken to compute the same on
    every rank, so the gradient is the same on every rank and passes back unchanged.
    reduce_in_backward is TE's keyword, which its AllReduce accepts and does not read either."""

    def __init__(self, process_group=None, reduce_in_backward: bool = True):
        super().__init__(process_group)
        self._reduce_in_backward = bool(reduce_in_backward)

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer):
        del ctx, prev_op_grad_output_quantizer, next_op_input_quantizer
        group = _group(self.process_group)
        return tp.all_reduce(_scratch(high_precision(input_), group), group)

    def op_backward(self, ctx, grad_output):
        return grad_output, ()
