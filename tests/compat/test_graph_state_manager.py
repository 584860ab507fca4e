"""The FP8GlobalStateManager methods of TE's CUDA-graph path, called as megatron-core 0.16.1's
transformer/cuda_graphs.py and TE 2.6's graph.py / fp8_autocast call them, and the graph module under
the transformer_engine alias (the names megatron-core imports from it)."""

import pytest
import torch

import te_fuser
from te_fuser.fp8 import FP8GlobalStateManager
from te_fuser.quantization import FP8GlobalState
from te_fuser.recipe import DelayedScaling, Float8CurrentScaling

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


@pytest.fixture(autouse=True)
def _fresh_manager():
    FP8GlobalStateManager.reset()
    yield
    FP8GlobalStateManager.reset()


def _stepped_linear(fp8_recipe):
    """A Linear whose FP8 state exists (one eager step), as a graphed layer's does after capture."""
    layer = te_fuser.Linear(32, 32, device="cpu")
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        out = layer(torch.randn(16, 32))
    out.sum().backward()
    return layer


def _expected_scale(amax: float, fp8_max: float, margin: int) -> float:
    return fp8_max / amax / 2.0 ** margin  # float64, TE's formula


def test_replay_forward_registers_the_states_for_the_exit_update():
    """megatron's _CudagraphReplayNode.forward: a replay runs no module code; the kernels it replays
    record amaxes into the states' row 0, then megatron hands each module's fp8_meta to
    add_fp8_tensors_to_global_buffer, and the exit of its fp8 context updates the scales."""
    fp8_recipe = DelayedScaling(amax_history_len=4, margin=1, amax_compute_algo="most_recent")
    layer = _stepped_linear(fp8_recipe)
    fwd, bwd = layer.fp8_meta["scaling_fwd"], layer.fp8_meta["scaling_bwd"]
    before = fwd.scale.clone()
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        fwd.amax_history[0].copy_(torch.tensor([3.0, 0.5]))  # what the forward graph's casts record
        bwd.amax_history[0].copy_(torch.tensor([0.25]))  # what the last backward graph recorded
        if isinstance(FP8GlobalStateManager.get_fp8_recipe(), DelayedScaling):
            for m in layer.modules():
                m.fp8_meta["fp8_group"] = FP8GlobalStateManager.get_fp8_group()  # megatron's writes: a view's
                m.fp8_meta["recipe"] = FP8GlobalStateManager.get_fp8_recipe()
                FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(m.fp8_meta)
        assert torch.equal(fwd.scale, before)  # nothing updated before the exit
    assert fwd.scale.tolist() == pytest.approx([_expected_scale(3.0, E4M3_MAX, 1), _expected_scale(0.5, E4M3_MAX, 1)],
                                               rel=1e-6)
    assert bwd.scale.tolist() == pytest.approx([_expected_scale(0.25, E5M2_MAX, 1)], rel=1e-6)
    assert fwd.amax_history[-1].tolist() == [3.0, 0.5] and not fwd.amax_history[0].any()  # rolled


def test_replay_forward_without_the_registration_updates_nothing():
    """The control: the same replay without add_fp8_tensors_to_global_buffer leaves the scales alone."""
    fp8_recipe = DelayedScaling(amax_history_len=4)
    layer = _stepped_linear(fp8_recipe)
    fwd = layer.fp8_meta["scaling_fwd"]
    before = fwd.scale.clone()
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        fwd.amax_history[0].copy_(torch.tensor([3.0, 0.5]))
    assert torch.equal(fwd.scale, before)


def test_add_fp8_tensors_takes_the_group_of_the_dict():
    fp8_recipe = DelayedScaling()
    layer = _stepped_linear(fp8_recipe)
    meta, group = layer.fp8_meta, object()
    meta["fp8_group"] = group
    FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
    assert meta["scaling_fwd"].group is group and meta["scaling_bwd"].group is group
    FP8GlobalState._pending.clear()
    with pytest.raises(TypeError, match="fp8_meta must be"):
        FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(None)


def test_add_fp8_tensors_ignores_stateless_recipes():
    layer = _stepped_linear(Float8CurrentScaling())
    FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(layer.fp8_meta)
    assert FP8GlobalState._pending == []


def test_backward_replay_update_of_megatron():
    """megatron's _CudagraphReplayNode.backward calls reduce_and_update_fp8_tensors(forward=False) after
    the backward graph: the backward states registered by the forward replay update then."""
    fp8_recipe = DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent")
    layer = _stepped_linear(fp8_recipe)
    bwd = layer.fp8_meta["scaling_bwd"]
    FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(layer.fp8_meta)
    bwd.amax_history[0].fill_(2.0)
    FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
    assert bwd.scale.tolist() == pytest.approx([_expected_scale(2.0, E5M2_MAX, 0)], rel=1e-6)
    assert any(s is layer.fp8_meta["scaling_fwd"] for s in FP8GlobalState._pending)  # forward: not yet


def test_skip_fp8_weight_update_tensor_is_one_flag_updated_in_place():
    """megatron: set_skip_fp8_weight_update_tensor(False) when a runner is made, then
    set_skip_fp8_weight_update_tensor(not is_first_microbatch) before replays."""
    assert FP8GlobalStateManager.get_skip_fp8_weight_update_tensor() is None
    FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(False)
    flag = FP8GlobalStateManager.get_skip_fp8_weight_update_tensor()
    assert flag.dtype == torch.float32 and flag.shape == (1,) and flag.item() == 0.0
    for is_first_microbatch in (False, True):
        FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(not is_first_microbatch)
        assert FP8GlobalStateManager.get_skip_fp8_weight_update_tensor() is flag
        assert flag.item() == float(not is_first_microbatch)
    assert FP8GlobalStateManager.quantization_state.skip_fp8_weight_update_tensor is flag
    FP8GlobalStateManager.reset()
    assert FP8GlobalStateManager.get_skip_fp8_weight_update_tensor() is None


def test_is_first_fp8_module_once_per_context():
    """megatron asks it inside each layer's fp8 context (multi_token_prediction.py)."""
    with te_fuser.fp8_autocast():
        assert FP8GlobalStateManager.is_first_fp8_module()
        assert not FP8GlobalStateManager.is_first_fp8_module()


def test_autocast_state_round_trip():
    """TE's fp8_autocast saves get_fp8_autocast_state() on entry and restores it with
    set_fp8_autocast_state() on exit."""
    fp8_recipe, group = DelayedScaling(margin=3), object()
    assert FP8GlobalStateManager.get_fp8_autocast_state() == (False, False, None, None, False, False)
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe, fp8_group=group):
        state = FP8GlobalStateManager.get_fp8_autocast_state()
        assert state == (True, False, fp8_recipe, group, True, False)
        FP8GlobalStateManager.set_fp8_autocast_state((False, True, fp8_recipe, None, False, False))
        assert not FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.is_fp8_calibration()
        FP8GlobalStateManager.set_fp8_autocast_state(state)
        assert FP8GlobalStateManager.get_fp8_autocast_state() == state
    assert FP8GlobalState._stack == []
    # Outside any autocast, an enabled state opens one (TE's state is global) and a disabled one closes it.
    FP8GlobalStateManager.set_fp8_autocast_state((True, False, fp8_recipe, group, True, False))
    assert FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.get_fp8_recipe() is fp8_recipe
    FP8GlobalStateManager.set_fp8_autocast_state((False, False, None, None, False, False))
    assert FP8GlobalState._stack == [] and not FP8GlobalStateManager.is_fp8_enabled()
    with pytest.raises(ValueError, match="6-tuple"):
        FP8GlobalStateManager.set_fp8_autocast_state((True, False))


def test_fp8_graph_capturing_during_make_graphed_callables():
    seen = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = te_fuser.Linear(32, 32, device="cpu")

        def forward(self, x):
            seen.append(FP8GlobalStateManager.fp8_graph_capturing())
            return self.linear(x)

    x = torch.randn(16, 32, requires_grad=True)
    probe = te_fuser.make_graphed_callables(Probe(), (x,), num_warmup_iters=2)
    assert seen == [True, True] and not FP8GlobalStateManager.fp8_graph_capturing()
    assert not FP8GlobalStateManager.quantization_state.fp8_graph_capturing
    probe(x)
    assert seen == [True, True, False]


def test_graph_module_under_the_alias(alias):
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.graph import (make_graphed_callables, restore_fp8_tensors, save_fp8_tensors,
                                                  set_capture_end, set_capture_start)

    assert te.make_graphed_callables is make_graphed_callables is te_fuser.make_graphed_callables
    assert save_fp8_tensors is te_fuser.graph.save_fp8_tensors
    assert restore_fp8_tensors is te_fuser.graph.restore_fp8_tensors
    set_capture_start()
    assert te.graph.is_graph_capturing() and FP8GlobalStateManager.fp8_graph_capturing()
    set_capture_end()
    assert not te.graph.is_graph_capturing()


def test_save_and_restore_fp8_tensors_as_megatron_does():
    """megatron saves the layers' FP8 state before its own warmup and restores it after."""
    fp8_recipe = DelayedScaling(amax_history_len=4)
    layer = _stepped_linear(fp8_recipe)
    before = {k: v.clone() for k, v in vars(layer.fp8_meta["scaling_fwd"]).items() if isinstance(v, torch.Tensor)}
    saved = te_fuser.graph.save_fp8_tensors([layer], fp8_recipe)
    for _ in range(2):
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            layer(torch.randn(16, 32) * 9)
    te_fuser.graph.restore_fp8_tensors([layer], saved)
    after = vars(layer.fp8_meta["scaling_fwd"])
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert te_fuser.graph.save_fp8_tensors([layer], Float8CurrentScaling()) is None
