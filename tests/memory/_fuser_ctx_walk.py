"""Test helpers: what an autograd graph still holds, found two independent ways.

reachable_tensors: walks the graph from an output's grad_fn and collects every
tensor reachable from a node -- saved tensors still alive, and anything on a
custom Function's ctx attributes (through lists, dicts, objects, and every
attribute a Float8Tensor or its shell carries: tests/_reachable.py).

retained_cpu_bytes: the bytes torch's CPU allocator allocated during a call and
that are still alive afterwards (te_fuser's MemoryTracker, which the bug-on
control of every test using it shows to catch the leak).
"""

import gc

import torch
from torch.autograd.function import BackwardCFunction

from te_fuser.memory import MemoryTracker
from te_fuser.ops.fuser import OperationFuser
from te_fuser.quantization import DelayedScalingState
from te_fuser.tensor.quantized_tensor import Quantizer

from _reachable import reachable_storages

# Parameter holders and scaling state (quantizers; the delayed-scaling states whose update an fp8_autocast's
# first chain runs at the end of its backward): allowed to be reachable.
ALIVE_ANYWAY = (torch.nn.Module, OperationFuser, Quantizer, DelayedScalingState)


def reachable_from(obj, path: str = "") -> list:
    """[(path, tensor)] of every storage obj reaches, except through modules, fusers and quantizers."""
    return reachable_storages(obj, path, skip=ALIVE_ANYWAY)


def allowed_storages(*modules) -> set:
    """Storages of parameters, buffers, FP8 recipe state and cached FP8 weights of the modules."""
    keys = set()

    def add(t):
        keys.update(found.untyped_storage().data_ptr() for _, found in reachable_from(t))

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


def reachable_tensors(output: torch.Tensor, allowed: set, saved: bool = True) -> list:
    """[(path, tensor)] reachable from output's graph, except the allowed storages; saved=False: only
    what custom Functions' ctx attributes reach, not what they saved with save_for_backward."""
    found, seen_nodes, seen_tensors = [], set(), set()

    def collect(value, path):
        for p, t in reachable_from(value, path):
            if id(t) not in seen_tensors:
                seen_tensors.add(id(t))
                found.append((p, t))

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
                saved_tensors = node.saved_tensors if saved else ()
            except RuntimeError:  # freed after backward
                saved_tensors = ()
            temporaries += [list(saved_tensors), dict(vars(node))]
            collect(temporaries[-2], f"{name}.saved_tensors")
            for attr, value in temporaries[-1].items():
                collect(value, f"{name}.{attr}")
        for attr in dir(node) if saved else ():
            if attr.startswith("_saved_"):
                try:
                    value = getattr(node, attr)
                except RuntimeError:
                    continue
                temporaries.append(value)
                collect(value, f"{name}.{attr}")
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
