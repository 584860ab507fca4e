"""A compiled te_fuser module compiles once, however the training loop writes its autocast: a new, equal
recipe object each step (`fp8_autocast(fp8_recipe=DelayedScaling())` in the loop, as TE users write it) and
the attention backends' first schema check do not make dynamo compile the graph again. Without that, each step
compiled anew (the guard on the recipe's identity failed), and the step after the first compiled again (the
guard on the schema-check cache failed)."""

import pytest
import torch

import te_fuser
from te_fuser.attention.backends import schema
from te_fuser.quantization import FP8GlobalState, canonical_recipe
from te_fuser.recipe import DelayedScaling, Float8CurrentScaling

from _torch_support import compiles_fp8_modules_bitwise, compiles_te_fuser_modules

pytestmark = [compiles_te_fuser_modules, compiles_fp8_modules_bitwise]


@pytest.mark.parametrize("make_recipe", [DelayedScaling, Float8CurrentScaling], ids=["delayed", "current"])
def test_a_new_equal_recipe_each_step_does_not_recompile(make_recipe):
    schema.clear()  # the first check of the attention ops' schemas happens while tracing
    torch.manual_seed(0)
    layer = te_fuser.TransformerLayer(32, 64, 2, hidden_dropout=0.0, attention_dropout=0.0, device="cpu",
                                      self_attn_mask_type="causal")
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(16, 2, 32, requires_grad=True)
    for step in range(3):
        stance = "fail_on_recompile" if step else "default"
        with torch.compiler.set_stance(stance), te_fuser.fp8_autocast(fp8_recipe=make_recipe()):
            out = compiled(x)
        out.sum().backward()


def test_autocast_keeps_the_users_recipe_and_the_modules_run_one_object_per_recipe():
    first = DelayedScaling(amax_history_len=7, margin=5)  # fields no other test uses
    second = DelayedScaling(amax_history_len=7, margin=5)
    other = DelayedScaling(amax_history_len=7, margin=4)
    for recipe in (first, second, other):
        with te_fuser.fp8_autocast(fp8_recipe=recipe):
            assert FP8GlobalState.get_recipe() is recipe  # TE's get_fp8_recipe(): the object given
    assert canonical_recipe(first) is canonical_recipe(second) is first
    assert canonical_recipe(other) is other
