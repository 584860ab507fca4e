"""fp8_autocast / autocast: recipe state, amax reduction over a group, scale updates."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import te_fuser
from te_fuser.quantization import FP8GlobalState, make_recipe_state
from te_fuser.recipe import DelayedScaling, Float8CurrentScaling, Format

from _gloo_ranks import free_port


def test_recipe_defaults_and_formats():
    r = DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.reduce_amax, r.fp8_dpa) == \
        (0, Format.HYBRID, 1024, "max", True, False)
    assert Format.HYBRID.fwd_dtype == torch.float8_e4m3fn and Format.HYBRID.bwd_dtype == torch.float8_e5m2
    assert Format.E4M3.max_bwd == 448.0 and Format.E5M2.max_fwd == 57344.0
    assert Float8CurrentScaling().fp8_format == Format.HYBRID
    with pytest.raises(ValueError, match="amax_compute_algo"):
        DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(TypeError, match="fp8_format"):
        DelayedScaling(fp8_format="HYBRID")


def test_context_state_and_nesting():
    assert not FP8GlobalState.is_enabled()
    r = DelayedScaling(margin=1)
    with te_fuser.fp8_autocast(fp8_recipe=r):
        assert FP8GlobalState.is_enabled() and FP8GlobalState.get_recipe() is r
        with te_fuser.fp8_autocast(enabled=False):
            assert not FP8GlobalState.is_enabled()
        with te_fuser.autocast(recipe=Float8CurrentScaling()):
            assert isinstance(FP8GlobalState.get_recipe(), Float8CurrentScaling)
        assert FP8GlobalState.get_recipe() is r
    assert not FP8GlobalState.is_enabled()
    with te_fuser.fp8_autocast(calibrating=True):
        assert FP8GlobalState.is_calibrating()
    with pytest.raises(TypeError, match="fp8_recipe"):
        with te_fuser.fp8_autocast(fp8_recipe="delayed"):
            pass


def test_exit_updates_scales_from_recorded_amax(generator):
    r = DelayedScaling(amax_history_len=3, margin=1)
    state = make_recipe_state(r, 2)
    x = torch.randn(100, generator=generator) * 7
    with te_fuser.fp8_autocast(fp8_recipe=r):
        q0, _ = state.quantizers()
        q0(x)
        assert state.scale[0].item() == 1.0  # delayed: the scale changes only at exit
    amax = x.abs().max()
    assert state.scale[0].item() == ((torch.tensor(448.0) / amax) / 2).item()
    assert state.scale[1].item() == 1.0  # nothing recorded: old scale kept
    # TE's layout: the recorded amax is now the newest completed one (last row), row 0 reset.
    assert state.amax_history[-1, 0].item() == amax.item() and state.amax[0].item() == 0.0


def test_state_dict_round_trip_and_mismatch():
    r = DelayedScaling(amax_history_len=4)
    a, b = make_recipe_state(r, 3), make_recipe_state(r, 3)
    a.amax_history.uniform_()
    a.scale.uniform_()
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scale, b.scale)
    with pytest.raises(ValueError, match="amax_history' has shape"):
        make_recipe_state(DelayedScaling(amax_history_len=8), 3).load_state_dict(a.state_dict())
    with pytest.raises(KeyError, match="scale_inv"):
        b.load_state_dict({k: v for k, v in a.state_dict().items() if k != "scale_inv"})


def _reduce_worker(rank, world_size, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        r = DelayedScaling(amax_history_len=2)
        state = make_recipe_state(r, 1)
        with te_fuser.fp8_autocast(fp8_recipe=r, fp8_group=dist.group.WORLD):
            (q,) = state.quantizers(group=dist.group.WORLD)
            q(torch.full((8,), float(rank + 1) * 10))
        results[rank] = (state.amax_history[-1, 0].item(), state.scale[0].item())
    finally:
        dist.destroy_process_group()


def test_amax_is_all_reduced_over_the_group():
    results = mp.Manager().dict()
    mp.spawn(_reduce_worker, args=(2, free_port(), results), nprocs=2, join=True)
    expected = (20.0, (torch.tensor(448.0) / 20.0).item())
    assert results[0] == expected and results[1] == expected


def _quantized_block(state, weight):
    """x -> fake-quantized(x) @ weight, quantizing with the recipe state while FP8 is on."""
    def block(x):
        if FP8GlobalState.is_enabled():
            (q,) = state.quantizers()
            x = x + (q(x).dequantize() - x).detach()  # straight-through
        return x @ weight
    return block


@pytest.mark.parametrize("checkpoint_fn", ["te_fuser", "torch"])
def test_checkpoint_recomputes_in_the_forward_fp8_state(generator, checkpoint_fn):
    r = DelayedScaling(amax_history_len=4)
    state = make_recipe_state(r, 1)
    weight = torch.randn(32, 8, generator=generator, requires_grad=True)
    block = _quantized_block(state, weight)
    x = torch.randn(64, 32, generator=generator) * 3
    with te_fuser.fp8_autocast(fp8_recipe=r):  # warm-up: sets a non-trivial scale at exit
        block(x)
    grads = []
    for use_checkpoint in (False, True):
        saved = state.state_dict()
        with te_fuser.fp8_autocast(fp8_recipe=r):
            if not use_checkpoint:
                y = block(x)
            elif checkpoint_fn == "te_fuser":
                y = te_fuser.checkpoint(block, x)
            else:
                y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        y.square().sum().backward()
        grads.append(weight.grad.clone())
        weight.grad = None
        after = state.state_dict()
        state.load_state_dict(saved)  # both runs start from the same scaling state
    if checkpoint_fn == "te_fuser":
        torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
        # the recompute recorded no amax: nothing recorded since the update (row 0 of TE's layout)
        assert after["amax_history"][0].item() == 0.0
    else:  # plain torch checkpoint recomputes outside fp8_autocast: the values differ
        assert not torch.equal(grads[1], grads[0])
