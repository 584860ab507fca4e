"""te_fuser.jit (TE's `pytorch.jit` helpers): the tanh-GELU, L2-normalization and bias-dropout-add functions
against float64 torch and autograd, TE's decorators, and the warm-ups leaving the RNG as they found it."""

import math

import pytest
import torch

from te_fuser import jit


def tanh_gelu64(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU in float64 with exact constants."""
    x = x.double()
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x.pow(3))))


def edge_values(*shape) -> torch.Tensor:
    x = torch.randn(*shape) * 4
    x.view(-1)[:4] = torch.tensor([0.0, -0.0, 30.0, -30.0])
    return x


def test_gelu_and_bias_gelu_match_float64():
    x, bias = edge_values(8, 16), torch.randn(16)
    torch.testing.assert_close(jit.gelu_fused_(x), tanh_gelu64(x).float())
    torch.testing.assert_close(jit.bias_gelu_fused_(x, bias), tanh_gelu64(x + bias).float())
    torch.testing.assert_close(jit.bias_gelu_fused(x, bias), tanh_gelu64(x + bias).float())
    for no_bias in (None, torch.empty(0)):
        torch.testing.assert_close(jit.bias_gelu_fused(x, no_bias), tanh_gelu64(x).float())


def test_gelu_gradients_match_float64_autograd():
    x, bias, dy = edge_values(8, 16), torch.randn(16), torch.randn(8, 16)
    x64 = (x + bias).double().requires_grad_()
    tanh_gelu64(x64).backward(dy.double())
    torch.testing.assert_close(jit.dgelu_fused_(dy, x + bias), x64.grad.float())
    bgrad, dgelu = jit.bgrad_dgelu_fused_(dy, x, bias)
    torch.testing.assert_close(dgelu, x64.grad.float())
    torch.testing.assert_close(bgrad, x64.grad.sum(0).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(jit.bgrad_dgelu_fused(dy, x, bias)[0], bgrad)
    no_bias_grad, dgelu = jit.bgrad_dgelu_fused(dy, x + bias, None)
    assert no_bias_grad is None
    torch.testing.assert_close(dgelu, x64.grad.float())


@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_l2normalization_matches_float64_autograd(eps):
    x = torch.randn(6, 3, 32)
    x[0, 0] = 0.0  # a zero row: eps keeps it finite
    x64 = x.double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.square().sum(-1, keepdim=True) + eps)
    dy = torch.randn_like(x)
    y64.backward(dy.double())
    torch.testing.assert_close(jit.l2normalization_fused(x, eps), y64.detach().float())
    y, rsqrt_norm = jit.l2normalization_fwd_fused(x, eps)
    torch.testing.assert_close(y, y64.detach().float())
    assert rsqrt_norm.shape == (6, 3, 1)
    torch.testing.assert_close(rsqrt_norm, torch.rsqrt(x.double().square().sum(-1, keepdim=True) + eps).float())
    torch.testing.assert_close(jit.l2normalization_backward_fused(dy, x, rsqrt_norm, eps), x64.grad.float(),
                               rtol=1e-5, atol=1e-5)


def test_bias_dropout_add():
    x, bias, residual = torch.randn(4, 2, 8), torch.randn(8), torch.randn(4, 2, 8)
    torch.testing.assert_close(jit.bias_dropout_add_fused_inference(x, bias, residual, 0.9), residual + (x + bias))
    torch.testing.assert_close(jit.get_bias_dropout_add(False)(x, bias, residual, 0.9), residual + (x + bias))
    torch.testing.assert_close(jit.bias_dropout_add_fused_train(x, bias, residual, 0.0), residual + (x + bias))
    generator_state = torch.get_rng_state()
    out = jit.bias_dropout_add_fused_train(x, bias, residual, 0.5)
    torch.set_rng_state(generator_state)
    expected = residual + torch.nn.functional.dropout(x + bias, p=0.5, training=True)
    torch.testing.assert_close(out, expected)
    kept = out != residual
    torch.testing.assert_close(out[kept], (residual + 2 * (x + bias))[kept])
    assert 0 < kept.sum() < kept.numel()


def test_bias_dropout_add_train_enables_grad():
    x = torch.randn(3, 4, requires_grad=True)
    with torch.no_grad():
        out = jit.bias_dropout_add_fused_train(x, torch.zeros(4), torch.zeros(3, 4), 0.0)
    assert out.requires_grad


@pytest.mark.parametrize("warmup,args", [
    (jit.warmup_jit_bias_dropout_add_all_dtypes, (8, 3, 2)),
    (jit.warmup_jit_bias_gelu_all_dtypes, (8, 3, 2)),
    (jit.warmup_jit_l2normalization_all_dtypes, (8, 3, 2)),
])
def test_warmups_run_and_keep_the_rng_state(warmup, args):
    state = torch.get_rng_state()
    warmup(*args)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("warmup,name", [(jit.warmup_jit_bias_dropout_add, "hidden_size"),
                                         (jit.warmup_jit_bias_gelu, "ffn_hidden_size_per_partition"),
                                         (jit.warmup_jit_l2normalization, "hidden_size")])
def test_warmup_sizes_are_checked(warmup, name):
    with pytest.raises(ValueError, match=name):
        warmup(0, torch.float32, 3, 2)
    with pytest.raises(ValueError, match="micro_batch_size"):
        warmup(8, torch.float32, 3, 2.0)


def test_lazy_compile_compiles_on_the_first_call_only(monkeypatch):
    compiled = []

    def fake_compile(func):
        compiled.append(func)
        return lambda *args: func(*args) + 1

    monkeypatch.setattr(torch, "compile", fake_compile)
    wrapped = jit.lazy_compile(lambda a: a * 2)
    assert compiled == []
    assert wrapped(3) == 7 and wrapped(4) == 9
    assert len(compiled) == 1


def test_no_torch_dynamo_disables_dynamo():
    for recursive in (True, False):
        f = jit.no_torch_dynamo(recursive=recursive)(lambda t: t + 1)
        assert f._torchdynamo_disable and f._torchdynamo_disable_recursive == recursive
        assert torch.equal(f(torch.ones(2)), torch.full((2,), 2.0))
    jit.set_jit_fusion_options()
