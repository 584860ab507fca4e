"""The accumulation modes FP8 linears ask cuBLASLt for (torch._scaled_mm's use_fast_accum): fast in the
forward GEMM, a full float32 accumulator in dgrad and wgrad, as TransformerEngine sets them.

A CPU has no cuBLASLt: these tests route te_fuser's FP8 GEMMs to torch._scaled_mm (which torch also runs on
the CPU) and record each call's mode, so the plumbing is checked here and the results still come from a real
GEMM, compared with te_fuser's own CPU GEMM."""

import copy

import pytest
import torch

import te_fuser
from te_fuser.ops import gemm
from te_fuser.recipe import DelayedScaling, Float8CurrentScaling


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """Every torch._scaled_mm call's use_fast_accum, in order, with fp8_gemm_nt routed to it."""
    calls = []
    real = torch._scaled_mm

    def recording(*args, use_fast_accum=False, **kwargs):
        calls.append(use_fast_accum)
        return real(*args, use_fast_accum=use_fast_accum, **kwargs)

    monkeypatch.setattr(gemm, "runs_on_cublaslt", lambda a: True)
    monkeypatch.setattr(torch, "_scaled_mm", recording)
    return calls


def _step(module, x, recipe, dy=None):
    with te_fuser.fp8_autocast(fp8_recipe=recipe):
        y = module(x)
    y.backward(torch.randn_like(y) if dy is None else dy)
    return y.detach(), x.grad, module.weight.grad


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_linear_forward_gemm_is_fast_and_gradient_gemms_are_not(scaled_mm_calls, recipe):
    torch.manual_seed(0)
    module = te_fuser.Linear(64, 32, params_dtype=torch.bfloat16)
    x = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    _step(module, x, recipe)
    assert scaled_mm_calls == [True, False, False]  # forward, then dgrad and wgrad


def test_grouped_linear_forward_gemms_are_fast_and_gradient_gemms_are_not(scaled_mm_calls):
    torch.manual_seed(0)
    module = te_fuser.GroupedLinear(2, 64, 32, params_dtype=torch.bfloat16)
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling()):
        y = module(x, [32, 32])
    y.backward(torch.randn_like(y))
    forward, backward = scaled_mm_calls[:2], scaled_mm_calls[2:]
    assert forward == [True, True] and backward == [False] * 4


def test_results_through_scaled_mm_match_te_fusers_gemm(monkeypatch):
    """The routed GEMMs compute what te_fuser's CPU GEMM does (both sum exact FP8 products in float32), so the
    mode checks above run on real results."""
    torch.manual_seed(0)
    modules = [te_fuser.Linear(64, 32, params_dtype=torch.float32)]
    modules.append(copy.deepcopy(modules[0]))
    x, dy = torch.randn(48, 64), torch.randn(48, 32)
    runs = []
    for routed, module in zip((False, True), modules):
        if routed:
            monkeypatch.setattr(gemm, "runs_on_cublaslt", lambda a: True)
        runs.append(_step(module, x.clone().requires_grad_(), DelayedScaling(), dy))
    for own, routed in zip(*runs):
        torch.testing.assert_close(routed, own, rtol=1e-5, atol=1e-5)
