"""assert_no_leak: growth detection, the readable report, clean steps passing."""

import pytest
import torch
from memory_patterns import StageFunction

from te_fuser.memory import assert_no_leak


def _stage_step(kept):
    w = torch.randn(64, 64, requires_grad=True)

    def step():
        loss = StageFunction.apply(torch.randn(32, 64), w)
        loss.backward()
        if kept is not None:
            kept.append(loss)  # the seed-002 bug: the loss keeps its grad_fn and ctx.context

    return step


def test_leaking_step_fails_with_a_report_naming_the_survivors():
    step = _stage_step([])
    with pytest.raises(AssertionError) as info:
        assert_no_leak(step, iterations=4, warmup=1)
    text = str(info.value)
    # 16 KiB per iteration: ctx.context keeps the [32x64] float32 input and hidden activation
    assert text.startswith("memory leak in step: torch memory grew 16.0 KiB per iteration over 4 iterations")
    assert "alive after each iteration: 16.0 KiB, 32.0 KiB, 48.0 KiB, 64.0 KiB" in text
    assert "8 x Tensor [32x64] torch.float32 cpu storage 8.0 KiB, grad_fn=None" in text
    assert "4 x Tensor [scalar] torch.float32 cpu storage 4 B, grad_fn=StageFunctionBackward" in text
    assert "autograd nodes reachable from 4 of them: 4 x StageFunctionBackward, 1 x AccumulateGrad" in text
    assert "4 x StageFunctionBackward.context: 16.0 KiB in 2 tensor(s)" in text
    assert "context['hidden']  [32x64] torch.float32 cpu storage 8.0 KiB" in text


def test_clean_step_passes_and_returns_the_samples():
    report = assert_no_leak(_stage_step(None), iterations=3)
    assert not report.leaked and report.samples == (0, 0, 0) and report.growth_per_iteration == 0


def test_tolerance_accepts_small_growth():
    kept = []

    def step():
        kept.append(torch.empty(256))  # 1 KiB per iteration

    with pytest.raises(AssertionError, match="grew 1.0 KiB per iteration"):
        assert_no_leak(step, iterations=3)
    assert assert_no_leak(step, iterations=3, tolerance="1 KiB").growth_per_iteration == 1024


def test_bounded_state_replaced_each_iteration_is_not_a_leak():
    state = {}

    def step():
        state["last"] = torch.randn(1024)  # one buffer alive at a time

    assert assert_no_leak(step, iterations=4).samples == (4096,) * 4


def test_argument_checks():
    with pytest.raises(ValueError, match="at least 2"):
        assert_no_leak(lambda: None, iterations=1)
    with pytest.raises(ValueError, match="size must be"):
        assert_no_leak(lambda: None, tolerance="a lot")
