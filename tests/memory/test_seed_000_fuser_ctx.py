"""Seed 000/001: the fuser must not keep saved tensors on the autograd ctx after backward.

TransformerEngine's fuser left quantized tensors on `func_ctx.tensor_objects`
(and FP8 attention on `ctx.tensor_objects`); autograd frees what
save_for_backward holds, not ctx attributes, so they lived one iteration too
long. Each check below is also run with te_fuser's clearing switched off
(te_fuser.ops.fuser._CLEAR_CTX_AFTER_BACKWARD = False) and must then fail.
"""

import pytest
import torch

import te_fuser
from te_fuser import ops, recipe
from te_fuser.ops import fuser as fuser_module
from te_fuser.tensor import Float8Tensor

from _fuser_ctx_walk import allowed_storages, assert_nothing_reachable, reachable_tensors, retained_cpu_bytes
from memory_patterns import shell_keeps_a_link

RECIPES = {
    "no_fp8": None,
    "delayed": recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
}
TOKENS, HIDDEN, FFN = 256, 64, 128


def _mlp():
    torch.manual_seed(0)
    return ops.Sequential(ops.LayerNorm(HIDDEN), ops.BasicLinear(HIDDEN, FFN), ops.Bias(FFN), ops.GELU(),
                          ops.BasicLinear(FFN, HIDDEN), ops.Bias(HIDDEN))


def _linear_stack():
    torch.manual_seed(0)
    return torch.nn.Sequential(te_fuser.Linear(HIDDEN, FFN, device="cpu"), te_fuser.Linear(FFN, HIDDEN, device="cpu"))


def _forward(model, x, fp8_recipe):
    if fp8_recipe is None:
        return model(x)
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        return model(x)


@pytest.fixture(params=["fuser_ops", "linear"])
def model(request):
    return _mlp() if request.param == "fuser_ops" else _linear_stack()


def _fuser_node(out):
    """The fuser's autograd node of the chain that produced out."""
    node = out.grad_fn
    while not hasattr(node, "state"):
        node = node.next_functions[0][0]
    return node


def _graph_check(model, recipe_name):
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    out = _forward(model, x, RECIPES[recipe_name])
    allowed = allowed_storages(model)
    # The walk sees what the forward saved: it would see a leak.
    assert reachable_tensors(out, allowed)
    out.backward(torch.randn_like(out))
    return out, allowed


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_no_tensor_reachable_after_backward(model, recipe_name):
    out, allowed = _graph_check(model, recipe_name)
    assert_nothing_reachable(out, allowed)  # while `out` is alive
    assert _fuser_node(out).state is None


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_graph_check_catches_the_leak_without_clearing(model, recipe_name, monkeypatch):
    monkeypatch.setattr(fuser_module, "_CLEAR_CTX_AFTER_BACKWARD", False)
    out, allowed = _graph_check(model, recipe_name)
    with pytest.raises(AssertionError, match="still reachable"):
        assert_nothing_reachable(out, allowed)
    if recipe_name != "no_fp8":
        # TE's exact bug: Float8Tensors with their buffers back on ctx.tensor_objects.
        objects = _fuser_node(out).state.tensor_objects
        assert any(o is not None and o._data is not None for o in objects)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_ctx_holds_only_empty_shells_before_backward(model, recipe_name, monkeypatch):
    """Between forward and backward the FP8 tensors live in save_for_backward only: what the fuser's ctx
    attributes reach (every attribute of every shell) holds no tensor bytes."""
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    allowed = allowed_storages(model)
    out = _forward(model, x, RECIPES[recipe_name])
    assert reachable_tensors(out, allowed)  # what was saved
    assert reachable_tensors(out, allowed, saved=False) == []
    monkeypatch.setattr(Float8Tensor, "prepare_for_saving", shell_keeps_a_link(Float8Tensor.prepare_for_saving))
    out = _forward(model, x, RECIPES[recipe_name])
    assert reachable_tensors(out, allowed, saved=False), "bug-on control: the walk must see the link"


def _retained(model, recipe_name):
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    grad = torch.randn(TOKENS, HIDDEN)
    _forward(model, x, RECIPES[recipe_name]).sum()  # first step: creates the FP8 state and caches
    model.zero_grad(set_to_none=True)

    def step():
        out = _forward(model, x, RECIPES[recipe_name])
        out.backward(grad)
        return out

    out, retained = retained_cpu_bytes(step)
    param_grads = sum(p.numel() * p.element_size() for p in model.parameters())
    expected = out.numel() * out.element_size() + x.numel() * x.element_size() + param_grads
    return out, retained, expected


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_retained_bytes_with_output_alive(model, recipe_name, monkeypatch):
    # Allocation measure: with the output still alive, a training step keeps only the
    # output, x.grad and the parameter grads (+ a little FP8 scaling state).
    out, retained, expected = _retained(model, recipe_name)
    slack = 4096
    assert retained <= expected + slack, (retained, expected)

    # The same measurement sees the leak with clearing off: at least the saved
    # activations (the FFN activation alone is TOKENS * FFN * 4 bytes in float32,
    # TOKENS * FFN bytes in FP8).
    monkeypatch.setattr(fuser_module, "_CLEAR_CTX_AFTER_BACKWARD", False)
    out_leaky, retained_leaky, expected = _retained(model, recipe_name)
    min_leak = TOKENS * FFN * (1 if recipe_name != "no_fp8" else 4)
    assert retained_leaky >= expected + min_leak, (retained_leaky, expected)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_second_backward_raises(model, recipe_name):
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    out = _forward(model, x, RECIPES[recipe_name])
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through the fused graph a second time"):
        out.sum().backward()


def test_second_backward_without_retain_graph_also_raises():
    model = _mlp()
    out = model(torch.randn(TOKENS, HIDDEN, requires_grad=True))
    out.sum().backward()
    with pytest.raises(RuntimeError):
        out.sum().backward()


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_te_fuser_memory_tools_see_the_fix(recipe_name, monkeypatch):
    """The same claim through te_fuser.memory: audit_autograd finds no tensor on the fuser's
    ctx after backward, and a loop that keeps each step's output until the next step (like
    a logged loss) peaks lower than the same loop with clearing off."""
    from te_fuser.memory import MemoryTracker, audit_autograd

    def loop(clear):
        monkeypatch.setattr(fuser_module, "_CLEAR_CTX_AFTER_BACKWARD", clear)
        model = _linear_stack()
        x = torch.randn(TOKENS, HIDDEN)
        out = None
        with MemoryTracker("cpu") as tracker:
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                out = _forward(model, x, RECIPES[recipe_name])
                out.sum().backward()
        return tracker.peak_bytes, audit_autograd(out).total_bytes

    peak, held = loop(True)
    peak_leaky, held_leaky = loop(False)
    assert held == 0
    # Left on ctx without clearing: at least the FP8 transposes of the FFN activation.
    assert held_leaky >= TOKENS * FFN
    assert peak_leaky >= peak + TOKENS * FFN
