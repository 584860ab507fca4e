"""Hugging Face accelerate 1.15.0, unchanged from PyPI, trains a Llama-style model in FP8 through its
TransformerEngine backend on te_fuser (the `transformer_engine` alias), on CPU.

accelerate finds TE through package metadata (is_transformer_engine_available), swaps the model's
nn.Linear layers for transformer_engine.pytorch.Linear (convert_model) and wraps the forward in
torch.autocast(bf16) and TE's fp8_autocast (apply_fp8_autowrap). Nothing is patched: accelerate's
own code runs on the CPU as it is. CI installs it with `pip install --no-deps accelerate==1.15.0`
(and its imports' packages, see .ci/run).
"""

import importlib.metadata

import pytest
import torch

ACCELERATE_VERSION = "1.15.0"
try:
    _installed = importlib.metadata.version("accelerate")
except importlib.metadata.PackageNotFoundError:
    _installed = None
if _installed != ACCELERATE_VERSION:
    pytest.skip(f"these tests follow accelerate {ACCELERATE_VERSION}, found {_installed} (CI runs: python3 -m pip "
                f"install --no-deps accelerate=={ACCELERATE_VERSION})", allow_module_level=True)

import te_fuser.compat  # noqa: E402
from te_fuser.recipe import DelayedScaling, Format  # noqa: E402

import _fp8_clients as clients  # noqa: E402

RECIPE = dict(fp8_format="HYBRID", amax_history_len=16, amax_compute_algo="max")
# What accelerate builds from RECIPE (apply_fp8_autowrap: te_recipe.DelayedScaling(**kwargs)).
EXPECTED_RECIPE = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")


@pytest.fixture
def alias():
    te_fuser.compat.install_transformer_engine()
    yield
    te_fuser.compat.uninstall_transformer_engine()
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # accelerate's state is a process-wide singleton


def _accelerator(handler: str):
    from accelerate import Accelerator
    from accelerate.utils import FP8RecipeKwargs, TERecipeKwargs

    kwargs = TERecipeKwargs(**RECIPE) if handler == "TERecipeKwargs" else FP8RecipeKwargs(backend="TE", **RECIPE)
    return Accelerator(mixed_precision="fp8", cpu=True, kwargs_handlers=[kwargs])


def _prepared(handler):
    accelerator = _accelerator(handler)
    model = clients.build_model()
    optimizer = clients.sgd(model)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


@pytest.mark.filterwarnings("ignore:FP8RecipeKwargs is deprecated")  # in favour of TERecipeKwargs; still accepted
@pytest.mark.parametrize("handler", ["TERecipeKwargs", "FP8RecipeKwargs"])
def test_accelerator_trains_in_fp8_on_te_fuser(alias, handler):
    accelerator, model, optimizer = _prepared(handler)
    assert accelerator.fp8_backend == "TE"
    found, walk = clients.graph_walk(model)
    losses = clients.train(model, optimizer, accelerator.backward, on_last_backward=walk)
    clients.assert_fp8_ran(model, EXPECTED_RECIPE)
    clients.assert_losses_near_reference(losses)
    assert not found, found


def test_memory_is_flat_across_steps(alias):
    accelerator, model, optimizer = _prepared("TERecipeKwargs")
    clients.train(model, optimizer, accelerator.backward)
    assert clients.retained_per_step(model, optimizer, accelerator.backward) == [0, 0]


def test_convert_model_and_fp8_autowrap_without_accelerator(alias):
    """accelerate's utilities on their own, as scripts use them (after making an Accelerator, which they
    need): float32 weights, no torch.autocast."""
    from accelerate import Accelerator
    from accelerate.utils import TERecipeKwargs, apply_fp8_autowrap, convert_model, has_transformer_engine_layers

    Accelerator(cpu=True)
    model = clients.build_model()
    with torch.no_grad():
        convert_model(model)
    assert has_transformer_engine_layers(model)
    model = apply_fp8_autowrap(model, TERecipeKwargs(**RECIPE))
    optimizer = clients.sgd(model)
    losses = clients.train(model, optimizer)
    clients.assert_fp8_ran(model, EXPECTED_RECIPE)
    clients.assert_losses_near_reference(losses)


def test_controls_catch_what_is_left(alias):
    """Bug-on controls: with te_fuser's fuser keeping its saved tensors, the graph walk finds them; a step
    that keeps its loss alive leaves bytes allocated."""
    accelerator, model, optimizer = _prepared("TERecipeKwargs")
    found, walk = clients.graph_walk(model)
    with clients.fuser_release_off():
        clients.train(model, optimizer, accelerator.backward, on_last_backward=walk)
    assert any("_FuserFunctionBackward" in path for path, _, _ in found), found
    assert all(retained > 0 for retained in clients.retained_per_step(model, optimizer, accelerator.backward,
                                                                      keep=[], steps=1))
