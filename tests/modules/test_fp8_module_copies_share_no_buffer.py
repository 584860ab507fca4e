"""A copy of a module with FP8 weights never aliases the original's buffers: copy.deepcopy, and a
state_dict loaded into a fresh module (in memory, and through torch.save / torch.load in BytesIO).

Two checks each. No storage the copy reaches (weights' bytes and scales, their quantizers, the recipe
state, anything else: a generic walk, tests/_reachable.py) overlaps one the original reaches. And
behaviourally: a training step of the original (FP8 forward and backward, an SGD step on the FP8
weights, the recipe state's update) leaves every tensor of the copy as it was, and the other way round.
A deepcopy is also a faithful one: it computes what the original computes, and its FP8 weights are
parameters with the original's attributes.

Planted in te_fuser/float8_tensor.py and seen failing (then reverted):
- deepcopy shares the quantizer: `copy.deepcopy(self._quantizer, memo)` -> `self._quantizer` in
  Float8Tensor.__deepcopy__. Every deepcopy case fails the storage check: the copy's weights write
  through the original's recipe scale and amax (until a forward of the copy points them at its own);
  with delayed scaling, whose step moves that amax, the behavioural one too.
- load_state_dict shares the scale: `self._scale_inv.copy_(src._scale_inv)` -> `self._scale_inv =
  src._scale_inv` in quantize_'s FP8-to-FP8 copy. The in-memory state_dict cases fail the storage
  check; with current scaling (the step picks a new scale) the behavioural one too.
Found by the last check (fixed): a deepcopy's FP8 weights were no longer parameters
(isinstance(w, nn.Parameter) False, `module.weight = module.weight` a TypeError) and had lost their
other attributes (tensor_model_parallel, ...).
"""

import copy
import io

import pytest
import torch

import te_fuser
from te_fuser import recipe

from _reachable import reachable_storages, shared_storages

IN, OUT, TOKENS = 32, 48, 64  # FP8 GEMMs: every dimension a multiple of 16
BF16 = torch.bfloat16
MODULES = {
    "Linear_delayed": (lambda: te_fuser.Linear(IN, OUT, params_dtype=BF16, device="cpu"), recipe.DelayedScaling),
    "Linear_current": (lambda: te_fuser.Linear(IN, OUT, params_dtype=BF16, device="cpu"), recipe.Float8CurrentScaling),
    "LayerNormMLP_delayed": (lambda: te_fuser.LayerNormMLP(IN, 2 * IN, params_dtype=BF16, device="cpu"),
                             recipe.DelayedScaling),
}


def _build(kind, seed):
    make, fp8_recipe = MODULES[kind]
    torch.manual_seed(seed)
    with te_fuser.quantized_model_init(recipe=fp8_recipe()):
        return make()


def _forward(kind, module, x):
    with te_fuser.fp8_autocast(fp8_recipe=MODULES[kind][1]()):
        return module(x)


def _train_step(kind, module, x):
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    _forward(kind, module, x).float().square().mean().backward()
    optimizer.step()
    module.zero_grad(set_to_none=True)


def _snapshot(module):
    return [(path, t.detach().clone()) for path, t in reachable_storages(module, "module")]


def _assert_same(before, after, what):
    assert [path for path, _ in before] == [path for path, _ in after]
    changed = [path for (path, a), (_, b) in zip(before, after) if not torch.equal(a, b)]
    assert not changed, f"{what} changed: {changed}"


def _deepcopy(kind, module):
    return copy.deepcopy(module)


def _state_dict_loaded(kind, module):
    fresh = _build(kind, seed=1)  # other initial values and scales
    fresh.load_state_dict(module.state_dict())
    return fresh


def _state_dict_saved_and_loaded(kind, module):
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    fresh = _build(kind, seed=1)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    return fresh


COPIES = {"deepcopy": _deepcopy, "state_dict": _state_dict_loaded,
          "state_dict_via_BytesIO": _state_dict_saved_and_loaded}


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("kind", list(MODULES))
def test_a_copy_of_an_fp8_module_shares_no_buffer(kind, how, generator):
    x = torch.randn(TOKENS, IN, generator=generator).to(BF16)
    original = _build(kind, seed=0)
    _train_step(kind, original, x)  # scaling state that is not the initial one
    assert torch.equal(_forward(kind, COPIES[how](kind, original), x), _forward(kind, original, x))

    duplicate = COPIES[how](kind, original)  # checked before a forward of its own could mend a link
    shared = shared_storages(original, duplicate)
    assert not shared, f"the {how} shares storages with the original: {shared}"
    for stepped, other, what in ((original, duplicate, f"the {how}"), (duplicate, original, "the original")):
        held, before = _snapshot(other), _snapshot(stepped)
        _train_step(kind, stepped, x)
        assert any(not torch.equal(a, b) for (_, a), (_, b) in zip(before, _snapshot(stepped))), "the step changes"
        _assert_same(held, _snapshot(other), f"{what}, after a training step of the other,")


@pytest.mark.parametrize("kind", list(MODULES))
def test_a_deepcopy_keeps_its_fp8_weights_parameters(kind):
    """As torch's deepcopy of a tensor subclass does: the copy has the original's attributes (its
    __dict__), the parameter flag among them."""
    original = _build(kind, seed=0)
    weights = [name for name, p in original.named_parameters() if isinstance(p, te_fuser.tensor.Float8Tensor)]
    assert weights
    for name in weights:
        getattr(original, name).tensor_model_parallel = True  # an attribute TP code sets on a weight
    duplicate = copy.deepcopy(original)
    for name in weights:
        p, q = getattr(original, name), getattr(duplicate, name)
        assert type(q) is type(p) and isinstance(q, torch.nn.Parameter), name
        assert q.requires_grad and q.tensor_model_parallel is True, name
        setattr(duplicate, name, q)  # a module takes only parameters there
