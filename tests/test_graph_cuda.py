"""te_fuser.make_graphed_callables on CUDA: the captured forward and backward replay the eager module's
step (outputs, gradients, and the delayed-scaling update inside the forward graph), with no host sync
on the replay, nothing on an autograd ctx, and memory flat across steps. The CPU semantics are in
tests/modules/test_graph.py."""

import copy

import pytest
import torch

import te_fuser
from te_fuser import recipe
from te_fuser.graph import _delayed_states
from te_fuser.quantization import check_fp8_support

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not check_fp8_support()[0],
                                reason="CUDA with FP8 GEMMs (compute capability 8.9+) is not available")

HIDDEN, FFN, HEADS, SEQ, BATCH = 256, 512, 4, 128, 2
RECIPES = {
    "none": None,
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
}
MODULES = {
    "Linear": lambda: te_fuser.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device="cuda"),
    "LayerNormMLP": lambda: te_fuser.LayerNormMLP(HIDDEN, FFN, activation="swiglu", normalization="RMSNorm",
                                                  params_dtype=torch.bfloat16, device="cuda"),
    "TransformerLayer": lambda: te_fuser.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                                          params_dtype=torch.bfloat16, device="cuda"),
}


def _input(scale=1.0):
    return (torch.randn(SEQ, BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16) * scale).requires_grad_()


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", list(MODULES))
def test_replay_matches_eager(kind, recipe_name):
    fp8_recipe = RECIPES[recipe_name]() if RECIPES[recipe_name] else None
    torch.manual_seed(0)
    module = MODULES[kind]()
    eager = copy.deepcopy(module)
    graphed = te_fuser.make_graphed_callables(module, (_input(),), fp8_enabled=fp8_recipe is not None,
                                              fp8_recipe=fp8_recipe)
    for step in range(4):
        x = _input(2.0 ** step)
        dy = torch.randn_like(x) * 2.0 ** -step
        ref_x = x.detach().clone().requires_grad_()
        torch.cuda.set_sync_debug_mode("error")  # a replayed step never waits for the host
        try:
            y = graphed(x)
            y.backward(dy)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        with te_fuser.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            ref_y = eager(ref_x)
        ref_y.backward(dy)
        _close(y, ref_y)
        _close(x.grad, ref_x.grad)
        for p, ref_p in zip(module.parameters(), eager.parameters()):
            _close(p.grad, ref_p.grad)
        # The graphs updated the scales, the forward's at its exit and the backward's at its end (TE's times):
        # no autocast exit ran around the replay.
        for state, ref_state in zip(_delayed_states([module]), _delayed_states([eager])):
            torch.testing.assert_close(state.scale, ref_state.scale, rtol=1e-5, atol=0)
            torch.testing.assert_close(state.amax_history, ref_state.amax_history, rtol=1e-2, atol=0)


def test_memory_is_flat_and_nothing_stays_on_ctx():
    """After each replayed step only the parameters' gradients are new; the replay's autograd node keeps
    no tensor (its ctx holds a tuple of flags, cleared in backward)."""
    torch.manual_seed(0)
    layer = MODULES["TransformerLayer"]()
    fp8_recipe = recipe.DelayedScaling()
    x = _input()
    graphed = te_fuser.make_graphed_callables(layer, (x,), fp8_enabled=True, fp8_recipe=fp8_recipe)
    levels = []
    for _ in range(3):
        y = graphed(x)
        y.backward(torch.ones_like(y))
        assert not [v for v in vars(y.grad_fn).values() if isinstance(v, torch.Tensor)]
        assert y.grad_fn.leaf is None
        del y
        layer.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.synchronize()
        levels.append(torch.cuda.memory_allocated())
    assert levels[1] == levels[2], levels


def test_weight_caching_replays_the_cached_weight_graph():
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    module = MODULES["Linear"]()
    eager = copy.deepcopy(module)
    graphed = te_fuser.make_graphed_callables(module, (_input(),), fp8_enabled=True, fp8_recipe=fp8_recipe,
                                              fp8_weight_caching=True)
    for first in (True, False, False, True):
        with torch.no_grad():
            module.weight.mul_(1.25)
            eager.weight.mul_(1.25)
        x = _input()
        dy = torch.randn_like(x)
        ref_x = x.detach().clone().requires_grad_()
        y = graphed(x, is_first_microbatch=first)
        y.backward(dy)
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            ref_y = eager(ref_x, is_first_microbatch=first)
        ref_y.backward(dy)
        _close(y, ref_y)
        _close(x.grad, ref_x.grad)


def test_pipeline_order_replays():
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    layers = (MODULES["Linear"](), MODULES["Linear"]())
    eager = copy.deepcopy(layers)
    order = [1, 2, 1, 2, -2, -1, -2, -1]
    functions = te_fuser.make_graphed_callables(layers, tuple((_input(),) for _ in range(4)), fp8_enabled=True,
                                                fp8_recipe=fp8_recipe, _order=order)
    xs = [_input() for _ in range(2)]
    ys = [functions[2 + mb](functions[mb](xs[mb])) for mb in range(2)]
    for mb in (0, 1):
        ys[mb].sum().backward()
    for mb in range(2):
        ref_x = xs[mb].detach().clone().requires_grad_()
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            hidden = eager[0](ref_x)
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            ref_y = eager[1](hidden)
        _close(ys[mb], ref_y)


def test_enclosing_autocast_changes_nothing():
    """Two replays inside one fp8_autocast: each updates the scales at its end (the update is in the forward
    graph), as two eager calls under their own autocasts do, and as the CPU path does."""
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    module = MODULES["Linear"]()
    eager = copy.deepcopy(module)
    graphed = te_fuser.make_graphed_callables(module, (_input(),), fp8_enabled=True, fp8_recipe=fp8_recipe)
    xs = [_input(3.0 ** i) for i in range(2)]
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        ys = [graphed(x).clone() for x in xs]
    for x, y in zip(xs, ys):
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            _close(y, eager(x))
    for state, ref_state in zip(_delayed_states([module]), _delayed_states([eager])):
        torch.testing.assert_close(state.scale, ref_state.scale, rtol=1e-5, atol=0)
