"""What autograd saves for backward: every saved storage once, with its size and the op that saved it.

    out, saved = saved_for_backward(lambda: model(x))
    print(saved.total_bytes, saved.by_op())

The storages come from torch.autograd.graph.saved_tensors_hooks (the ground
truth: everything any node saved while fn ran, counted once per storage); the
names come from a walk of the output's graph: a builtin node's `_saved_*`
attributes, a custom Function's saved_tensors, and for te_fuser's op fuser the
basic op each tensor belongs to. A Float8Tensor's bytes (uint8, as TE keeps
them) are listed in its FP8 dtype when the walk finds the tensor they belong to.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch
from torch.autograd.function import BackwardCFunction

from ..tensor.float8_tensor import Float8Tensor

_FLOAT8_PARTS = ("_data", "_transpose", "_scale_inv")


@dataclass(frozen=True)
class SavedTensor:
    """One saved storage: a tensor viewing it, and where it was found ('?' when the walk missed it)."""

    op: str
    slot: str
    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.untyped_storage().nbytes()

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.tensor.shape)


class SavedTensors:
    """The unique storages saved for backward by one forward."""

    def __init__(self, entries: List[SavedTensor]):
        self.entries = entries

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def by_op(self) -> "OrderedDict[str, List[SavedTensor]]":
        groups: "OrderedDict[str, List[SavedTensor]]" = OrderedDict()
        for e in self.entries:
            groups.setdefault(e.op, []).append(e)
        return groups

    def __iter__(self):
        return iter(self.entries)

    def __len__(self):
        return len(self.entries)


def _plain_tensors(t):
    """The plain tensors behind a saved value (a Float8Tensor subclass is saved as its buffers)."""
    if isinstance(t, Float8Tensor):
        return [(name, getattr(t, name, None)) for name in _FLOAT8_PARTS]
    return [("", t)]


def _fp8_dtype_of(shell, part: str):
    """The FP8 dtype of a Float8Tensor's byte buffer `part`, None for any other tensor."""
    return shell.fp8_dtype if isinstance(shell, Float8Tensor) and part in ("_data", "_transpose") else None


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _shell_slots(objects, owner) -> List[Tuple[str, object]]:
    """('<owner>[item].<buffer>', FP8 dtype or None) per saved tensor of prepare_for_saving's layout (a
    shell gives 3 buffers)."""
    slots = []
    for item, shell in enumerate(objects):
        parts = _FLOAT8_PARTS if shell is not None else ("",)
        slots += [(f"{owner[item]}[{item}]{part and '.' + part}", _fp8_dtype_of(shell, part)) for part in parts]
    return slots


def _custom_slots(node, saved) -> List[Tuple[str, object]]:
    """(slot name, FP8 dtype or None) of a custom Function's saved tensors: per basic op for the op
    fuser's node."""
    state = getattr(node, "state", None)
    if state is not None:  # te_fuser's op fuser: its ops' to_save lists, in order
        op_names = {}
        for fused, idx in state.plan.backward_ops:
            for op, j in zip(fused.basic_ops, idx):
                op_names[j] = f"{type(op).__name__}#{j}"
        owner = [op_names[j] for j, (start, end) in enumerate(state.save_ranges) for _ in range(start, end)]
        slots = _shell_slots(state.tensor_objects, owner)
    elif getattr(node, "tensor_objects", None) is not None:
        slots = _shell_slots(node.tensor_objects, [""] * len(node.tensor_objects))
    else:
        slots = [(f"[{i}]", None) for i in range(len(saved))]
    if len(slots) != len(saved):
        raise ValueError("unknown layout")
    return slots


def _node_tensors(node, name: str) -> List[Tuple[str, str, torch.Tensor, object]]:
    """(op, slot, tensor, FP8 dtype of its bytes or None) for what one graph node (called name) saved."""
    found = []
    if isinstance(node, BackwardCFunction):
        try:
            saved = node.saved_tensors
        except RuntimeError:  # already freed by a backward
            saved = ()
        try:
            slots = _custom_slots(node, saved)
        except (AttributeError, KeyError, IndexError, ValueError):  # a layout this walk does not know
            slots = [(f"[{i}]", None) for i in range(len(saved))]
        for (slot, fp8_dtype), t in zip(slots, saved):
            op = name + (f"/{slot.split('[')[0]}" if not slot.startswith("[") else "")
            found += [(op, slot + (f".{part}" if part else ""), p, _fp8_dtype_of(t, part) or fp8_dtype)
                      for part, p in _plain_tensors(t) if p is not None]
    for attr in dir(node):
        if attr.startswith("_saved_"):
            try:
                value = getattr(node, attr)
            except RuntimeError:
                continue
            values = value if isinstance(value, (list, tuple)) else [value]
            for v in values:
                if isinstance(v, torch.Tensor):
                    found += [(name, attr[len("_saved_"):], p, _fp8_dtype_of(v, part))
                              for part, p in _plain_tensors(v) if p is not None]
    return found


def _names(outputs) -> Dict[int, Tuple[str, str, object]]:
    names: Dict[int, Tuple[str, str, object]] = {}
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = set()
    count: Dict[str, int] = {}  # custom Function nodes numbered per class, from the output back
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if isinstance(node, BackwardCFunction):
            count[name] = count.get(name, 0) + 1
            name = f"{name}({count[name]})"
        for op, slot, t, fp8_dtype in _node_tensors(node, name):
            names.setdefault(_key(t), (op, slot, fp8_dtype))
        stack.extend(n for n, _ in node.next_functions)
    return names


def saved_for_backward(fn: Callable[[], object]) -> Tuple[object, SavedTensors]:
    """(fn(), the storages autograd saved for backward while fn ran, each once)."""
    storages: "OrderedDict[int, torch.Tensor]" = OrderedDict()

    def pack(t):
        for _, p in _plain_tensors(t):
            if p is not None and p.untyped_storage().nbytes() > 0:
                storages.setdefault(_key(p), p)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    outputs = result if isinstance(result, (list, tuple)) else [result]
    names = _names(outputs)
    entries = []
    for key, t in storages.items():
        op, slot, fp8_dtype = names.get(key, ("?", "?", None))
        if fp8_dtype is not None and t.dtype == torch.uint8:
            t = t.view(fp8_dtype)
        entries.append(SavedTensor(op, slot, t))
    return result, SavedTensors(entries)
