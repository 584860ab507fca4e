"""te_fuser.ops.Sequential: a container whose runs of basic ops execute through an OperationFuser."""

from typing import List

import torch

from ..quantization import runs_while_tracing
from .fuser import OperationFuser
from .op import BasicOperation


class Sequential(torch.nn.Module):
    """Like torch.nn.Sequential; consecutive BasicOperations run as one fused autograd Function,
    any other module runs as itself in between."""

    def __init__(self, *modules: torch.nn.Module):
        super().__init__()
        for i, module in enumerate(modules):
            self.add_module(str(i), module)
        self._groups = None

    def append(self, module: torch.nn.Module) -> "Sequential":
        self.add_module(str(len(self._modules)), module)
        self._groups = None
        return self

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, i: int) -> torch.nn.Module:
        return list(self._modules.values())[i]

    def _make_groups(self) -> List:
        groups, run = [], []
        for module in self._modules.values():
            if isinstance(module, BasicOperation):
                run.append(module)
                continue
            if run:
                groups.append(OperationFuser(run))
                run = []
            groups.append(module)
        if run:
            groups.append(OperationFuser(run))
        return groups

    @runs_while_tracing  # groups made in the graph would be new at each call: one compilation per call
    def _ensure_groups(self) -> None:
        if self._groups is None:
            self._groups = self._make_groups()

    def forward(self, x: torch.Tensor):
        """The output, or (output, *extra outputs) when ops such as MakeExtraOutput made some."""
        self._ensure_groups()
        extras = []
        for group in self._groups:
            x = group(x)
            if isinstance(group, OperationFuser) and isinstance(x, tuple):
                x, *more = x
                extras.extend(more)
        return (x, *extras) if extras else x
