"""BackwardLinearAdd (TE's): MakeExtraOutput + BasicLinear, dx = dy W + the extra output's gradient, added by
the dgrad GEMM. The fuser's plan shows it taken; the results match float64 torch and the ops one at a
time; with ForwardLinearBiasAdd under FP8 and under torch.compile(fullgraph=True)."""

import pytest
import torch
import torch.nn.functional as F

import te_fuser
from te_fuser import ops, recipe
from te_fuser.ops.fused import BackwardLinearAdd
from te_fuser.ops.fuser import fuse_backward_ops

from _unfused import backward_plan, forward_plan, run_unfused


def test_backward_linear_add():
    torch.manual_seed(0)
    model = ops.Sequential(ops.MakeExtraOutput(), ops.Linear(16, 8, bias=False, dtype=torch.float64))
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    y, extra = model(x)
    dy, dextra = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64)
    torch.autograd.backward([y, extra], [dy, dextra])
    assert backward_plan(model) == ["BackwardLinearAdd"]
    assert isinstance(model._module_groups[0]._backward_ops[0][0], BackwardLinearAdd)
    w = model[1].weight.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    torch.autograd.backward([F.linear(x_ref, w), x_ref], [dy, dextra])
    torch.testing.assert_close(y, F.linear(x_ref, w).detach())
    torch.testing.assert_close(extra, x_ref.detach(), rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(model[1].weight.grad, w.grad)
    x2 = x.detach().clone().requires_grad_()
    y2, extra2 = run_unfused(model, x2)
    torch.autograd.backward([y2, extra2], [dy, dextra])
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-15, atol=1e-15)


def test_backward_fusion_accumulates_in_the_dgrad_gemm(monkeypatch):
    seen = []
    from te_fuser.ops.basic import linear as linear_module
    original = linear_module.mm

    def spy(a, b, bias=None, out_dtype=None):
        seen.append(None if bias is None else tuple(bias.shape))
        return original(a, b, bias, out_dtype)

    monkeypatch.setattr(linear_module, "mm", spy)
    model = ops.Sequential(ops.MakeExtraOutput(), ops.BasicLinear(16, 8))
    y, extra = model(torch.randn(6, 16, requires_grad=True))
    seen.clear()
    (y.sum() + extra.sum()).backward()
    assert sorted(seen, key=str) == [(6, 16), None]  # the dgrad received the extra gradient, the wgrad nothing


def test_not_fused_where_a_collective_follows_the_dgrad():
    """A column-parallel dgrad is reduced over ranks, a gathering MakeExtraOutput reduce-scatters its
    gradient: both left unfused."""
    column = ops.BasicLinear(16, 8, tensor_parallel_mode="column", tensor_parallel_size=2)
    assert [type(op).__name__ for op, _ in fuse_backward_ops([ops.MakeExtraOutput(), column])] == [
        "MakeExtraOutput", "BasicLinear"]
    gathering = ops.MakeExtraOutput(sequence_parallel_group=object())
    assert [type(op).__name__ for op, _ in fuse_backward_ops([gathering, ops.BasicLinear(16, 8)])] == [
        "MakeExtraOutput", "BasicLinear"]


@pytest.mark.parametrize("fp8_recipe", [recipe.DelayedScaling(), recipe.Float8CurrentScaling()])
def test_fusions_under_fp8_match_the_unfused_ops(fp8_recipe):
    """Under FP8 the fused ops run the same FP8 GEMMs as the ops one by one, and add in high precision."""
    torch.manual_seed(0)
    model = ops.Sequential(ops.MakeExtraOutput(), ops.Linear(32, 32), ops.AddExtraInput())
    with torch.no_grad():
        model[1].bias.normal_()
    x = torch.randn(16, 32, requires_grad=True)
    e = torch.randn(16, 32, requires_grad=True)
    dy, dextra = torch.randn(16, 32), torch.randn(16, 32)
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        y, extra = model(x, e)
    torch.autograd.backward([y, extra], [dy, dextra])
    assert forward_plan(model) == ["MakeExtraOutput", "ForwardLinearBiasAdd"]
    assert backward_plan(model) == ["AddExtraInput", "Bias", "BackwardLinearAdd"]
    x2, e2 = (t.detach().clone().requires_grad_() for t in (x, e))
    grads = [x.grad, e.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        y2, extra2 = run_unfused(model, x2, e2)
    torch.autograd.backward([y2, extra2], [dy, dextra])
    if isinstance(fp8_recipe, recipe.DelayedScaling):  # the second run's scales come from the first's amaxes
        ref = F.linear(x.detach(), model[1].weight, model[1].bias) + e.detach()
        assert (y - ref).norm() / ref.norm() < 0.06
        return
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    for g, g2 in zip(grads, [x2.grad, e2.grad] + [p.grad for p in model.parameters()]):
        torch.testing.assert_close(g, g2, rtol=0, atol=0)


def test_compile_fullgraph_linear_with_extra_input_and_output():
    """torch.compile(fullgraph=True) of Sequential(MakeExtraOutput, Linear, AddExtraInput): the eager values
    and gradients."""
    torch.manual_seed(0)
    model = ops.Sequential(ops.MakeExtraOutput(), ops.Linear(16, 16), ops.AddExtraInput())
    x = torch.randn(8, 16, requires_grad=True)
    e = torch.randn(8, 16, requires_grad=True)
    dy, dextra = torch.randn(8, 16), torch.randn(8, 16)

    def step(fn):
        x.grad = e.grad = None
        model.zero_grad()
        y, extra = fn(x, e)
        torch.autograd.backward([y, extra], [dy, dextra])
        return [y.detach(), extra.detach(), x.grad, e.grad] + [p.grad for p in model.parameters()]

    eager = step(model)
    compiled = step(torch.compile(model, fullgraph=True))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)
