"""Memory checks shared by the module tests: a walk of the autograd graph after backward, and the
bytes a training step leaves allocated, each with the switch that brings the seed-000/001 bug back.

The graph walk and the profiler measurement live in tests/memory/_fuser_ctx_walk.py.
"""

import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "memory"))

from _fuser_ctx_walk import allowed_storages, reachable_tensors, retained_cpu_bytes  # noqa: E402

from te_fuser.attention.dot_product_attention import dot_product_attention as dpa_module  # noqa: E402
from te_fuser.attention.function import FusedAttentionFunction  # noqa: E402
from te_fuser.ops import fuser as fuser_module  # noqa: E402
from te_fuser.tensor.quantized_tensor import restore_from_saved  # noqa: E402


def reachable_after_backward(model, forward, grad_seed: int = 0):
    """(reachable before backward, reachable after backward, output) for out = forward()."""
    out = forward()
    allowed = allowed_storages(model)
    before = reachable_tensors(out, allowed)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=out.dtype))
    return before, reachable_tensors(out, allowed), out


def retained_step_bytes(model, forward, inputs):
    """(bytes a forward + backward leaves allocated, bytes it must: output, input grads, parameter grads).

    A first step creates the FP8 scaling state; the measured step runs with all grads cleared.
    """
    forward().sum().backward()
    model.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None

    def step():
        out = forward()
        out.backward(torch.ones_like(out))
        return out

    out, held = retained_cpu_bytes(step)
    expected = out.numel() * out.element_size()
    expected += sum(t.grad.numel() * t.grad.element_size() for t in inputs)
    expected += sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return held, expected


def without_clearing(monkeypatch):
    """The seed-000 bug: the fuser leaves its restored tensors on the autograd node after backward."""
    monkeypatch.setattr(fuser_module, "_CLEAR_CTX_AFTER_BACKWARD", False)


class _LeakyAttentionFunction(FusedAttentionFunction):
    """The seed-001 bug: after backward the FP8 attention's restored q, k, v stay on ctx.tensor_objects
    (and, without FP8, the saved tensors stay on a plain ctx attribute)."""

    @staticmethod
    def backward(ctx, dout):
        # Saved tensors are read once (activation checkpointing allows one unpack); the fixed
        # backward runs on a copy of ctx, so what it drops stays on the real ctx.
        objects, saved = ctx.tensor_objects, ctx.saved_tensors
        view = types.SimpleNamespace(**vars(ctx))
        view.saved_tensors = saved
        grads = FusedAttentionFunction.backward(view, dout)
        if objects is not None:
            restore_from_saved(objects, saved)  # the shells hold their buffers again
        ctx.leaked = saved if objects is None else None
        return grads


def leaky_attention(monkeypatch):
    """te_fuser's DotProductAttention runs the seed-001 bug's Function."""
    monkeypatch.setattr(dpa_module, "FusedAttentionFunction", _LeakyAttentionFunction)
