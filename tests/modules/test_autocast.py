"""torch.autocast in te_fuser's modules, as in TransformerEngine: inside torch.autocast(device, dtype) a
module computes in dtype -- input and parameters cast to it, output in it -- FP8 runs inside autocast
with the weights quantized from the parameters themselves, and float32 parameters get float32
gradients. References: float64 torch on the input and parameters rounded to dtype (what the module
computes with), torch's own autocast nn.Linear, and torch's float8 casts."""

import pytest
import torch
import torch.nn.functional as F

import te_fuser
from te_fuser.recipe import DelayedScaling, Float8CurrentScaling

import layer_reference as ref
from _module_checks import assert_close64

H, FFN, HEADS, SEQ, BATCH = 64, 128, 4, 16, 2
EPS = 1e-5
RECIPES = {"bf16": None, "delayed": DelayedScaling(), "current": Float8CurrentScaling()}
# Relative error (norm of the difference over the norm of the reference) against float64 on the
# rounded operands: bf16 results and bf16 GEMM operands (seen: < 5e-3); FP8 operands, E4M3 forward and
# E5M2 gradients (seen: < 4e-2 forward, < 1.1e-1 gradients).
NO_GEMMS = ("LayerNorm", "RMSNorm", "DotProductAttention")  # nothing in FP8 without fp8_dpa
TOL = {"bf16": (1, 1), "fp8": (1, 1)}


def _heads(t):
    return t.unflatten(-1, (HEADS, H // HEADS))


def _qkv(x):
    """Three different [s, b, h, d] tensors from one [s, b, H] input (views and copies, differentiable)."""
    return _heads(x), _heads(x.flip(-1)), _heads(x.roll(1, dims=-1))


def _dpa_reference(module, x, P):
    del module, P
    q, k, v = (t.transpose(0, 1) for t in _qkv(x))
    return ref.attention(q, k, v, causal=True).transpose(0, 1).flatten(-2)


def _grouped_reference(module, x, P):
    del module
    rows = x.reshape(-1, H).split([SEQ, SEQ])
    return torch.cat([F.linear(xi, P[f"weight{i}"], P[f"bias{i}"]) for i, xi in enumerate(rows)])


def _mha():
    return te_fuser.MultiheadAttention(H, HEADS, attention_dropout=0.0, input_layernorm=True, fuse_qkv_params=True)


def _transformer_layer():
    return te_fuser.TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, fuse_qkv_params=True)


def _call(m, x):
    return m(x)


# name -> (module factory, forward(module, x), float64 reference(module, x, params))
CASES = {
    "Linear": (lambda: te_fuser.Linear(H, 48), _call, lambda m, x, P: F.linear(x, P["weight"], P["bias"])),
    "LayerNormLinear": (lambda: te_fuser.LayerNormLinear(H, 48, normalization="RMSNorm"), _call,
                        lambda m, x, P: F.linear(ref.norm(x, P, "", "RMSNorm", EPS), P["weight"], P["bias"])),
    "LayerNormMLP": (lambda: te_fuser.LayerNormMLP(H, FFN), _call, lambda m, x, P: sum(ref.mlp(m, x, P=P)[:2])),
    "GroupedLinear": (lambda: te_fuser.GroupedLinear(2, H, 48), lambda m, x: m(x.reshape(-1, H), [SEQ, SEQ]),
                      _grouped_reference),
    "LayerNorm": (lambda: te_fuser.LayerNorm(H), _call, lambda m, x, P: ref.norm(x, P, None, "LayerNorm", EPS)),
    "RMSNorm": (lambda: te_fuser.RMSNorm(H), _call, lambda m, x, P: ref.norm(x, P, None, "RMSNorm", EPS)),
    "DotProductAttention": (lambda: te_fuser.DotProductAttention(HEADS, H // HEADS, attn_mask_type="causal"),
                            lambda m, x: m(*_qkv(x)), _dpa_reference),
    "MultiheadAttention": (_mha, _call, lambda m, x, P: sum(ref.mha(m, x, P=P)[:2])),
    "TransformerLayer": (_transformer_layer, _call, lambda m, x, P: ref.transformer_layer(m, x, P=P)),
}


def _rounded64(t, dtype):
    return t.detach().to(dtype).double().requires_grad_()


def _fp8_ran(module) -> bool:
    return any(op._fp8_enabled for m in module.modules() for op in getattr(m, "_ops", ()))


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("name", list(CASES))
def test_module_computes_in_the_autocast_dtype(name, recipe, generator):
    make, forward, reference = CASES[name]
    module = make()
    with torch.no_grad():  # parameters away from their initial 1s and 0s, so that their casts matter
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.2)
    x = torch.randn(SEQ, BATCH, H, generator=generator, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), te_fuser.fp8_autocast(enabled=RECIPES[recipe] is not None,
                                                                            fp8_recipe=RECIPES[recipe]):
        out = forward(module, x)
    assert out.dtype == torch.bfloat16
    assert _fp8_ran(module) == (RECIPES[recipe] is not None and name not in NO_GEMMS)
    dy = torch.randn(out.shape, generator=generator).to(torch.bfloat16)
    out.backward(dy)
    assert x.grad.dtype == torch.float32
    params = dict(module.named_parameters())
    assert all(p.grad.dtype == torch.float32 for p in params.values())

    x64 = _rounded64(x, torch.bfloat16)
    P = {n: _rounded64(p, torch.bfloat16) for n, p in params.items()}
    out64 = reference(module, x64, P)
    grads64 = torch.autograd.grad((out64 * dy.double()).sum(), [x64, *P.values()])
    out_tol, grad_tol = TOL["bf16" if recipe == "bf16" else "fp8"]
    assert_close64("output", out, out64, out_tol)
    for label, got, want in zip(["input", *params], [x.grad, *(p.grad for p in params.values())], grads64):
        assert_close64(f"{label} grad", got.to(torch.bfloat16), want, grad_tol)


def test_linear_matches_torch_linear_under_autocast(generator):
    """Against torch's own nn.Linear under the same autocast: same output and gradients, same dtypes."""
    layer = te_fuser.Linear(H, 48)
    torch_layer = torch.nn.Linear(H, 48)
    with torch.no_grad():
        torch_layer.weight.copy_(layer.weight)
        torch_layer.bias.copy_(torch.randn(48, generator=generator))
        layer.bias.copy_(torch_layer.bias)
    x = torch.randn(SEQ, H, generator=generator)
    dy = torch.randn(SEQ, 48, generator=generator).to(torch.bfloat16)
    results = []
    for module in (layer, torch_layer):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(xi)
        out.backward(dy)
        results.append((out, xi.grad, module.weight.grad, module.bias.grad))
    for got, want in zip(*results):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_quantizes_the_float32_weight_not_its_bf16_copy(recipe):
    """TE quantizes the parameter itself under autocast. One-hot inputs read the FP8 weight back exactly;
    one entry is placed where float32 -> E4M3 and float32 -> bf16 -> E4M3 round differently."""
    layer = te_fuser.Linear(32, 32, bias=False)
    with torch.no_grad():
        layer.weight.uniform_(-2.0, 2.0)
        layer.weight[0, 0] = 448.0  # amax: the current scale is 1
        layer.weight[1, 1] = 1.0625 + 2.0 ** -12  # direct: 1.125; through bf16: 1.0625, a tie, to 1.0
    x = torch.eye(32)[:16]
    with torch.autocast("cpu", dtype=torch.bfloat16), te_fuser.fp8_autocast(fp8_recipe=RECIPES[recipe]):
        out = layer(x)
    weight = layer.weight.detach()[:, :16].t()
    direct = weight.to(torch.float8_e4m3fn).float()
    through_bf16 = weight.to(torch.bfloat16).to(torch.float8_e4m3fn).float()
    assert not torch.equal(direct, through_bf16)  # the placed entry tells the two apart
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), direct, rtol=0, atol=0)


def test_outside_autocast_dtypes_must_match():
    """As TE outside autocast: a bf16 input to float32 parameters is refused, naming the dtypes."""
    with pytest.raises(TypeError, match="input dtype torch.bfloat16 does not match the weight dtype torch.float32"):
        te_fuser.Linear(H, 48)(torch.randn(SEQ, H).to(torch.bfloat16))
