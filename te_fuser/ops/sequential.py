"""te_fuser.ops.Sequential: a container whose runs of basic ops execute through an OperationFuser."""

from typing import List

import torch

from ..quantization import runs_while_tracing
from .fuser import OperationFuser
from .op import BasicOperation, FusibleOperation


class Sequential(torch.nn.Module):
    """Like torch.nn.Sequential; consecutive fusible ops (basic ops, and compositions such as ops.Linear,
    which contribute their basic ops) run as one fused autograd Function, any other module runs as
    itself in between."""

    def __init__(self, *modules: torch.nn.Module):
        super().__init__()
        for i, module in enumerate(modules):
            self.add_module(str(i), module)
        self._groups = None
        self._num_extra_inputs = 0

    def append(self, module: torch.nn.Module) -> "Sequential":
        self.add_module(str(len(self._modules)), module)
        self._groups = None
        return self

    def _set_modules(self, modules) -> None:
        """Hold `modules`, named 0, 1, ... (the fused groups are rebuilt at the next forward)."""
        self._modules.clear()
        for j, module in enumerate(modules):
            self.add_module(str(j), module)
        self._groups = None

    def extend(self, modules) -> "Sequential":
        self._set_modules(list(self) + list(modules))
        return self

    def insert(self, i: int, module: torch.nn.Module) -> "Sequential":
        modules = list(self)
        modules.insert(i, module)
        self._set_modules(modules)
        return self

    def pop(self, i: int = -1) -> torch.nn.Module:
        modules = list(self)
        module = modules.pop(i)
        self._set_modules(modules)
        return module

    def __iadd__(self, modules) -> "Sequential":
        return self.extend(modules)

    def __add__(self, modules) -> "Sequential":
        return Sequential(*self, *modules)

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, i):
        """The i-th module, or for a slice a Sequential of those modules (torch.nn.Sequential's, TE's)."""
        modules = list(self._modules.values())
        if isinstance(i, slice):
            return Sequential(*modules[i])
        return modules[i]

    def __setitem__(self, i: int, module: torch.nn.Module) -> None:
        key = list(self._modules)[i]
        self._modules[key] = module
        self._groups = None

    def __delitem__(self, i) -> None:
        modules = list(self._modules.values())
        del modules[i]
        self._set_modules(modules)

    def __iter__(self):
        return iter(self._modules.values())

    @property
    def _module_groups(self) -> List:
        """TE's name for the groups (fusers and other modules) the last forward ran."""
        return self._groups

    def _make_groups(self) -> List:
        groups, run = [], []
        for module in self._modules.values():
            if isinstance(module, BasicOperation):
                run.append(module)
                continue
            if isinstance(module, FusibleOperation):
                run.extend(module.basic_ops)
                continue
            if run:
                groups.append(OperationFuser(run))
                run = []
            groups.append(module)
        if run:
            groups.append(OperationFuser(run))
        self._num_extra_inputs = sum(g.num_extra_inputs for g in groups if isinstance(g, OperationFuser))
        return groups

    @runs_while_tracing  # groups made in the graph would be new at each call: one compilation per call
    def _ensure_groups(self) -> None:
        if self._groups is None:
            self._groups = self._make_groups()

    def forward(self, x: torch.Tensor, *extra_inputs: torch.Tensor):
        """The output, or (output, *extra outputs) when ops such as MakeExtraOutput made some. extra_inputs:
        those of the ops that take some (AddExtraInput), in op order."""
        self._ensure_groups()
        if len(extra_inputs) != self._num_extra_inputs:
            raise ValueError(f"extra_inputs: the ops take {self._num_extra_inputs} extra input(s), "
                             f"got {len(extra_inputs)}")
        extras, pending = [], list(extra_inputs)
        for group in self._groups:
            if not isinstance(group, OperationFuser):
                x = group(x)
                continue
            mine, pending = pending[:group.num_extra_inputs], pending[group.num_extra_inputs:]
            x = group(x, extra_inputs=mine)
            if isinstance(x, tuple):
                x, *more = x
                extras.extend(more)
        return (x, *extras) if extras else x
