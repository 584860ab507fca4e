"""audit_autograd: tensors held on custom autograd Function contexts as plain attributes.

torch frees what ``ctx.save_for_backward`` holds once backward has run, but a plain
attribute (``ctx.tensor_objects = [...]``) lives as long as the graph node, i.e. as long
as anything still references the output's ``grad_fn``. For a custom Function the backward
node *is* the ctx, so its attributes are ``vars(node)``.
"""

import collections
import dataclasses
import types

import torch
from torch.autograd.function import BackwardCFunction

from .sizes import format_bytes

_LEAF_TYPES = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size, type)
_SKIPPED_TYPES = (torch.nn.Module, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


@dataclasses.dataclass(frozen=True)
class HeldTensor:
    """One tensor reachable from a ctx attribute; nbytes is its whole storage."""

    path: str
    shape: tuple
    dtype: torch.dtype
    device: str
    nbytes: int
    storage_key: tuple | None  # (device, address) of the storage; None when it has no storage


@dataclasses.dataclass(frozen=True)
class CtxFinding:
    """Tensors one ctx attribute keeps alive; nbytes de-duplicated by storage."""

    node: str
    attribute: str
    tensors: tuple
    nbytes: int

    def __str__(self):
        lines = [f"{self.node}.{self.attribute}: {format_bytes(self.nbytes)} in {len(self.tensors)} tensor(s)"]
        for held in self.tensors:
            shape = "x".join(str(s) for s in held.shape) or "scalar"
            lines.append(f"    {held.path}  [{shape}] {held.dtype} {held.device} storage {format_bytes(held.nbytes)}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class AutogradAudit:
    """Result of audit_autograd: findings per (node, attribute) and de-duplicated total bytes."""

    findings: tuple
    total_bytes: int
    nodes_visited: int
    custom_nodes: int
    node_counts: dict  # node type name -> how many were visited

    @property
    def clean(self):
        return not self.findings

    def __str__(self):
        head = (
            f"audit_autograd: {self.nodes_visited} node(s), {self.custom_nodes} custom Function ctx(s); "
            f"{len(self.findings)} plain ctx attribute(s) hold tensors, {format_bytes(self.total_bytes)} in total"
        )
        # identical findings (one per microbatch, say) are printed once with a count
        grouped = collections.Counter(str(finding) for finding in self.findings)
        body = [f"  {text}" if count == 1 else f"  {count} x {text}" for text, count in grouped.items()]
        return "\n".join([head] + body)


def _storage_of(tensor):
    """(key, nbytes) of a tensor's storage, or (None, 0) for tensors without one (wrapper subclasses)."""
    try:
        storage = tensor.untyped_storage()
        return (str(tensor.device), storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None, 0


def _object_attributes(value):
    names = dict(getattr(value, "__dict__", {}))
    for cls in type(value).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if isinstance(slot, str) and slot not in names and hasattr(value, slot):
                names[slot] = getattr(value, slot)
    return names.items()


def _collect(value, path, depth, found, on_path):
    if isinstance(value, torch.nn.Parameter):
        return  # owned by a module, alive anyway; not what a ctx leaks
    if isinstance(value, torch.Tensor):
        key, nbytes = _storage_of(value)
        if key is None:
            # A wrapper subclass (Float8Tensor) owns no storage: what it holds is whatever its
            # attributes reach, its buffers and any other (a part's link to the tensor it was cut from),
            # and the tensor it is a view of; a level further than a plain object's attributes.
            depth = max(depth, 1) + 1
            children = list(_object_attributes(value))
            if value._base is not None:
                children.append(("_base", value._base))
        else:
            found.append(HeldTensor(path, tuple(value.shape), value.dtype, str(value.device), nbytes, key))
            children = _object_attributes(value) if depth > 0 else ()
    elif depth == 0 or isinstance(value, _LEAF_TYPES + _SKIPPED_TYPES):
        return
    elif isinstance(value, (list, tuple)):
        children = ((f"[{i}]", item) for i, item in enumerate(value))
    elif isinstance(value, dict):
        children = ((f"[{key!r}]", item) for key, item in value.items())
    elif isinstance(value, (set, frozenset)):
        children = ((f"{{{i}}}", item) for i, item in enumerate(value))
    else:
        children = _object_attributes(value)
    if id(value) in on_path:
        return
    on_path.add(id(value))
    for name, child in children:
        child_path = f"{path}{name}" if name.startswith(("[", "{")) else f"{path}.{name}"
        _collect(child, child_path, depth - 1, found, on_path)
    on_path.discard(id(value))


def _roots(output):
    if isinstance(output, torch.Tensor):
        return [output.grad_fn] if output.grad_fn is not None else []
    if isinstance(output, (list, tuple)):
        return [node for item in output for node in _roots(item)]
    if hasattr(output, "next_functions"):
        return [output]
    raise TypeError(f"audit_autograd expects a tensor, an autograd node or a list of them, got {type(output).__name__}")


def audit_autograd(output, *, max_depth=4, persistent=()):
    """Walk the autograd graph behind ``output`` and report tensors on custom Function ctxs.

    Every node reachable through ``next_functions`` is visited; for each custom Function
    node (the ctx) the plain attributes are searched for tensors, recursively through
    lists, tuples, dicts, sets and objects' attributes (``__dict__``/``__slots__``), up to
    ``max_depth`` levels below the attribute. This finds quantized-tensor objects such as
    a Float8Tensor holding ``_data`` / ``_transpose`` / ``_scale_inv``, or an emptied one still
    reaching bytes through any other attribute or the tensor it is a view of. Tensors saved with
    ``save_for_backward``, nn.Parameters and nn.Modules are not reported. Works before and
    after backward (torch frees saved tensors at backward; plain attributes stay).

    persistent: tensors that outlive any one graph (e.g. te_fuser.quantization.recipe_state_tensors(),
    the FP8 scaling state); a ctx that references their storages holds no memory of its own, so they are
    not reported. torch.compile's autograd node keeps the state it read on its ctx after backward.
    """
    skipped = {_storage_of(t)[0] for t in persistent}
    findings = []
    seen_nodes = set()
    queue = _roots(output)
    nodes = []
    while queue:
        node = queue.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        nodes.append(node)  # keeps the node alive so ids stay unique during the walk
        queue.extend(next_node for next_node, _ in node.next_functions)
    custom = [node for node in nodes if isinstance(node, BackwardCFunction)]
    for node in custom:
        for attribute, value in vars(node).items():
            held = []
            _collect(value, attribute, max_depth, held, set())
            held = [h for h in held if h.storage_key is None or h.storage_key not in skipped]
            if held:
                findings.append(CtxFinding(type(node).__name__, attribute, tuple(held), _unique_bytes(held)))
    all_held = [held for finding in findings for held in finding.tensors]
    counts = collections.Counter(type(node).__name__ for node in nodes)
    return AutogradAudit(tuple(findings), _unique_bytes(all_held), len(nodes), len(custom), dict(counts.most_common()))


def _unique_bytes(held_tensors):
    sizes = {}
    for held in held_tensors:
        key = held.storage_key if held.storage_key is not None else ("no-storage", id(held))
        sizes[key] = held.nbytes
    return sum(sizes.values())
