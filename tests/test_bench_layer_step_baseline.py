"""benchmarks/bench_layer_step.py's PlainLlamaLayer is te_fuser's TransformerLayer (RMSNorm, GQA, RoPE,
SwiGLU, causal) written in plain PyTorch: given the same weights both give the same output and input
gradient in float32. Baselines that differ (SwiGLU gating the other half, RoPE not applied to k, no
causal mask) are run through the same comparison and must fail it."""

import argparse
import contextlib
import importlib.util
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import te_fuser

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_layer_step.py"
_spec = importlib.util.spec_from_file_location("bench_layer_step", _BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

ARGS = argparse.Namespace(hidden=96, heads=6, groups=2, ffn=80, seq=20, batch=2)


def far_from_init(module, generator):
    """Weights of std 0.2 and norm weights around 1, so every nonlinearity works in its curved part."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            draw = torch.randn(p.shape, generator=generator) * 0.2
            p.copy_(draw + 1.0 if name.endswith("layer_norm_weight") else draw)


def outputs(forward, x, grad):
    x.grad = None
    out = forward(x)
    out.backward(grad)
    return out.detach().clone(), x.grad.clone()


def compare(patch=contextlib.nullcontext):
    """te_fuser's layer against the plain one (built and run under `patch`), same weights and inputs."""
    generator = torch.Generator().manual_seed(7)
    te_layer = bench.make_te_layer(ARGS, torch.device("cpu"), torch.float32)
    far_from_init(te_layer, generator)
    plain = bench.PlainLlamaLayer(te_layer, ARGS.heads, ARGS.groups)
    angles = bench.rope_angles(ARGS.seq, ARGS.hidden // ARGS.heads, "cpu")
    x = torch.randn(ARGS.batch, ARGS.seq, ARGS.hidden, generator=generator, requires_grad=True)
    grad = torch.randn(x.shape, generator=generator)
    te_out, te_dx = outputs(lambda t: te_layer(t, rotary_pos_emb=angles), x, grad)
    with patch():
        plain_out, plain_dx = outputs(lambda t: plain(t, angles), x, grad)
    torch.testing.assert_close(plain_out, te_out, rtol=1e-4, atol=2e-4)
    torch.testing.assert_close(plain_dx, te_dx, rtol=1e-4, atol=2e-4)


def test_plain_layer_is_te_fusers_layer():
    compare()


def _swiglu_gating_the_other_half():
    chunk = torch.Tensor.chunk
    return mock.patch.object(torch.Tensor, "chunk", lambda t, n, dim=0: chunk(t, n, dim)[::-1])


def _rope_on_q_only():
    rope, calls = bench.apply_rope, []

    def q_only(t, angles):  # the forward rotates q, then k
        calls.append(t)
        return rope(t, angles) if len(calls) % 2 == 1 else t
    return mock.patch.object(bench, "apply_rope", q_only)


def _attention_without_causal_mask():
    sdpa = F.scaled_dot_product_attention
    return mock.patch.object(bench.F, "scaled_dot_product_attention",
                             lambda *a, is_causal=False, **kw: sdpa(*a, is_causal=False, **kw))


@pytest.mark.parametrize("patch", [_swiglu_gating_the_other_half, _rope_on_q_only, _attention_without_causal_mask])
def test_a_different_baseline_fails_the_comparison(patch):
    with pytest.raises(AssertionError):
        compare(patch)


@pytest.mark.parametrize("recipe_name", ["none", "delayed"])
def test_graphed_row_steps_like_the_eager_row(recipe_name):
    """--graphed times a graphed copy of the layer: two steps give the eager layer's output and input
    gradient (on the CPU the graphed callable runs eagerly), and the layer the other rows time keeps its
    own forward."""
    args = argparse.Namespace(hidden=96, heads=6, groups=2, ffn=80, seq=24, batch=2)  # FP8: 48 tokens
    generator = torch.Generator().manual_seed(3)
    te_layer = bench.make_te_layer(args, torch.device("cpu"), torch.float32)
    far_from_init(te_layer, generator)
    angles = bench.rope_angles(args.seq, args.hidden // args.heads, "cpu")
    x = torch.randn(args.batch, args.seq, args.hidden, generator=generator, requires_grad=True)
    graphed = bench.graphed_forward(recipe_name, te_layer, x, angles)
    assert "forward" not in te_layer.__dict__
    fp8 = recipe_name != "none"
    fp8_recipe = bench.RECIPES[recipe_name]() if fp8 else None

    def eager(t):
        with te_fuser.autocast(enabled=fp8, recipe=fp8_recipe):
            return te_layer(t, rotary_pos_emb=angles)

    for _ in range(2):
        grad = torch.randn(x.shape, generator=generator)
        graphed_out, graphed_dx = outputs(graphed, x, grad)
        eager_out, eager_dx = outputs(eager, x, grad)
        assert torch.equal(graphed_out, eager_out) and torch.equal(graphed_dx, eager_dx)
