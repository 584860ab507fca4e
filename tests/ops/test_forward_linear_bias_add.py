"""ForwardLinearBiasAdd (TE's): BasicLinear (+ Bias) + AddExtraInput in one step, y = x W^T (+ b) + e. The
fuser's plan shows it taken; the results match float64 torch and the same ops run one at a time."""

import pytest
import torch
import torch.nn.functional as F

from te_fuser import ops
from te_fuser.ops import gemm
from te_fuser.ops.fused import ForwardLinearBiasAdd
from te_fuser.ops.fuser import fuse_forward_ops

from _unfused import forward_plan, run_unfused


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("in_place", [False, True])
def test_forward_linear_bias_add(bias, in_place):
    torch.manual_seed(0)
    model = ops.Sequential(ops.Linear(16, 8, bias=bias, dtype=torch.float64), ops.AddExtraInput(in_place=in_place))
    if bias:
        with torch.no_grad():
            model[0].bias.normal_()
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    e = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    e_values = e.detach().clone()
    y = model(x, e.clone() if in_place else e)
    assert forward_plan(model) == ["ForwardLinearBiasAdd"]
    assert isinstance(model._module_groups[0]._forward_ops[0][0], ForwardLinearBiasAdd)
    params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    x_ref, e_ref = x.detach().clone().requires_grad_(), e_values.clone().requires_grad_()
    ref = F.linear(x_ref, *params) + e_ref
    dy = torch.randn_like(ref)
    grads = torch.autograd.grad(y, [x, e, *model.parameters()], dy)
    want = torch.autograd.grad(ref, [x_ref, e_ref, *params], dy)
    torch.testing.assert_close(y, ref)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w)
    unfused = run_unfused(model, x, e_values.clone())
    torch.testing.assert_close(y, unfused, rtol=1e-15, atol=1e-15)


def test_forward_fusion_accumulates_in_the_gemm(monkeypatch):
    """High precision, out of place: one GEMM call, which receives the extra input to accumulate onto."""
    seen = []
    original = gemm.mm

    def spy(a, b, bias=None, out_dtype=None):
        seen.append(None if bias is None else tuple(bias.shape))
        return original(a, b, bias, out_dtype)

    monkeypatch.setattr(gemm, "mm", spy)
    from te_fuser.ops.basic import linear as linear_module
    monkeypatch.setattr(linear_module, "mm", spy)
    model = ops.Sequential(ops.Linear(16, 8), ops.AddExtraInput())
    model(torch.randn(6, 16), torch.randn(6, 8))
    assert seen == [(6, 8)]


def test_not_fused_after_a_row_parallel_linear():
    """A row-parallel linear reduces its output over ranks before anything is added: left unfused."""
    row = ops.BasicLinear(16, 8, tensor_parallel_mode="row", tensor_parallel_size=2)
    assert [type(op).__name__ for op, _ in fuse_forward_ops([row, ops.AddExtraInput()])] == [
        "BasicLinear", "AddExtraInput"]
