"""ops.Linear (TE's composition: BasicLinear + Bias, + AllReduce / ReduceScatter when row-parallel) against
float64 torch, under FP8, and tensor-parallel on 2 gloo ranks against the unsharded layer."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import te_fuser
from te_fuser import ops, recipe
from te_fuser.distributed import CudaRNGStatesTracker

from _gloo_ranks import run_cases


def _params_like(linear):
    return [p.detach().clone().requires_grad_() for p in (linear.weight, linear.bias) if p is not None]


@pytest.mark.parametrize("bias", [True, False])
def test_matches_float64_torch(bias):
    linear = ops.Linear(12, 7, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        if bias:
            linear.bias.normal_()
    assert [type(op).__name__ for op in linear.basic_ops] == ["BasicLinear", "Bias"][:1 + bias]
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    out = linear(x)
    params = _params_like(linear)
    x_ref = x.detach().clone().requires_grad_()
    ref = F.linear(x_ref, *params)
    dy = torch.randn_like(ref)
    out.backward(dy)
    ref.backward(dy)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for p, r in zip([linear.weight, linear.bias][:1 + bias], params):
        torch.testing.assert_close(p.grad, r.grad)


def test_state_dict_names_are_tes():
    keys = [k for k in ops.Linear(4, 3).state_dict() if not k.endswith("_extra_state")]
    assert keys == ["basic_ops.0.weight", "basic_ops.1.bias"]
    assert ops.Linear(4, 3, bias=False).bias is None
    assert [n for n, _ in ops.Sequential(ops.Linear(4, 3)).named_parameters()] == ["0.basic_ops.0.weight",
                                                                                   "0.basic_ops.1.bias"]


@pytest.mark.parametrize("fp8_recipe", [recipe.DelayedScaling(), recipe.Float8CurrentScaling()])
def test_fp8_autocast(fp8_recipe):
    """Under fp8_autocast the GEMMs run in FP8: the result is within FP8 error of the float64 one and
    differs from the high-precision run; the same op ran the same FP8 arithmetic as BasicLinear + Bias."""
    torch.manual_seed(0)
    linear = ops.Linear(32, 48)
    with torch.no_grad():
        linear.bias.normal_()
    chain = ops.Sequential(ops.BasicLinear(32, 48), ops.Bias(48))
    chain.load_state_dict({"0.weight": linear.weight, "1.bias": linear.bias}, strict=False)
    x = torch.randn(16, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        out = linear(x)
        same = chain(x2)
    dy = torch.randn_like(out)
    out.backward(dy)
    same.backward(dy)
    assert linear.basic_ops[0]._fp8_states is not None
    torch.testing.assert_close(out, same, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    ref = F.linear(x.detach().double(), linear.weight.double(), linear.bias.double())
    assert not torch.equal(out.double(), ref.float().double())
    assert (out.double() - ref).norm() / ref.norm() < 0.06


def test_rng_state_tracker_initializes_the_weight_under_its_fork():
    def tracker():
        t = CudaRNGStatesTracker()
        t.add("model-parallel-rng", 99)
        return t

    torch.manual_seed(1)
    a = ops.Linear(8, 8, rng_state_tracker_function=tracker).weight
    torch.manual_seed(2)
    b = ops.Linear(8, 8, rng_state_tracker_function=tracker).weight
    torch.manual_seed(1)
    c = ops.Linear(8, 8).weight
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_in_a_chain_with_shape_and_scale_ops():
    """Linear -> Reshape (heads) -> ConstantScale -> Identity -> Reshape back -> BasicLinear, one fused node."""
    torch.manual_seed(0)
    model = ops.Sequential(ops.Linear(8, 12, dtype=torch.float64), ops.Reshape((-1, 3, 4)), ops.ConstantScale(0.25),
                           ops.Identity(), ops.Reshape((-1, 12)), ops.BasicLinear(12, 5, dtype=torch.float64))
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    out = model(x)
    assert len(model._module_groups) == 1
    w1, b1, w2 = (t.detach().clone().requires_grad_() for t in (model[0].weight, model[0].bias, model[5].weight))
    x_ref = x.detach().clone().requires_grad_()
    ref = F.linear((F.linear(x_ref, w1, b1).reshape(-1, 3, 4) * 0.25).reshape(-1, 12), w2)
    dy = torch.randn_like(ref)
    out.backward(dy)
    ref.backward(dy)
    torch.testing.assert_close(out, ref)
    for got, want in [(x.grad, x_ref.grad), (model[0].weight.grad, w1.grad), (model[0].bias.grad, b1.grad),
                      (model[5].weight.grad, w2.grad)]:
        torch.testing.assert_close(got, want)


def test_bad_arguments():
    with pytest.raises(ValueError, match="in_features must be a positive int"):
        ops.Linear(0, 4)
    with pytest.raises(ValueError, match="out_features must be a positive int"):
        ops.Linear(4, 2.0)
    with pytest.raises(ValueError, match="tensor_parallel_mode must be one of"):
        ops.Linear(4, 4, tensor_parallel_mode="rows")
    with pytest.raises(ValueError, match="bias: this Linear was built with bias=False"):
        ops.Linear(4, 4, bias=False).bias = torch.zeros(4)


WORLD = 2
SEQ, IN, OUT = 8, 16, 12


def _tp_case(rank, mode, sequence_parallel, bias):
    """The ranks' layers together compute the unsharded y = x W^T + b (row mode: b is the sum of the
    ranks' biases, TE's row-parallel op), forward and backward, against float64 torch."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(OUT, IN, dtype=torch.float64, generator=g)
    biases = torch.randn(WORLD, OUT, dtype=torch.float64, generator=g)
    x = torch.randn(SEQ, IN, dtype=torch.float64, generator=g, requires_grad=True)
    dy = torch.randn(SEQ, OUT, dtype=torch.float64, generator=g)
    w_ref = w.clone().requires_grad_()
    b_ref = (biases if mode == "row" else biases[0]).clone().requires_grad_()
    ref = F.linear(x, w_ref) + (b_ref.sum(0) if mode == "row" else b_ref) * bias
    ref.backward(dy)

    layer = ops.Linear(IN, OUT, bias=bias, dtype=torch.float64, tensor_parallel_mode=mode,
                       sequence_parallel=sequence_parallel)
    names = [type(op).__name__ for op in layer.basic_ops]
    if mode == "row":
        assert names[-1] == ("ReduceScatter" if sequence_parallel else "AllReduce")
    with torch.no_grad():
        if mode == "column":
            layer.weight.copy_(w.chunk(WORLD, 0)[rank])
            if bias:
                layer.bias.copy_(biases[0].chunk(WORLD)[rank])
        else:
            layer.weight.copy_(w.chunk(WORLD, 1)[rank])
            if bias:
                layer.bias.copy_(biases[rank])
    x_local = x.detach()
    if mode == "row":
        x_local = x_local.chunk(WORLD, 1)[rank]
    elif sequence_parallel:
        x_local = x_local.chunk(WORLD, 0)[rank]
    x_local = x_local.contiguous().requires_grad_()
    dy_local = dy.chunk(WORLD, 1)[rank] if mode == "column" else dy
    out_ref = ref.detach().chunk(WORLD, 1)[rank] if mode == "column" else ref.detach()
    if mode == "row" and sequence_parallel:
        dy_local, out_ref = dy_local.chunk(WORLD, 0)[rank], out_ref.chunk(WORLD, 0)[rank]
    out = ops.Sequential(layer)(x_local)
    out.backward(dy_local.contiguous())
    torch.testing.assert_close(out, out_ref)
    dx_ref = x.grad.chunk(WORLD, 1)[rank] if mode == "row" else x.grad
    if mode == "column" and sequence_parallel:
        dx_ref = dx_ref.chunk(WORLD, 0)[rank]
    torch.testing.assert_close(x_local.grad, dx_ref)
    dw_ref = w_ref.grad.chunk(WORLD, 0 if mode == "column" else 1)[rank]
    torch.testing.assert_close(layer.weight.grad, dw_ref)
    if bias:
        db_ref = b_ref.grad[rank] if mode == "row" else b_ref.grad.chunk(WORLD)[rank]
        torch.testing.assert_close(layer.bias.grad, db_ref)


def _tp_bad_in_features(rank):
    with pytest.raises(ValueError, match=r"in_features \(15\) must be divisible by the TP size 2"):
        ops.Linear(15, 4, tensor_parallel_mode="row")


def test_tensor_parallel_on_two_gloo_ranks():
    cases = [(_tp_case, mode, sp, bias) for mode in ("column", "row") for sp in (False, True)
             for bias in (True, False)]
    run_cases(cases + [(_tp_bad_in_features,)], world=WORLD)
