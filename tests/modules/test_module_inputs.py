"""Inputs modules meet in fine-tuning and at the edges.

- Leading ops frozen and an input that needs no gradient (a frozen embedding): those ops saved
  nothing for a gradient, so backward must stop before them. References: the same module fed an
  input that requires grad (the parameter gradients must not change, bit for bit) and float64 torch
  math for the trainable weights.
- A 0-d input: a clear error, not an IndexError from deep inside an op.
- No device= given: TE's default, the current CUDA device where there is one, else the CPU.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import te_fuser
from te_fuser import recipe


def _layernorm_linear():
    return te_fuser.LayerNormLinear(32, 48), ("layer_norm_weight", "layer_norm_bias")


def _rmsnorm_linear():
    return te_fuser.LayerNormLinear(32, 48, normalization="RMSNorm"), ("layer_norm_weight",)


def _layernorm_mlp_fc2_only():
    return te_fuser.LayerNormMLP(32, 64), ("layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias")


def _gelu_then_linear():
    return te_fuser.ops.Sequential(te_fuser.ops.GELU(), te_fuser.ops.BasicLinear(32, 48)), ()


def _swiglu_then_linear():
    return te_fuser.ops.Sequential(te_fuser.ops.SwiGLU(), te_fuser.ops.BasicLinear(16, 48)), ()


MODULES = {"layernorm_linear": _layernorm_linear, "rmsnorm_linear": _rmsnorm_linear,
           "layernorm_mlp_fc2_only": _layernorm_mlp_fc2_only, "gelu_then_linear": _gelu_then_linear,
           "swiglu_then_linear": _swiglu_then_linear}


def _step(module, x, fp8):
    context = te_fuser.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()) if fp8 else contextlib.nullcontext()
    with context:
        out = module(x)
    out.float().square().sum().backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("fp8", [False, True], ids=["high_precision", "fp8"])
@pytest.mark.parametrize("name", sorted(MODULES))
def test_frozen_leading_ops_and_an_input_without_grad(name, fp8):
    torch.manual_seed(21)
    module, frozen = MODULES[name]()
    for param_name in frozen:
        getattr(module, param_name).requires_grad_(False)
    x = torch.randn(16, 32)
    grads = _step(module, x, fp8)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert set(grads) == trainable
    # The same step with an input that wants its gradient: the parameter gradients are the same bits.
    assert torch.equal(torch.cat([g.flatten() for g in grads.values()]),
                       torch.cat([g.flatten() for g in _step(module, x.clone().requires_grad_(), fp8).values()]))


def test_frozen_layernorm_linear_weight_grad_against_float64():
    torch.manual_seed(22)
    module = te_fuser.LayerNormLinear(32, 48)
    module.layer_norm_weight.requires_grad_(False)
    module.layer_norm_bias.requires_grad_(False)
    with torch.no_grad():
        module.layer_norm_weight.uniform_(0.5, 1.5)
        module.layer_norm_bias.uniform_(-0.5, 0.5)
    x = torch.randn(16, 32)
    module(x).square().sum().backward()
    w = module.weight.detach().double().requires_grad_()
    b = module.bias.detach().double().requires_grad_()
    normed = F.layer_norm(x.double(), (32,), module.layer_norm_weight.double(), module.layer_norm_bias.double(),
                          eps=module.eps)
    F.linear(normed, w, b).square().sum().backward()
    torch.testing.assert_close(module.weight.grad.double(), w.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(module.bias.grad.double(), b.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", [lambda: te_fuser.Linear(4, 3), lambda: te_fuser.LayerNormLinear(4, 3),
                                  lambda: te_fuser.LayerNormMLP(4, 8), lambda: te_fuser.LayerNorm(4),
                                  lambda: te_fuser.RMSNorm(4)])
def test_a_0d_input_is_refused_clearly(make):
    with pytest.raises(ValueError, match="input must have at least one dimension"):
        make()(torch.tensor(1.0))


@pytest.mark.te_default_device
@pytest.mark.parametrize("build", [lambda: te_fuser.Linear(8, 4), lambda: te_fuser.LayerNormLinear(8, 4),
                                   lambda: te_fuser.LayerNormMLP(8, 16)])
def test_default_device_follows_te(build):
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert {p.device for p in build().parameters()} == {expected}
