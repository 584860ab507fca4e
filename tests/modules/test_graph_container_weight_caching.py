"""make_graphed_callables(fp8_weight_caching=True) on a container whose forward takes no is_first_microbatch
(torch.nn.Sequential of te_fuser modules, as TE's test_cuda_graphs graphs): each call's is_first_microbatch
reaches the linear ops inside, so True quantizes and caches the weights and False reuses them. Checked
bitwise against the modules called eagerly with the argument, with the weights changed between microbatches
(a reused cache must give the old weights' results)."""

import copy

import pytest
import torch

import te_fuser
from te_fuser.recipe import DelayedScaling, Float8CurrentScaling


def _eager(layers, x, first):
    for layer in layers:
        x = layer(x, is_first_microbatch=first)
    return x


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_graphed_container_caches_weights_per_microbatch(recipe, generator):
    torch.manual_seed(0)
    layers = [te_fuser.Linear(32, 32, device="cpu"), te_fuser.LayerNormMLP(32, 64, device="cpu")]
    container = torch.nn.Sequential(*layers)
    twin = copy.deepcopy(layers)
    graphed = te_fuser.make_graphed_callables(container, (torch.randn(16, 32, requires_grad=True),),
                                              fp8_enabled=True, fp8_recipe=recipe, fp8_weight_caching=True)
    for microbatch in range(3):
        first = microbatch == 0
        x = torch.randn(16, 32, generator=generator)
        xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = graphed(xg, is_first_microbatch=first)
        with te_fuser.fp8_autocast(fp8_recipe=recipe):
            ref = _eager(twin, xe, first)
        y.sum().backward()
        ref.sum().backward()
        assert torch.equal(y, ref) and torch.equal(xg.grad, xe.grad), microbatch
        with torch.no_grad():  # a changed weight: the next (cached) microbatches must not see it
            for module in (container, *twin):
                for p in module.parameters():
                    p.add_(0.25)
    assert all(m._ops[0]._fp8_weight_cache is not None for m in (layers[0],))


def test_the_argument_is_still_required(generator):
    container = torch.nn.Sequential(te_fuser.Linear(32, 32, device="cpu"))
    graphed = te_fuser.make_graphed_callables(container, (torch.randn(16, 32, requires_grad=True),),
                                              fp8_enabled=True, fp8_weight_caching=True)
    with pytest.raises(TypeError, match="needs the boolean keyword argument is_first_microbatch"):
        graphed(torch.randn(16, 32, generator=generator))
