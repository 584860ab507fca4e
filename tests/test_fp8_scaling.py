"""Delayed- and current-scaling updates against a plain float32 formula."""

import pytest
import torch

from te_fuser.kernels import fp8 as k
from fp8_reference import FLT_MAX, FP8_DTYPES, fp8_max, reference_current_scale, reference_delayed_update

SPECIAL_AMAXES = [0.0, float("inf"), float("nan"), 1e-45, 1e-38, 3.5, 448.0, 1e38]


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2, -1])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_delayed_scaling_update_matches_formula(device, generator, algo, margin, fp8_dtype):
    history_len, n = 5, len(SPECIAL_AMAXES) + 6
    history = torch.rand(history_len, n, generator=generator) * 10
    scale = torch.rand(n, generator=generator) + 0.5
    state = [t.to(device, copy=True) for t in (history, scale, 1 / scale)]
    ref = [history, scale, 1 / scale]
    for step in range(7):  # more steps than the history is long: rolling wraps around
        amax = torch.rand(n, generator=generator) * 10 ** float(step - 3)
        amax[-3:] = 0.0  # tensors that recorded nothing this step (a cached weight)
        if step == 4:
            amax[: len(SPECIAL_AMAXES)] = torch.tensor(SPECIAL_AMAXES)
        state[0][0].copy_(amax)  # what the casts record: row 0
        ref[0][0] = amax
        k.delayed_scaling_update(*state, fp8_max(fp8_dtype), margin, algo)
        ref = reference_delayed_update(ref[0], ref[1], fp8_max(fp8_dtype), margin, algo)
        for got, want, name in zip(state, ref, ("amax_history", "scale", "scale_inv")):
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True, msg=name)


def test_delayed_scaling_keeps_scale_when_amax_zero_or_not_finite(device):
    for bad in (0.0, float("inf"), float("nan")):
        history = torch.full((1, 1), bad, device=device)
        scale = torch.tensor([3.0], device=device)
        k.delayed_scaling_update(history, scale, torch.ones(1, device=device), 448.0, 0, "most_recent")
        assert scale.item() == 3.0


def test_delayed_scaling_infinite_scale_becomes_flt_max(device):
    scale = torch.ones(1, device=device)
    scale_inv = torch.ones(1, device=device)
    k.delayed_scaling_update(torch.tensor([[1e-45]], device=device), scale, scale_inv, 448.0, 0, "max")
    assert scale.item() == FLT_MAX
    assert scale_inv.item() == pytest.approx(1 / FLT_MAX, rel=1e-6)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("epsilon", [0.0, 1e-3])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_current_scale_matches_formula(device, generator, pow2, epsilon, fp8_dtype):
    amaxes = SPECIAL_AMAXES + (torch.rand(20, generator=generator) * 10 ** torch.randint(-6, 6, (20,), generator=generator)).tolist()
    for a in amaxes:
        scale, scale_inv = k.current_scale(torch.tensor([a], device=device), fp8_max(fp8_dtype), epsilon, pow2)
        want = reference_current_scale(a, fp8_max(fp8_dtype), epsilon, pow2)
        torch.testing.assert_close(scale.cpu(), want, rtol=0, atol=0, msg=f"amax={a}")
        torch.testing.assert_close(scale_inv.cpu(), 1 / want, rtol=0, atol=0)


def test_current_scale_special_amax_gives_one(device):
    for a in (0.0, float("inf"), float("nan")):
        scale, scale_inv = k.current_scale(torch.tensor([a], device=device), 448.0)
        assert scale.item() == 1.0 and scale_inv.item() == 1.0
