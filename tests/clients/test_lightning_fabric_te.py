"""Lightning 2.6.0 Fabric, unchanged from PyPI, trains a Llama-style model in FP8 with its
TransformerEnginePrecision plugin on te_fuser (the `transformer_engine` alias), on CPU.

The plugin checks for TE with RequirementCache("transformer_engine>=0.11.0") (package metadata),
replaces nn.Linear with transformer_engine.pytorch.Linear, casts the model to weights_dtype, and runs
each forward with torch's default dtype set to weights_dtype inside TE's fp8_autocast. Nothing is
patched. The plugin also enters torch.autocast("cuda", ...) around the forward, its own CUDA
assumption: without CUDA torch disables that autocast with a warning, silenced here. CI installs
Lightning with `pip install --no-deps lightning==2.6.0` (and its imports' packages, see .ci/run).
"""

import importlib.metadata

import pytest
import torch

LIGHTNING_VERSION = "2.6.0"
try:
    _installed = importlib.metadata.version("lightning")
except importlib.metadata.PackageNotFoundError:
    _installed = None
if _installed != LIGHTNING_VERSION:
    pytest.skip(f"these tests follow lightning {LIGHTNING_VERSION}, found {_installed} (CI runs: python3 -m pip "
                f"install --no-deps lightning=={LIGHTNING_VERSION})", allow_module_level=True)

import te_fuser.compat  # noqa: E402
from te_fuser.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

import _fp8_clients as clients  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:CUDA is not available or torch_xla is imported")

WEIGHTS = {"bf16": torch.bfloat16, "float32": torch.float32}
RECIPES = {"delayed": DelayedScaling(amax_history_len=16), "current": Float8CurrentScaling()}


@pytest.fixture
def alias():
    te_fuser.compat.install_transformer_engine()
    yield
    te_fuser.compat.uninstall_transformer_engine()


def _setup(weights, recipe):
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import TransformerEnginePrecision

    precision = TransformerEnginePrecision(weights_dtype=WEIGHTS[weights], recipe=RECIPES[recipe])
    fabric = Fabric(accelerator="cpu", devices=1, plugins=precision)
    # The optimizer comes after setup_module: the plugin replaces nn.Linear modules, and with them their
    # parameters (as with TE itself; accelerate remaps an optimizer's parameters, Fabric does not).
    model = fabric.setup_module(clients.build_model())
    optimizer = fabric.setup_optimizers(clients.sgd(model))
    assert {p.dtype for p in model.parameters()} == {WEIGHTS[weights]}
    return fabric, model, optimizer


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_fabric_trains_in_fp8_on_te_fuser(alias, weights, recipe):
    fabric, model, optimizer = _setup(weights, recipe)
    found, walk = clients.graph_walk(model)
    losses = clients.train(model, optimizer, fabric.backward, on_last_backward=walk)
    # Under bf16 default dtype (weights bf16) the delayed-scaling state is float32 all the same.
    clients.assert_fp8_ran(model, RECIPES[recipe])
    clients.assert_losses_near_reference(losses)
    assert not found, found


def test_memory_is_flat_across_steps(alias):
    fabric, model, optimizer = _setup("bf16", "delayed")
    clients.train(model, optimizer, fabric.backward)
    assert clients.retained_per_step(model, optimizer, fabric.backward) == [0, 0]


def test_controls_catch_what_is_left(alias):
    """Bug-on controls: with te_fuser's fuser keeping its saved tensors, the graph walk finds them; a step
    that keeps its loss alive leaves bytes allocated."""
    fabric, model, optimizer = _setup("bf16", "delayed")
    found, walk = clients.graph_walk(model)
    with clients.fuser_release_off():
        clients.train(model, optimizer, fabric.backward, on_last_backward=walk)
    assert any("_FuserFunctionBackward" in path for path, _, _ in found), found
    assert all(retained > 0 for retained in clients.retained_per_step(model, optimizer, fabric.backward,
                                                                      keep=[], steps=1))
