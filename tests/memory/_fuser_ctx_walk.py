"""Test helpers: what an autograd graph still holds, found two independent ways.

reachable_tensors: walks the graph from an output's grad_fn and collects every
tensor reachable from a node -- saved tensors still alive, and anything on a
custom Function's ctx attributes (through lists, dicts, objects, Float8Tensors).

retained_cpu_bytes: the bytes torch's CPU allocator allocated during a call and
that are still alive afterwards (te_fuser's MemoryTracker, which the bug-on
control of every test using it shows to catch the leak).
"""

import gc

import torch
from torch.autograd.function import BackwardCFunction

from te_fuser.tensor.float8_tensor import Float8Tensor
from te_fuser.memory import MemoryTracker
from te_fuser.ops.fuser import OperationFuser
from te_fuser.tensor.quantized_tensor import Quantizer

# Parameter holders and scaling state: allowed to be reachable.
_SKIP = (torch.nn.Module, OperationFuser, Quantizer, type, str, bytes, int, float, bool, type(None),
         torch.dtype, torch.device, torch.Size)


def allowed_storages(*modules) -> set:
    """Storages of parameters, buffers, FP8 recipe state and cached FP8 weights of the modules."""
    keys = set()

    def add(t):
        if isinstance(t, Float8Tensor):  # a wrapper: its buffers hold the bytes
            for part in (t._data, t._transpose, t._scale_inv):
                add(part)
        elif isinstance(t, torch.Tensor):
            keys.add(t.untyped_storage().data_ptr())

    for module in modules:
        for t in list(module.parameters()) + list(module.buffers()):
            add(t)
        for sub in module.modules():
            for op in getattr(sub, "_ops", ()) or (sub,):
                for state in getattr(op, "_fp8_states", None) or ():
                    for v in vars(state).values():
                        add(v)
                    for quantizer in getattr(state, "_quantizers", None) or ():  # current scaling: their own
                        add(quantizer.amax)
                        add(quantizer.scale)
                add(getattr(op, "_fp8_weight_cache", None))
    return keys


def _collect(obj, path, out, seen, depth=0):
    if depth > 12 or id(obj) in seen or isinstance(obj, _SKIP):
        return
    seen.add(id(obj))
    if isinstance(obj, Float8Tensor):  # a wrapper without storage: its buffers
        for name in ("_data", "_transpose", "_scale_inv"):
            _collect(getattr(obj, name, None), f"{path}.{name}", out, seen, depth + 1)
    elif isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _collect(v, f"{path}[{k!r}]", out, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for i, v in enumerate(obj):
            _collect(v, f"{path}[{i}]", out, seen, depth + 1)
    else:
        fields = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
        for name in getattr(type(obj), "__slots__", ()):
            fields[name] = getattr(obj, name, None)
        for k, v in fields.items():
            _collect(v, f"{path}.{k}", out, seen, depth + 1)


def reachable_tensors(output: torch.Tensor, allowed: set) -> list:
    """[(path, tensor)] reachable from output's graph, except the allowed storages."""
    found, seen_nodes, seen_objs = [], set(), set()
    # Nodes and the lists, dicts and values read from them stay referenced until the walk ends:
    # the seen sets hold ids, and a freed object's id could be reused by the next one, which
    # would then be skipped.
    temporaries = []
    stack = [(output.grad_fn, "grad_fn")]
    while stack:
        node, path = stack.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        temporaries.append(node)
        name = f"{path}<{type(node).__name__}>"
        for i, (nxt, _) in enumerate(node.next_functions):
            stack.append((nxt, f"{name}.next[{i}]"))
        if isinstance(node, BackwardCFunction):
            try:
                saved = node.saved_tensors
            except RuntimeError:  # freed after backward
                saved = ()
            temporaries += [list(saved), dict(vars(node))]
            _collect(temporaries[-2], f"{name}.saved_tensors", found, seen_objs)
            _collect(temporaries[-1], name, found, seen_objs)
        for attr in dir(node):
            if attr.startswith("_saved_"):
                try:
                    value = getattr(node, attr)
                except RuntimeError:
                    continue
                temporaries.append(value)
                _collect(value, f"{name}.{attr}", found, seen_objs)
    return [(p, t) for p, t in found if t.untyped_storage().data_ptr() not in allowed and t.numel() > 0]


def assert_nothing_reachable(output: torch.Tensor, allowed: set) -> None:
    found = reachable_tensors(output, allowed)
    assert not found, "tensors still reachable from the graph:\n" + "\n".join(
        f"  {p}: {tuple(t.shape)} {t.dtype}" for p, t in found)


def retained_cpu_bytes(fn):
    """(result of fn(), CPU bytes allocated during fn and still alive once it returned).

    Measured by te_fuser's MemoryTracker, which matches frees to the allocations made during fn by
    address. Summing the profiler events' sizes would not do: torch reports the free of any block
    it saw allocated under an earlier profiler, which would count as negative bytes. The collector
    is run first and kept off while fn runs, so that whether fn's own cyclic garbage counts does not
    depend on when a collection happens to run.
    """
    gc.collect()
    gc.disable()
    try:
        with MemoryTracker(device="cpu", gc_collect=False) as tracker:
            result = fn()
    finally:
        gc.enable()
    return result, tracker.retained_bytes
