"""Delayed scaling's update times, as TransformerEngine 2.6 has them: the forward (input, weight) states at
the outermost fp8_autocast's exit, the backward (gradient) states at the end of the backward of the
context's first module. Checked through TE's accessors (BasicLinear.get_quantizer, fp8_meta) against
scales computed here in float64 from the amaxes of known inputs."""

import pytest
import torch

import te_fuser
import te_fuser.ops as te_ops
from te_fuser.quantization import FP8GlobalState
from te_fuser.recipe import DelayedScaling, Format

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
MARGIN = 1


def _scale(amaxes, algo, fp8_max):
    amax = max(amaxes) if algo == "max" else amaxes[-1]
    return float(torch.tensor(fp8_max / amax / 2.0 ** MARGIN, dtype=torch.float64).float())


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_basic_linear_quantizers_follow_each_step(algo):
    """TE's test_recipe fuser-op check, independently: per step, x, w and dy filled with known values; after
    the step, the input's and the weight's scales hold the forward amaxes so far, and the gradient's scale
    already holds this step's backward amax."""
    op = te_ops.BasicLinear(16, 16, device="cpu")
    recipe = DelayedScaling(margin=MARGIN, fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo=algo)
    with te_fuser.fp8_autocast(fp8_recipe=recipe):
        x_q, w_q, dy_q = op.get_quantizer("forward", 0), op.get_quantizer("forward", 1), op.get_quantizer("backward", 0)
    history = {"x": [], "w": [], "dy": []}
    for step in range(4):
        # amaxes differ per step and are not monotone, so "max" and "most_recent" disagree
        x_val, w_val, dy_val = [(step % 3 + 1) * v for v in (0.25, 0.5, 0.75)]
        history["x"].append(x_val)
        history["w"].append(w_val)
        history["dy"].append(dy_val)
        x = torch.full((16, 16), x_val, requires_grad=True)
        with torch.no_grad():
            op.weight.fill_(w_val)
        with te_fuser.fp8_autocast(fp8_recipe=recipe):
            y = op(x)
        y.backward(torch.full((16, 16), dy_val))
        assert x_q.scale.item() == _scale(history["x"], algo, E4M3_MAX), step
        assert w_q.scale.item() == _scale(history["w"], algo, E4M3_MAX), step
        assert dy_q.scale.item() == _scale(history["dy"], algo, E5M2_MAX), step


def test_get_quantizer_checks_its_arguments():
    op = te_ops.BasicLinear(8, 8, device="cpu")
    with pytest.raises(ValueError, match="mode must be 'forward' or 'backward'"):
        op.get_quantizer("fwd", 0)
    with pytest.raises(IndexError, match="BasicLinear has 2 forward quantizer"):
        op.get_quantizer("forward", 2)
    with pytest.raises(IndexError, match="1 backward quantizer"):
        op.get_quantizer("backward", -1)


def test_each_backward_updates_when_forwards_run_ahead():
    """A pipeline schedule: two microbatches' forwards, then their backwards. Each backward updates the
    gradient's scale, so the second backward casts with the scale the first one set (TE's order); each
    forward context's exit updates the forward state only."""
    layer = te_fuser.Linear(16, 16, device="cpu")
    recipe = DelayedScaling(margin=MARGIN, amax_history_len=8, amax_compute_algo="most_recent")
    outs = []
    for _ in range(2):
        with te_fuser.fp8_autocast(fp8_recipe=recipe):
            outs.append(layer(torch.randn(16, 16, requires_grad=True)))
    bwd = layer.fp8_meta["scaling_bwd"]
    assert bwd.scale.item() == 1.0 and not bwd.amax_history.any()  # no backward yet: nothing rolled in
    seen = []
    for out, dy_val in zip(outs, (3.0, 5.0)):
        out.backward(torch.full_like(out, dy_val))
        seen.append(bwd.scale.item())
    # one roll per backward, each with that backward's amax
    assert bwd.amax_history[-2:, 0].tolist() == [3.0, 5.0] and bwd.amax_history[0, 0].item() == 0.0
    assert seen == [_scale([3.0], "most_recent", E5M2_MAX), _scale([5.0], "most_recent", E5M2_MAX)]
    assert FP8GlobalState._pending == []


def test_without_a_graph_the_exit_updates_the_backward_state():
    """No module claims the backward update when there is no graph (no_grad): the exit updates the backward
    state with the rest, as before a backward that would record into it."""
    layer = te_fuser.Linear(16, 16, device="cpu")
    recipe = DelayedScaling(amax_history_len=4)
    with torch.no_grad(), te_fuser.fp8_autocast(fp8_recipe=recipe):
        layer(torch.randn(16, 16))
    assert FP8GlobalState._pending == [] and FP8GlobalState.backward_update is None


def test_the_graph_holds_the_claim_until_its_backward():
    """The claiming chain's autograd node, and nothing global, holds the backward states until its backward,
    which updates them and drops them."""
    layer = te_fuser.Linear(16, 16, device="cpu")
    with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling()):
        out = layer(torch.randn(16, 16, requires_grad=True))
    assert FP8GlobalState._pending == [] and FP8GlobalState.backward_update is None
    holder = out.grad_fn.state.backward_update
    assert holder is not None and [s is layer.fp8_meta["scaling_bwd"] for s in holder.states] == [True]
    out.backward(torch.ones_like(out))
    assert holder.states == [] and out.grad_fn.state is None


def _linear_step(module, recipe, x_val, dy_val, train=True, checkpointed=False):
    x = torch.full((16, 16), x_val, requires_grad=train)
    with te_fuser.fp8_autocast(fp8_recipe=recipe):
        y = te_fuser.distributed.checkpoint(module, x) if checkpointed else module(x)
    if train:
        y.backward(torch.full((16, 16), dy_val))


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_evaluation_forward_leaves_backward_states_alone(no_grad):
    """A forward without grad inside fp8_autocast (an evaluation pass) has no backward: as in TE, the gradient's
    state keeps its history and scale, while the forward states update. The next training step's gradient scale
    then comes from the training amaxes alone."""
    module = te_fuser.Linear(16, 16, bias=False, params_dtype=torch.float32)
    recipe = DelayedScaling(margin=MARGIN, fp8_format=Format.HYBRID, amax_history_len=2, amax_compute_algo="max")
    _linear_step(module, recipe, 0.5, 3.0)
    bwd, fwd = module.fp8_meta["scaling_bwd"], module.fp8_meta["scaling_fwd"]
    before = (bwd.amax_history.clone(), bwd.scale.clone())
    fwd_history = fwd.amax_history.clone()
    with no_grad():
        for _ in range(2):
            _linear_step(module, recipe, 0.25, None, train=False)
    assert torch.equal(bwd.amax_history, before[0]) and torch.equal(bwd.scale, before[1])
    assert not torch.equal(fwd.amax_history, fwd_history)  # the evaluation's input amaxes were recorded
    _linear_step(module, recipe, 0.5, 1.0)
    assert bwd.scale[0].item() == _scale([3.0, 1.0], "max", E5M2_MAX)  # a rolled-in zero would leave 1.0 alone


def test_reentrant_checkpoint_still_updates_backward_states():
    """te_fuser's reentrant checkpoint runs its forward without grad and its backward's recompute is a replay
    that marks nothing: the checkpoint's forward marks the gradient states itself, since a backward follows, so
    they still update (at the next exit: no module claimed them). A checkpointed evaluation leaves the amax the
    last backward recorded for the next training step's exit (before, the evaluation's exit consumed it)."""
    module = te_fuser.Linear(16, 16, bias=False, params_dtype=torch.float32)
    recipe = DelayedScaling(margin=MARGIN, fp8_format=Format.HYBRID, amax_history_len=4, amax_compute_algo="max")
    _linear_step(module, recipe, 0.5, 3.0, checkpointed=True)
    _linear_step(module, recipe, 0.5, 2.0, checkpointed=True)
    assert module.fp8_meta["scaling_bwd"].scale[0].item() == _scale([3.0], "max", E5M2_MAX)
    with torch.no_grad():  # a checkpointed evaluation: no backward follows, nothing rolls in
        history = module.fp8_meta["scaling_bwd"].amax_history.clone()
        _linear_step(module, recipe, 0.5, None, train=False, checkpointed=True)
        assert torch.equal(module.fp8_meta["scaling_bwd"].amax_history, history)
