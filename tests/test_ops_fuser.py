"""The op fuser: chains of te_fuser ops against the same chain of plain torch ops (float64),
the fusions it finds, FP8 hand-over between ops, the plan cache and torch.compile."""

import pytest
import torch
import torch.nn.functional as F

import te_fuser
from te_fuser import ops, recipe
from te_fuser.tensor.float8_tensor import Float8Tensor
from te_fuser.ops.basic.linear import BasicLinear

from _no_grad_path import run_with_and_without_grad
from activation_reference import activation64

# TE's op classes and the activation each computes.
ELEMENTWISE_OPS = {"gelu": ops.GELU, "qgelu": ops.QGELU, "relu": ops.ReLU, "srelu": ops.SReLU, "silu": ops.SiLU}
GATED_OPS = {"geglu": ops.GEGLU, "qgeglu": ops.QGEGLU, "reglu": ops.ReGLU, "sreglu": ops.SReGLU, "swiglu": ops.SwiGLU}
OP_ACTIVATION = {cls: name for name, cls in {**ELEMENTWISE_OPS, **GATED_OPS}.items()}


def _randomize(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 and p.numel() == 64 else 0.0))


def _torch_reference(model, x64):
    """The same chain with plain torch ops in float64, parameters as float64 leaves."""
    params = {}
    out = x64
    for i, op in enumerate(model):
        p = {n: t.detach().double().requires_grad_() for n, t in op.named_parameters()}
        params[i] = p
        if isinstance(op, ops.BasicLinear):
            out = F.linear(out, p["weight"])
        elif isinstance(op, ops.Bias):
            out = out + p["bias"]
        elif type(op) in OP_ACTIVATION:
            out = activation64(out, OP_ACTIVATION[type(op)])
        elif isinstance(op, ops.RMSNorm):
            out = F.rms_norm(out, (out.shape[-1],), p["weight"], op.eps)
        elif isinstance(op, ops.LayerNorm):
            out = F.layer_norm(out, (out.shape[-1],), p["weight"], p["bias"], op.eps)
        elif isinstance(op, ops.Quantize):
            pass
        else:
            raise TypeError(type(op))
    return out, params


CHAINS = {
    "ln_mlp_gelu": lambda: ops.Sequential(ops.LayerNorm(64), ops.BasicLinear(64, 128), ops.Bias(128), ops.GELU(),
                                          ops.BasicLinear(128, 64), ops.Bias(64)),
    "rms_swiglu": lambda: ops.Sequential(ops.RMSNorm(64), ops.BasicLinear(64, 256), ops.SwiGLU(),
                                         ops.BasicLinear(128, 64)),
    "relu_no_bias": lambda: ops.Sequential(ops.BasicLinear(64, 32), ops.ReLU(), ops.Quantize()),
    "bias_gelu_only": lambda: ops.Sequential(ops.Bias(64), ops.GELU()),
}
for _name, _op in ELEMENTWISE_OPS.items():
    CHAINS[f"mlp_{_name}"] = lambda op=_op: ops.Sequential(ops.BasicLinear(64, 128), ops.Bias(128), op(),
                                                            ops.BasicLinear(128, 64))
for _name, _op in GATED_OPS.items():
    CHAINS[f"mlp_{_name}"] = lambda op=_op: ops.Sequential(ops.BasicLinear(64, 256), ops.Bias(256), op(),
                                                            ops.BasicLinear(128, 64))


@pytest.mark.parametrize("name", list(CHAINS))
def test_chain_matches_plain_torch(name):
    model = CHAINS[name]()
    _randomize(model)
    torch.manual_seed(0)
    x = torch.randn(3, 16, 64, requires_grad=True)
    out = model(x)
    dy = torch.randn_like(out)
    out.backward(dy)
    x64 = x.detach().double().requires_grad_()
    ref, ref_params = _torch_reference(model, x64)
    ref.backward(dy.double())

    def close(a, b, what):
        scale = max(b.abs().max().item(), 1.0)
        err = (a.double() - b).abs().max().item()
        assert err <= 2e-5 * scale, f"{what}: {err}"

    close(out, ref, "out")
    close(x.grad, x64.grad, "dx")
    for i, op in enumerate(model):
        for pname, p in op.named_parameters():
            close(p.grad, ref_params[i][pname].grad, f"op {i} {pname}")


@pytest.mark.parametrize("act", list(ELEMENTWISE_OPS))
def test_fusions_found(act):
    model = ops.Sequential(ops.LayerNorm(64), ops.BasicLinear(64, 128), ops.Bias(128), ELEMENTWISE_OPS[act](),
                           ops.BasicLinear(128, 64), ops.Bias(64))
    model(torch.randn(4, 64, requires_grad=True)).sum().backward()
    fuser = model._groups[0]
    forward = [type(op).__name__ for op, _ in fuser._plan.forward_ops]
    backward = [type(op).__name__ for op, _ in fuser._plan.backward_ops]
    assert forward == ["LayerNorm", "LinearBiasActivation", "LinearBiasActivation"]
    assert backward == ["LayerNorm", "BasicLinear", "ActivationBiasGrad", "BasicLinear", "Bias"]


def test_chain_is_one_autograd_node():
    model = CHAINS["ln_mlp_gelu"]()
    x = torch.randn(4, 64, requires_grad=True)
    out = model(x)
    assert type(out.grad_fn).__name__ == "_FuserFunctionBackward"
    # Its inputs: x and the six parameters, nothing in between.
    assert len(out.grad_fn.next_functions) == 1 + 6



def test_create_graph_gives_first_order_gradients_and_refuses_a_second_backward():
    """backward(create_graph=True) runs the once-differentiable path: the same gradients as a plain
    backward, and a clear error, not silent zeros, when they are differentiated again."""
    model = CHAINS["ln_mlp_gelu"]()
    x = torch.randn(4, 64, requires_grad=True)
    (expected,) = torch.autograd.grad(model(x).square().sum(), x)
    # square() makes the gradient reaching the chain itself require grad under create_graph.
    (grad,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
    assert torch.equal(grad, expected)
    assert grad.requires_grad
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad.sum().backward()

@pytest.mark.parametrize("fp8_recipe", [None, recipe.Float8CurrentScaling()])
def test_no_grad_runs_the_chain_without_an_autograd_function(monkeypatch, fp8_recipe):
    """Under torch.no_grad the chain runs its ops directly (an autograd Function's call is most of a
    small layer's cost), with the same values as with grad on, and without the FP8 transposes that
    only a weight gradient reads."""
    from te_fuser.ops import fuser as fuser_module
    from te_fuser.ops import _fp8_io

    model = CHAINS["ln_mlp_gelu"]()
    x = torch.randn(16, 64)

    def fp8():
        return te_fuser.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe)

    expected, out, transposes = run_with_and_without_grad(
        monkeypatch, fuser_module._FuserFunction, (_fp8_io, "columnwise_bytes"), fp8, lambda: model(x))
    assert out.grad_fn is None and not out.requires_grad
    assert torch.equal(out, expected)
    assert not transposes


def test_make_extra_output_returns_the_tensor_and_adds_its_gradient():
    """Sequential returns (output, extra); the extra output's gradient joins the chain's, all in
    one autograd node."""
    torch.manual_seed(0)
    model = ops.Sequential(ops.RMSNorm(16), ops.MakeExtraOutput(), ops.BasicLinear(16, 32), ops.ReLU())
    _randomize(model)
    x = torch.randn(8, 16, requires_grad=True)
    out, extra = model(x)
    assert out.grad_fn is extra.grad_fn and type(out.grad_fn).__name__ == "_FuserFunctionBackward"
    dy, dextra = torch.randn(8, 32), torch.randn(8, 16)
    torch.autograd.backward([out, extra], [dy, dextra])
    x64, w64, lw64 = (t.detach().double().requires_grad_() for t in (x, model[2].weight, model[0].weight))
    ln = F.rms_norm(x64, (16,), lw64, model[0].eps)
    ref = F.relu(F.linear(ln, w64))
    torch.autograd.backward([ref, ln], [dy.double(), dextra.double()])
    torch.testing.assert_close(extra.double(), ln, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    for got, expect in [(x.grad, x64.grad), (model[2].weight.grad, w64.grad), (model[0].weight.grad, lw64.grad)]:
        torch.testing.assert_close(got.double(), expect, rtol=1e-5, atol=1e-5)


def test_non_ops_modules_split_the_chain():
    model = ops.Sequential(ops.BasicLinear(8, 8), torch.nn.Tanh(), ops.BasicLinear(8, 8))
    x = torch.randn(2, 8)
    ref = F.linear(torch.tanh(F.linear(x, model[0].weight)), model[2].weight)
    torch.testing.assert_close(model(x), ref)
    assert len(model._groups) == 3


def test_plan_cache_refound_only_on_key_change():
    model = CHAINS["ln_mlp_gelu"]()
    x = torch.randn(16, 64, requires_grad=True)
    for _ in range(3):
        model(x)
    fuser = model._groups[0]
    assert fuser.plans_built == 1
    model[1].weight.requires_grad_(False)
    model(x)
    assert fuser.plans_built == 2
    model(x)
    assert fuser.plans_built == 2


@pytest.mark.parametrize("fp8_recipe, expect_fp8_input", [
    (recipe.DelayedScaling(), True),        # scale known ahead: producers emit FP8 directly
    (recipe.Float8CurrentScaling(), False),  # scale needs the output: the linear quantizes
])
def test_fp8_handover_between_ops(monkeypatch, fp8_recipe, expect_fp8_input):
    seen, seen_grads = [], []
    original = BasicLinear.forward_gemm
    original_backward = BasicLinear.op_backward

    def spy(self, ctx, x, *args):
        seen.append(isinstance(x, Float8Tensor))
        return original(self, ctx, x, *args)

    def spy_backward(self, ctx, grad_output):
        seen_grads.append(isinstance(grad_output, Float8Tensor))
        return original_backward(self, ctx, grad_output)

    monkeypatch.setattr(BasicLinear, "forward_gemm", spy)
    monkeypatch.setattr(BasicLinear, "op_backward", spy_backward)
    model = CHAINS["ln_mlp_gelu"]()
    x = torch.randn(32, 64, requires_grad=True)
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        out = model(x)
    out.sum().backward()
    # LayerNorm -> first linear and Bias+GELU -> second linear.
    assert seen == [expect_fp8_input, expect_fp8_input]
    # Backward: the second linear's dgrad is high precision (the Bias after it takes it),
    # the one-pass dGELU+dbias kernel writes E5M2 for the first linear.
    assert seen_grads == [False, expect_fp8_input]


@pytest.mark.parametrize("fp8_recipe", [recipe.DelayedScaling(), recipe.Float8CurrentScaling()])
def test_fp8_chain_close_to_high_precision(fp8_recipe):
    model = CHAINS["ln_mlp_gelu"]()
    _randomize(model)
    x = torch.randn(32, 64, requires_grad=True)
    ref = model(x)
    ref.sum().backward()
    ref_grad = x.grad.clone()
    x.grad = None
    for _ in range(2):  # the second step runs with delayed scales from the first
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            out = model(x)
        x.grad = None
        out.sum().backward()
    # Two E4M3 GEMMs (2^-4 relative per operand) and E5M2 gradients (2^-3): a few percent in norm.
    assert (out - ref).norm() / ref.norm() < 0.08
    assert (x.grad - ref_grad).norm() / ref_grad.norm() < 0.15


def test_quantize_op_rounds_to_fp8_only_under_autocast():
    model = ops.Sequential(ops.Quantize())
    x = torch.randn(4, 16)
    assert torch.equal(model(x), x)
    with te_fuser.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        y = model(x)
    scale = 448.0 / x.abs().max()
    torch.testing.assert_close(y, (x * scale).to(torch.float8_e4m3fn).float() / scale, rtol=1e-6, atol=1e-7)


def test_compile_fullgraph_forward_and_backward():
    model = ops.Sequential(ops.RMSNorm(32), ops.BasicLinear(32, 64), ops.Bias(64), ops.GELU(),
                           ops.BasicLinear(64, 32))
    x = torch.randn(8, 32, requires_grad=True)
    eager = model(x)
    eager.sum().backward()
    eager_grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager)
    for a, b in zip([x.grad] + [p.grad for p in model.parameters()], eager_grads):
        torch.testing.assert_close(a, b)


def test_bad_inputs():
    model = CHAINS["ln_mlp_gelu"]()
    with pytest.raises(ValueError, match="last dimension must be 64"):
        model(torch.randn(4, 63))
    with pytest.raises(TypeError):
        model(torch.randn(4, 64, dtype=torch.float64))
    with pytest.raises(TypeError, match="BasicOperations"):
        ops.OperationFuser([torch.nn.ReLU()])
    linear = ops.Sequential(ops.BasicLinear(8, 4))
    with pytest.raises(ValueError, match="in_features = 8"):
        linear(torch.randn(2, 9))
    with pytest.raises(TypeError, match="dtype"):
        linear(torch.randn(2, 8, dtype=torch.bfloat16))


def test_delayed_scaling_backward_state_is_e5m2_with_its_own_scale(monkeypatch):
    """HYBRID under DelayedScaling: gradients in E5M2, scaled by the backward state from the
    gradient amax of the step before (scale = E5M2 max / amax, margin 0)."""
    handed = []
    original_backward = BasicLinear.op_backward

    def spy_backward(self, ctx, grad_output):
        if isinstance(grad_output, Float8Tensor):
            handed.append((grad_output.fp8_dtype, grad_output.fp8_data.dtype, grad_output._scale_inv.item()))
        return original_backward(self, ctx, grad_output)

    monkeypatch.setattr(BasicLinear, "op_backward", spy_backward)
    model = CHAINS["ln_mlp_gelu"]()
    _randomize(model)
    x = torch.randn(32, 64, requires_grad=True)
    dy = torch.randn(32, 64)
    with te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        out = model(x)
    out.backward(dy)
    state = model[1]._fp8_states[1]  # the first linear's backward state: the gradient at its output
    assert state.fp8_dtype == torch.float8_e5m2
    # Independent reference for that gradient's amax: the chain in float64 (FP8 forward: within 10%).
    with torch.no_grad():
        z = F.linear(F.layer_norm(x.double(), (64,), model[0].weight.double(), model[0].bias.double()),
                     model[1].weight.double()) + model[2].bias.double()
    z.requires_grad_()
    y = F.linear(F.gelu(z, approximate="tanh"), model[4].weight.double()) + model[5].bias.double()
    y.backward(dy.double())
    recorded = state.amax_history[-1, 0].item()  # rolled in at the end of the backward, as TE does
    assert recorded == pytest.approx(z.grad.abs().max().item(), rel=0.1)
    assert state.scale.item() == pytest.approx(torch.finfo(torch.float8_e5m2).max / recorded, rel=1e-6)

    with te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        out = model(x)
    out.backward(dy)  # casts the gradient with that scale
    assert handed and handed[-1][:2] == (torch.float8_e5m2, torch.float8_e5m2)
    assert handed[-1][2] == pytest.approx(recorded / torch.finfo(torch.float8_e5m2).max, rel=1e-6)
