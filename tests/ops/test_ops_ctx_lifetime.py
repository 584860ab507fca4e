"""The new ops and their fusions keep nothing on the autograd graph after backward (the seed-000 bug):
the graph walk and the retained-bytes count, each with its bug-on control."""

import pytest
import torch

import te_fuser
from te_fuser import ops, recipe
from te_fuser.ops import fuser as fuser_module

from _fuser_ctx_walk import allowed_storages, assert_nothing_reachable, reachable_tensors, retained_cpu_bytes

RECIPES = {"no_fp8": None, "delayed": recipe.DelayedScaling(amax_history_len=4),
           "current": recipe.Float8CurrentScaling()}
TOKENS, HIDDEN, FFN = 256, 64, 128


def _model():
    torch.manual_seed(0)
    return ops.Sequential(ops.MakeExtraOutput(), ops.Linear(HIDDEN, FFN), ops.Dropout(0.1),
                          ops.Reshape((-1, 2, HIDDEN)), ops.L2Normalization(), ops.Reshape((-1, FFN)),
                          ops.ConstantScale(0.5), ops.Identity(), ops.Linear(FFN, HIDDEN), ops.AddExtraInput())


def _forward(model, x, e, recipe_name):
    with te_fuser.fp8_autocast(enabled=RECIPES[recipe_name] is not None, fp8_recipe=RECIPES[recipe_name]):
        return model(x, e)


def _inputs():
    return torch.randn(TOKENS, HIDDEN, requires_grad=True), torch.randn(TOKENS, HIDDEN, requires_grad=True)


def _graph_check(model, recipe_name):
    x, e = _inputs()
    out, extra = _forward(model, x, e, recipe_name)
    plan = [type(op).__name__ for op, _ in model._module_groups[0]._forward_ops]
    assert "ForwardLinearBiasAdd" in plan
    allowed = allowed_storages(model)
    assert reachable_tensors(out, allowed)  # the walk sees what the forward saved
    torch.autograd.backward([out, extra], [torch.randn_like(out), torch.randn_like(extra)])
    return out, allowed


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_nothing_reachable_after_backward(recipe_name):
    out, allowed = _graph_check(_model(), recipe_name)
    assert_nothing_reachable(out, allowed)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_graph_check_catches_the_leak_without_clearing(recipe_name, monkeypatch):
    monkeypatch.setattr(fuser_module, "_CLEAR_CTX_AFTER_BACKWARD", False)
    out, allowed = _graph_check(_model(), recipe_name)
    with pytest.raises(AssertionError, match="still reachable"):
        assert_nothing_reachable(out, allowed)


@pytest.mark.parametrize("recipe_name", ["no_fp8", "current"])
def test_before_backward_only_save_for_backward_holds_tensors(recipe_name, monkeypatch):
    """No op's context keeps a tensor as an attribute (the extra input handed to AddExtraInput is taken off
    its context after the forward); bug-on control: a Dropout that keeps its mask on the context."""
    model = _model()
    x, e = _inputs()
    allowed = allowed_storages(model)
    out, _ = _forward(model, x, e, recipe_name)
    assert reachable_tensors(out, allowed)
    assert reachable_tensors(out, allowed, saved=False) == []

    original = ops.Dropout.op_forward

    def keeps_mask(self, ctx, *args):
        y = original(self, ctx, *args)
        ctx.kept = ctx.to_save
        return y

    monkeypatch.setattr(ops.Dropout, "op_forward", keeps_mask)
    out, _ = _forward(model, x, e, recipe_name)
    assert reachable_tensors(out, allowed, saved=False), "bug-on control: the walk must see the kept mask"


def _retained(model, recipe_name):
    x, e = _inputs()
    dy, dextra = torch.randn(TOKENS, HIDDEN), torch.randn(TOKENS, HIDDEN)
    _forward(model, x, e, recipe_name)  # first step: creates the FP8 state and caches
    model.zero_grad(set_to_none=True)

    def step():
        out, extra = _forward(model, x, e, recipe_name)
        torch.autograd.backward([out, extra], [dy, dextra])
        return out, extra

    (out, extra), retained = retained_cpu_bytes(step)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    expected = out.numel() * out.element_size() + 2 * x.numel() * x.element_size() + grads  # out, x.grad, e.grad
    return retained, expected


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_retained_bytes_with_outputs_alive(recipe_name, monkeypatch):
    retained, expected = _retained(_model(), recipe_name)
    assert retained <= expected + 4096, (retained, expected)
    # Clearing off: at least the Dropout mask (one byte an entry) and L2Normalization's saved input stay.
    monkeypatch.setattr(fuser_module, "_CLEAR_CTX_AFTER_BACKWARD", False)
    retained_leaky, expected = _retained(_model(), recipe_name)
    assert retained_leaky >= expected + TOKENS * FFN * 5, (retained_leaky, expected)
