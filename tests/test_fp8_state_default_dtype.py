"""FP8 scaling state is float32 whatever torch's default dtype is (TE's behaviour; Lightning's
TransformerEnginePrecision sets the default dtype to its weights dtype, bf16, around the forward)."""

import pytest
import torch

import te_fuser
from te_fuser.recipe import DelayedScaling

from fp8_reference import fp8_max, reference_amax

STATE = ("amax_history", "amax", "scale", "scale_inv")


@pytest.fixture
def bf16_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    yield
    torch.set_default_dtype(previous)


def _train(layer, x, recipe, steps=3):
    for _ in range(steps):
        with te_fuser.fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
        y.float().square().sum().backward()


def test_delayed_scaling_state_is_float32(bf16_default, generator):
    layer = te_fuser.Linear(32, 48, device="cpu")
    assert layer.weight.dtype == torch.bfloat16  # built in the default dtype, as Lightning does
    x = torch.randn(16, 32, generator=generator).to(torch.bfloat16) * 7
    _train(layer, x, DelayedScaling(amax_history_len=4))
    forward, backward = layer._ops[0]._fp8_states
    for state in (forward, backward):
        for name in STATE:
            assert getattr(state, name).dtype == torch.float32, name
    # The updates ran on the amaxes seen: the input's slot holds 448 / amax(x), in float32.
    amax = reference_amax(x)
    assert forward.amax_history[:, 0].max() == amax
    want = torch.tensor(fp8_max(torch.float8_e4m3fn), dtype=torch.float32) / amax
    assert forward.scale[0] == want and forward.scale_inv[0] == 1 / want


def test_extra_state_round_trip_keeps_float32_scales(bf16_default, generator):
    """The checkpointed state (TE's slot layout) keeps the float32 scales bit for bit."""
    layer = te_fuser.Linear(32, 48, device="cpu")
    x = torch.randn(16, 32, generator=generator).to(torch.bfloat16) * 7
    _train(layer, x, DelayedScaling(amax_history_len=4))
    fresh = te_fuser.Linear(32, 48, device="cpu")
    fresh.load_state_dict(layer.state_dict())
    for (mine, theirs) in zip(layer._ops[0]._fp8_states, fresh._ops[0]._fp8_states):
        for name in STATE:
            assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
            assert getattr(theirs, name).dtype == torch.float32, name
