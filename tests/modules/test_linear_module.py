"""te_fuser.Linear's TE-client fixes: save_original_input (settable after construction, as
Megatron sets it, and honoured), backward_dw(); FSDP is in test_fsdp.py."""

import pytest
import torch
import torch.distributed as dist

import te_fuser
from te_fuser import recipe

from _module_checks import ctx_walk_check, spawn
from _fuser_ctx_walk import retained_cpu_bytes

IN, OUT, TOKENS = 64, 48, 256


def _pair():
    torch.manual_seed(0)
    a = te_fuser.Linear(IN, OUT, device="cpu")
    b = te_fuser.Linear(IN, OUT, device="cpu")
    b.load_state_dict(a.state_dict())
    b.save_original_input = True  # after construction, as Megatron's attention projection does
    assert b.save_original_input and not a.save_original_input
    return a, b


@pytest.mark.parametrize("fp8_recipe", [None, recipe.Float8CurrentScaling()], ids=["no_fp8", "current"])
def test_save_original_input_gives_the_same_results(fp8_recipe, generator):
    """Current scaling quantizes the saved input in backward to the same FP8 codes the forward
    made, so every result is bitwise the default path's."""
    a, b = _pair()
    x = torch.randn(TOKENS, IN, generator=generator)
    dy = torch.randn(TOKENS, OUT, generator=generator)
    results = []
    for layer in (a, b):
        xi = x.clone().requires_grad_()
        with te_fuser.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            out = layer(xi)
        out.backward(dy)
        results.append((out, xi.grad, layer.weight.grad, layer.bias.grad))
    for name, got, expect in zip(["out", "dx", "dW", "db"], results[1], results[0]):
        assert torch.equal(got, expect), name


def test_save_original_input_keeps_no_fp8_copy_of_the_input(generator):
    """With the graph alive after forward, the default path holds x.T in FP8 (TOKENS * IN bytes);
    with save_original_input it holds only the caller's input: the retained bytes drop by that."""
    x = torch.randn(TOKENS, IN, generator=generator, requires_grad=True)
    retained = []
    for layer in _pair():
        with te_fuser.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
            layer(x)  # warm-up: the FP8 state exists before the measurement

        def forward():
            with te_fuser.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
                return layer(x)

        out, nbytes = retained_cpu_bytes(forward)
        retained.append(nbytes)
        out.backward(torch.ones_like(out))
    assert retained[0] - retained[1] >= TOKENS * IN, retained


def test_save_original_input_refuses_delayed_scaling_as_te():
    layer = te_fuser.Linear(IN, OUT, device="cpu", save_original_input=True)
    with te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        with pytest.raises(ValueError, match="save_original_input.*DelayedScaling"):
            layer(torch.randn(16, IN, requires_grad=True))
    with te_fuser.fp8_autocast(fp8_recipe=recipe.DelayedScaling()), torch.no_grad():
        layer(torch.randn(16, IN))  # no weight gradient, no saved input: nothing to refuse


@pytest.mark.parametrize("fp8_recipe", [None, recipe.Float8CurrentScaling()], ids=["no_fp8", "current"])
def test_save_original_input_nothing_on_ctx_after_backward(fp8_recipe, monkeypatch):
    _, layer = _pair()
    ctx_walk_check(layer, lambda: torch.randn(32, IN, requires_grad=True), fp8_recipe, monkeypatch)


def test_backward_dw_is_a_no_op():
    layer = te_fuser.Linear(IN, OUT, device="cpu")
    layer(torch.randn(16, IN)).sum().backward()
    grad = layer.weight.grad.clone()
    assert layer.backward_dw() is None
    assert torch.equal(layer.weight.grad, grad)
    assert te_fuser.LayerNormLinear(IN, OUT, device="cpu").backward_dw() is None
    assert te_fuser.LayerNormMLP(IN, OUT, device="cpu").backward_dw() is None


def _sp_case(rank):
    """Column + sequence parallel: the saved original input is this rank's shard, gathered
    again in backward; results equal the default path's."""
    group = dist.group.WORLD
    for fp8_recipe in (None, recipe.Float8CurrentScaling()):
        torch.manual_seed(0)
        layers = [te_fuser.Linear(IN, 2 * OUT, parallel_mode="column", sequence_parallel=True, tp_group=group,
                                  device="cpu") for _ in range(2)]
        layers[1].load_state_dict(layers[0].state_dict())
        layers[1].save_original_input = True
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(TOKENS // 2, IN, generator=g)
        dy = torch.randn(TOKENS, OUT, generator=g)  # the gathered tokens x this rank's OUT features
        results = []
        for layer in layers:
            xi = x.clone().requires_grad_()
            with te_fuser.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe, fp8_group=group):
                out = layer(xi)
            out.backward(dy)
            results.append((out, xi.grad, layer.weight.grad))
        for name, got, expect in zip(["out", "dx", "dW"], results[1], results[0]):
            assert torch.equal(got, expect), (name, fp8_recipe)


def test_save_original_input_with_sequence_parallel_on_two_ranks():
    spawn(_sp_case)
