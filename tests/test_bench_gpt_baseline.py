"""benchmarks/bench_gpt.py's PlainGPT is te_fuser's example GPT written in plain PyTorch: given the same
weights, both give the same logits, loss and gradients (float32), and the same loss to bf16 tolerance.
The comparison catches a baseline that differs (exact instead of tanh GELU, attention without the
causal mask): those mutants are run through the same check and must fail it."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from te_fuser.examples.gpt import GPT, GPTConfig

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpt.py"
_spec = importlib.util.spec_from_file_location("bench_gpt", _BENCH)
bench_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_gpt)

# Odd sizes, and a sequence shorter than the position table (the forward slices it).
CFG = GPTConfig(vocab_size=256, seq_len=40, hidden_size=48, num_heads=4, num_layers=2, ffn_hidden_size=80)
SEQ, BATCH = 24, 3


def random_weights(model, generator):
    """Weights far from the default initialization, so that every nonlinearity works in its curved part:
    matrices of std 0.3 (pre-activations of order 1), norm weights around 1, biases of std 0.3."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            draw = torch.randn(p.shape, generator=generator) * 0.3
            p.copy_(draw + 1.0 if ("norm" in name or "mlp.0." in name) and name.endswith("weight") else draw)


def make_pair(generator, dtype):
    te_model = GPT(CFG, dtype=dtype)
    random_weights(te_model, generator)
    plain = bench_gpt.PlainGPT(CFG, dtype=dtype)
    bench_gpt.copy_te_weights(plain, te_model)
    return te_model, plain


def loss_and_grads(model, tokens, targets):
    loss = F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_same_step(te_model, plain, tokens, targets, rtol, atol):
    te_loss, te_grads = loss_and_grads(te_model, tokens, targets)
    plain_loss, plain_grads = loss_and_grads(plain, tokens, targets)
    torch.testing.assert_close(plain_loss, te_loss, rtol=rtol, atol=atol)
    for name, grad in te_grads.items():
        torch.testing.assert_close(plain_grads[bench_gpt.plain_name(name)], grad, rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")


def batch(generator):
    tokens = torch.randint(0, CFG.vocab_size, (SEQ, BATCH), generator=generator)
    tokens[0, 0], tokens[-1, -1] = 0, CFG.vocab_size - 1  # the first and the last embedding row
    targets = torch.randint(0, CFG.vocab_size, (SEQ, BATCH), generator=generator)
    return tokens, targets


def test_same_parameter_count_and_names(generator):
    te_model, plain = make_pair(generator, torch.float32)
    assert bench_gpt.param_count(plain) == bench_gpt.param_count(te_model)
    assert {bench_gpt.plain_name(n) for n, _ in te_model.named_parameters()} == {n for n, _ in plain.named_parameters()}


def test_same_loss_and_gradients_fp32(generator):
    te_model, plain = make_pair(generator, torch.float32)
    assert_same_step(te_model, plain, *batch(generator), rtol=1e-4, atol=1e-5)


def test_same_loss_bf16(generator):
    te_model, plain = make_pair(generator, torch.bfloat16)
    tokens, targets = batch(generator)
    te_loss, _ = loss_and_grads(te_model, tokens, targets)
    plain_loss, _ = loss_and_grads(plain, tokens, targets)
    torch.testing.assert_close(plain_loss, te_loss, rtol=1e-2, atol=0.0)


def _exact_gelu(plain):
    for block in plain.blocks:
        block.mlp[2] = torch.nn.GELU()


def _no_causal_mask(plain, monkeypatch):
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, is_causal: sdpa(q, k, v, is_causal=False))


@pytest.mark.parametrize("mutant", ["exact_gelu", "no_causal_mask"])
def test_the_check_catches_a_different_architecture(generator, monkeypatch, mutant):
    te_model, plain = make_pair(generator, torch.float32)
    if mutant == "exact_gelu":
        _exact_gelu(plain)
    else:
        _no_causal_mask(plain, monkeypatch)
    with pytest.raises(AssertionError):
        assert_same_step(te_model, plain, *batch(generator), rtol=1e-4, atol=1e-5)


def test_copy_rejects_a_different_model():
    te_model = GPT(GPTConfig(**{**CFG.__dict__, "ffn_hidden_size": 96}))
    with pytest.raises(ValueError, match="mlp.1.weight: PlainGPT has shape"):
        bench_gpt.copy_te_weights(bench_gpt.PlainGPT(CFG), te_model)
    deeper = GPT(GPTConfig(**{**CFG.__dict__, "num_layers": 3}))
    with pytest.raises(ValueError, match="only in te_fuser's GPT.*blocks.2"):
        bench_gpt.copy_te_weights(bench_gpt.PlainGPT(CFG), deeper)
