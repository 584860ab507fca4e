"""ops.Linear: TE's linear op, y = x W^T + b, composed of basic ops as TE composes it."""

import contextlib
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .basic.bias import Bias
from .basic.collectives import AllReduce, ReduceScatter
from .basic.linear import TP_MODES, BasicLinear
from .op import FusedOperation


class Linear(FusedOperation):
    """BasicLinear + Bias, with TE's constructor; its basic ops are `basic_ops` (state_dict keys
    basic_ops.0.weight, basic_ops.1.bias, as TE's). In a Sequential its basic ops join the chain.

    tensor_parallel_mode "column": the weight's rows and the bias are split over tensor_parallel_group
    (None: the world group), the input all-gathered first with sequence_parallel. "row": a local
    BasicLinear over this rank's input features, a bias of out_features on every rank (TE's row-parallel
    op: the output is the sum over ranks of x_r W_r^T + b_r), then AllReduce, or ReduceScatter with
    sequence_parallel. rng_state_tracker_function: the weight is initialized under its tracker's fork.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, device=None, dtype=None,
                 tensor_parallel_mode: Optional[str] = None, tensor_parallel_group=None,
                 sequence_parallel: bool = False, rng_state_tracker_function: Optional[Callable] = None,
                 accumulate_into_main_grad: bool = False):
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if tensor_parallel_mode not in TP_MODES:
            raise ValueError(f"tensor_parallel_mode must be one of {TP_MODES}, got {tensor_parallel_mode!r}")
        if tensor_parallel_mode is not None and tensor_parallel_group is None and dist.is_initialized():
            tensor_parallel_group = dist.group.WORLD
        fork = rng_state_tracker_function().fork() if rng_state_tracker_function is not None else contextlib.nullcontext()
        ops = []
        with fork:
            if tensor_parallel_mode == "row":
                size = dist.get_world_size(tensor_parallel_group) if tensor_parallel_group is not None else 1
                if in_features % size:
                    raise ValueError(f"in_features ({in_features}) must be divisible by the TP size {size}")
                ops.append(BasicLinear(in_features // size, out_features, device=device, dtype=dtype,
                                       accumulate_into_main_grad=accumulate_into_main_grad))
            else:
                ops.append(BasicLinear(in_features, out_features, device=device, dtype=dtype,
                                       tensor_parallel_mode=tensor_parallel_mode,
                                       tensor_parallel_group=tensor_parallel_group,
                                       sequence_parallel=sequence_parallel,
                                       accumulate_into_main_grad=accumulate_into_main_grad))
        if bias:
            row = tensor_parallel_mode == "row"
            ranks = dist.get_world_size(tensor_parallel_group) if row and tensor_parallel_group is not None else 1
            ops.append(Bias(out_features * ranks, device=device, dtype=dtype,
                            tensor_parallel=tensor_parallel_mode is not None,
                            tensor_parallel_group=tensor_parallel_group))
        if tensor_parallel_mode == "row":
            ops.append(ReduceScatter(tensor_parallel_group) if sequence_parallel else AllReduce(tensor_parallel_group))
        super().__init__(ops)
        self._modules["basic_ops"] = torch.nn.ModuleList(ops)  # registered under TE's name
        self._has_bias = bool(bias)

    @property
    def weight(self) -> torch.nn.Parameter:
        return self._basic_ops[0].weight

    @weight.setter
    def weight(self, value) -> None:
        self._basic_ops[0].weight = value

    @property
    def bias(self) -> Optional[torch.nn.Parameter]:
        return self._basic_ops[1].bias if self._has_bias else None

    @bias.setter
    def bias(self, value) -> None:
        if not self._has_bias:
            if value is None:
                return
            raise ValueError("bias: this Linear was built with bias=False")
        self._basic_ops[1].bias = value

    def forward(self, input_: torch.Tensor, *extra_inputs: torch.Tensor, basic_op_kwargs=None):
        fuser = self.__dict__.get("_own_fuser")
        if fuser is None:
            from .fuser import OperationFuser  # the fuser module imports this one

            fuser = self.__dict__["_own_fuser"] = OperationFuser(self._basic_ops)
        return fuser(input_, basic_op_kwargs, extra_inputs=extra_inputs)
