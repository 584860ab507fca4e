"""Seed 001 (TransformerEngine #1935): FP8 attention kept its tensors on ctx.tensor_objects after backward.

The fix under test: FusedAttentionFunction keeps tensors only through
save_for_backward, and drops its FP8 shells in backward. Two measurements,
each shown to catch the buggy pattern:
  1. a walk of the autograd graph from the output's grad_fn finds no tensor
     (and no Float8Tensor holding buffers) on any node's plain attributes;
  2. the bytes torch's allocator still holds after forward + backward, while
     the output is alive, are exactly the output and the input grads.
Both are cross-checked with te_fuser.memory (audit_autograd, MemoryTracker). Every backend runs in the
same Function: the CPU ones (te_fuser's kernels, torch's CPU flash kernel, the unfused path) are measured
with the allocator; the GPU library ones (cuDNN, flash) on meta tensors, where the graph walk applies and
the retention is seen through weak references to what their aten ops returned.
"""

import weakref

import pytest
import torch

import te_fuser
from te_fuser.attention.dot_product_attention import dot_product_attention as dpa_module
from te_fuser.attention.backends import clear_cache, cudnn, flash
from te_fuser.attention.function import FusedAttentionFunction
from te_fuser.memory import MemoryTracker, audit_autograd
from te_fuser.tensor.quantized_tensor import restore_from_saved

from _fuser_ctx_walk import reachable_from, retained_cpu_bytes
from memory_patterns import shell_keeps_a_link

HEADS, DIM, SEQ = 2, 64, 512


def ctx_tensors(output):
    """(node name, attribute, tensor) for every tensor a plain attribute of a graph node behind output
    reaches (through containers, objects and every attribute of a Float8Tensor or its shell)."""
    found, stack, visited = [], [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        for name, value in getattr(node, "__dict__", {}).items():
            found.extend((type(node).__name__, name, t) for _, t in reachable_from(value))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


class LeakyFunction(FusedAttentionFunction):
    """The bug of seed 001: after backward, the restored FP8 tensors stay reachable from ctx."""

    @staticmethod
    def backward(ctx, dout):
        objects, saved = ctx.tensor_objects, ctx.saved_tensors
        grads = FusedAttentionFunction.backward(ctx, dout)
        if objects is not None:
            restore_from_saved(objects, saved)  # the shells hold their buffers again ...
        ctx.tensor_objects = objects  # ... and stay on ctx, as in TransformerEngine before the fix
        ctx.saved_lse = saved[4 if objects is None else 12]  # a plain tensor attribute (lse): the same class of bug
        return grads


# (backend, fp8): FP8 attention runs on te_fuser's kernels only.
CPU_RUNS = [("te_fuser", False), ("te_fuser", True), ("cpu_flash", False), ("unfused", False)]


def run(fp8: bool, backend: str = "te_fuser"):
    module = te_fuser.DotProductAttention(HEADS, DIM, qkv_format="bshd", attention_backend=backend)
    q, k, v = (torch.randn(1, SEQ, HEADS, DIM, requires_grad=True) for _ in range(3))
    recipe = te_fuser.recipe.DelayedScaling(fp8_dpa=True)

    def step():
        with te_fuser.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            out = module(q, k, v)
        out.backward(torch.ones_like(out))
        return out

    step()  # first call: the FP8 scaling state is created (module state, not a leak)
    for t in (q, k, v):
        t.grad = None
    out, held = retained_cpu_bytes(step)
    expected = out.numel() * out.element_size() + sum(t.numel() * t.element_size() for t in (q, k, v))
    # The same step once more under te_fuser.memory's tracker, as a cross-check.
    for t in (q, k, v):
        t.grad = None
    with MemoryTracker("cpu") as tracker:
        out_again = step()
    return out, held, expected, tracker.retained_bytes, out_again


@pytest.mark.parametrize("backend, fp8", CPU_RUNS)
def test_no_tensor_on_ctx_and_nothing_retained(backend, fp8):
    out, held, expected, tracked, out_again = run(fp8, backend)
    assert out.grad_fn.next_functions[0][0].backend == backend
    assert ctx_tensors(out) == []
    assert held == expected, f"{held - expected} bytes beyond the output and the grads are still held"
    assert audit_autograd(out_again).clean
    assert tracked == expected


@pytest.mark.parametrize("backend, fp8", CPU_RUNS)
def test_the_same_checks_catch_the_seed_001_bug(backend, fp8, monkeypatch):
    monkeypatch.setattr(dpa_module, "FusedAttentionFunction", LeakyFunction)
    out, held, expected, tracked, out_again = run(fp8, backend)
    leaked = ctx_tensors(out)
    assert leaked, "the graph walk missed tensors left on ctx"
    assert held > expected, "the allocator measurement missed the retained tensors"
    audit = audit_autograd(out_again)
    assert not audit.clean and tracked - expected >= audit.total_bytes > 0
    if fp8:
        # The FP8 q, k, v and out bytes (1 byte per element) are among what is retained.
        assert held - expected >= 4 * SEQ * HEADS * DIM


def _fp8_forward():
    module = te_fuser.DotProductAttention(HEADS, DIM, qkv_format="bshd")
    q, k, v = (torch.randn(1, SEQ, HEADS, DIM, requires_grad=True) for _ in range(3))
    with te_fuser.fp8_autocast(fp8_recipe=te_fuser.recipe.DelayedScaling(fp8_dpa=True)):
        return module(q, k, v)


def test_fp8_shells_on_ctx_hold_no_buffers_before_backward(monkeypatch):
    """Between forward and backward the FP8 q, k, v, out live only in save_for_backward; ctx keeps empty
    shells, which reach no bytes through any attribute."""
    out = _fp8_forward()
    node = out.grad_fn.next_functions[0][0]  # behind the reshape to [b, s, h*d]
    shells = [obj for obj in node.tensor_objects if obj is not None]
    assert len(shells) == 4 and all(s._data is None for s in shells)
    assert ctx_tensors(out) == []
    assert len(node.saved_tensors) == 4 * 3 + 5  # FP8 parts of q, k, v, out; lse, 4 length slots
    # Bug-on control: a shell keeping a link to its bytes, under any name, is seen.
    monkeypatch.setattr(te_fuser.Float8Tensor, "prepare_for_saving",
                        shell_keeps_a_link(te_fuser.Float8Tensor.prepare_for_saving))
    assert ctx_tensors(_fp8_forward())


class Recorder:
    """Stands in for torch.ops.aten in a library backend: weak references to every tensor its ops return."""

    def __init__(self):
        self.returned = []

    def __getattr__(self, name):
        op = getattr(torch.ops.aten, name)

        def call(*args, **kwargs):
            result = op(*args, **kwargs)
            outputs = result if isinstance(result, tuple) else (result,)
            self.returned.append((name, [(i, weakref.ref(t)) for i, t in enumerate(outputs)
                                         if isinstance(t, torch.Tensor)]))
            return result
        return call

    def alive(self):
        """(op, output index) of every returned tensor still alive, except the forward's output (the
        module's result is a view of it) and the backward's gradients (now the leaves' .grad)."""
        return [(name, i) for name, refs in self.returned for i, ref in refs
                if ref() is not None and i != 0 and not name.endswith("backward")]


def run_on_meta(backend, monkeypatch):
    """(output, Recorder) of a forward and backward of the library backend on meta tensors."""
    aten = Recorder()
    monkeypatch.setattr({"cudnn": cudnn, "flash": flash}[backend], "_aten", aten)
    clear_cache()
    module = te_fuser.DotProductAttention(HEADS, DIM, qkv_format="bshd", attention_backend=backend)
    q, k, v = (torch.empty(1, SEQ, HEADS, DIM, device="meta", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = module(q, k, v)
    out.backward(torch.ones_like(out))
    return out, aten


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_library_backends_leave_nothing_on_ctx_or_alive(backend, monkeypatch):
    out, aten = run_on_meta(backend, monkeypatch)
    node = out.grad_fn.next_functions[0][0]
    assert node.backend == backend and ctx_tensors(out) == []
    assert aten.returned and aten.alive() == []  # lse and the RNG state died with the backward
    with pytest.raises(RuntimeError, match="freed"):
        node.saved_tensors


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_the_same_checks_catch_the_seed_001_bug_on_library_backends(backend, monkeypatch):
    monkeypatch.setattr(dpa_module, "FusedAttentionFunction", LeakyFunction)
    out, aten = run_on_meta(backend, monkeypatch)
    leaked = ctx_tensors(out)
    # (the walk reaches the lse and, for cuDNN's [b, h, s, 1] view, the tensor it views)
    assert {name for _, name, _ in leaked} == {"saved_lse"}, "the graph walk missed the lse left on ctx"
    forward = f"_scaled_dot_product_{backend}_attention"
    assert aten.alive() == [(forward, 1)], "the weak references missed the retained lse"
