"""Every tensor storage an object reaches, by a generic walk: no list of attribute names.

The walk goes through objects' attributes (__dict__ and __slots__), lists, tuples, sets and dicts, and
every tensor's own attributes, its autograd view base included: a wrapper subclass such as Float8Tensor
owns no storage, so what it holds is whatever its attributes reach, whatever they are called (its
buffers, a link to the tensor it was cut from, a cached transpose, anything added later). Weak
references are followed only on request: they keep nothing alive, but a write through one lands in
its target.
"""

import types
import weakref

import torch

# Values that hold no tensor, and code objects whose namespaces are not the object's state.
_LEAVES = (str, bytes, int, float, complex, bool, type(None), type, torch.dtype, torch.device, torch.Size,
           torch.layout, torch.memory_format, types.ModuleType, types.FunctionType, types.MethodType,
           types.BuiltinFunctionType)


def storage_span(t: torch.Tensor):
    """(first, end) byte addresses of t's storage; None without one (a wrapper subclass) or when empty."""
    try:
        storage = t.untyped_storage()
        first, size = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return (first, first + size) if size else None


def _attributes(obj):
    fields = dict(getattr(obj, "__dict__", None) or {})
    for cls in type(obj).__mro__:
        slots = getattr(cls, "__slots__", ())
        for name in [slots] if isinstance(slots, str) else slots:
            if name not in fields and name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                fields[name] = getattr(obj, name)
    return [(f".{name}", value) for name, value in fields.items()]


def reachable_storages(root, path: str = "", *, skip=(), follow_weakrefs: bool = False) -> list:
    """[(path, tensor)]: every tensor with storage bytes that root reaches (root included), each object
    once. Objects of the `skip` types are not entered."""
    found, seen, kept = [], set(), []  # kept: ids stay unique while the walk runs
    stack = [(root, path)]
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, _LEAVES + tuple(skip)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        kept.append(obj)
        if isinstance(obj, torch.Tensor):
            if storage_span(obj) is not None:
                found.append((path, obj))
            children = _attributes(obj)
            if obj._base is not None:  # a view keeps the tensor it views alive (for a subclass: all it holds)
                children.append(("._base", obj._base))
        elif isinstance(obj, dict):
            children = [(f"[{key!r}]", value) for key, value in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = [(f"[{i}]", value) for i, value in enumerate(obj)]
        elif isinstance(obj, weakref.ref):
            children = [("()", obj())] if follow_weakrefs else []
        else:
            children = _attributes(obj)
        stack.extend((child, path + name) for name, child in reversed(children))
    return found


def describe(found) -> str:
    return "\n".join(f"  {path}: {tuple(t.shape)} {t.dtype}, storage of {t.untyped_storage().nbytes()} bytes"
                     for path, t in found)


def shared_storages(original, copy, *, skip=()) -> list:
    """(path in original, path in copy) of every two storages the two reach that overlap in memory
    (weak references followed: a write through one would land in the other)."""
    spans = lambda root, name: [(path, storage_span(t)) for path, t in  # noqa: E731
                                reachable_storages(root, name, skip=skip, follow_weakrefs=True)]
    return [(p, q) for p, (a0, a1) in spans(original, "original") for q, (b0, b1) in spans(copy, "copy")
            if a0 < b1 and b0 < a1]
