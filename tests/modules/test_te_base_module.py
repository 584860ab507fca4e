"""TransformerEngineBaseModule (TE's `module.base`): the base of te_fuser's GEMM modules, and the FP8
bookkeeping a user's own module gets from it (prepare_forward, recipe states in TE's slots, their
quantizers, TE's `_extra_state`).

References: the delayed-scaling rule in float32 torch math (fp8_reference.reference_delayed_update), torch's
own float8 casts, float64 matmuls, and te_fuser.Linear's `_extra_state` for TE's slot layout.
"""

import warnings

import pytest
import torch

import te_fuser
from fp8_reference import reference_delayed_update, reference_quantize
from te_fuser.fp8 import FP8GlobalStateManager
from te_fuser.module.base import TransformerEngineBaseModule
from te_fuser.recipe import DelayedScaling, Float8CurrentScaling
from te_fuser.tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer

E4M3_MAX = 448.0


class CustomLinear(TransformerEngineBaseModule):
    """A user's module as TE's tests write them: its own GEMM on the quantizers prepare_forward made."""

    def __init__(self, features: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(features, features))

    def forward(self, inp):
        with self.prepare_forward(inp, num_gemms=1) as inp:
            if not self.fp8:
                return inp @ self.weight.t()
            x = self.quantizers["scaling_fwd"][0](inp).dequantize()
            w = self.quantizers["scaling_fwd"][1](self.weight).dequantize()
            return x @ w.t()


@pytest.fixture(autouse=True)
def _reset_state():
    yield
    FP8GlobalStateManager.reset()


def _custom(generator, features=32):
    module = CustomLinear(features)
    with torch.no_grad():
        module.weight.copy_(torch.randn(features, features, generator=generator))
    return module


def test_te_fuser_gemm_modules_are_base_modules():
    for module in (te_fuser.Linear(16, 16), te_fuser.LayerNormLinear(16, 16), te_fuser.LayerNormMLP(16, 32),
                   te_fuser.GroupedLinear(2, 16, 16)):
        assert isinstance(module, TransformerEngineBaseModule)


def test_linear_quantizers_are_its_fp8_state(generator):
    layer = te_fuser.Linear(32, 32)
    assert layer.quantizers == {"scaling_fwd": [], "scaling_bwd": []}  # FP8 never ran
    with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling()):
        layer(torch.randn(16, 32, generator=generator)).sum().backward()
    fwd = layer.fp8_meta["scaling_fwd"]
    quantizers = layer.quantizers["scaling_fwd"]
    assert all(isinstance(q, Float8Quantizer) for q in quantizers) and len(quantizers) == fwd.scale.numel()
    assert quantizers[1].scale.data_ptr() == fwd.scale[1:].data_ptr()
    assert quantizers[1].amax.data_ptr() == fwd.amax_history[0, 1:].data_ptr()


def test_prepare_forward_makes_tes_slots_and_the_update_follows_the_recipe(generator):
    module = _custom(generator)
    recipe = DelayedScaling(amax_history_len=3, margin=1, amax_compute_algo="max")
    x = torch.randn(16, 32, generator=generator) * 3
    with te_fuser.fp8_autocast(fp8_recipe=recipe):
        y = module(x)
    meta = module.fp8_meta
    fwd, bwd = meta["scaling_fwd"], meta["scaling_bwd"]
    assert (fwd.scale.numel(), bwd.scale.numel()) == (3, 2) and meta["recipe"] == recipe and module.fp8
    assert [q.scale.data_ptr() for q in module.quantizers["scaling_fwd"]] == [
        fwd.scale[i:].data_ptr() for i in range(3)]
    # The forward cast with scale 1; the autocast exit then updated the scales from the recorded amaxes.
    expected_y = (reference_quantize(x, torch.ones(1), torch.float8_e4m3fn).double()
                  @ reference_quantize(module.weight.detach(), torch.ones(1), torch.float8_e4m3fn).double().t())
    torch.testing.assert_close(y.double(), expected_y)
    recorded = torch.zeros(3, 3)
    recorded[0, :2] = torch.stack([x.abs().amax(), module.weight.detach().abs().amax()])
    history, scale, scale_inv = reference_delayed_update(recorded, torch.ones(3), E4M3_MAX, 1, "max")
    torch.testing.assert_close(fwd.amax_history, history, rtol=0, atol=0)
    torch.testing.assert_close(fwd.scale, scale, rtol=0, atol=0)
    torch.testing.assert_close(fwd.scale_inv, scale_inv)


def test_extra_state_is_tes_format_both_ways(generator):
    """A custom module's `_extra_state` loads into te_fuser.Linear (TE's slots: input 0, weight 1) and back."""
    module = _custom(generator)
    for _ in range(2):
        with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4)):
            module(torch.randn(16, 32, generator=generator))
    state = module.get_extra_state()
    assert state.dtype == torch.uint8 and state.numel() > 0
    layer = te_fuser.Linear(32, 32)
    layer.set_extra_state(state)
    fwd = module.fp8_meta["scaling_fwd"]
    torch.testing.assert_close(layer.fp8_meta["scaling_fwd"].scale, fwd.scale[:2], rtol=0, atol=0)
    torch.testing.assert_close(layer.fp8_meta["scaling_fwd"].amax_history, fwd.amax_history[:, :2], rtol=0, atol=0)
    fresh = CustomLinear(32)
    fresh.set_extra_state(layer.get_extra_state())
    assert fresh.fp8_meta["recipe"] == DelayedScaling(amax_history_len=4)
    torch.testing.assert_close(fresh.fp8_meta["scaling_fwd"].scale[:2], fwd.scale[:2], rtol=0, atol=0)
    torch.testing.assert_close(fresh.fp8_meta["scaling_fwd"].scale_inv, 1 / fresh.fp8_meta["scaling_fwd"].scale)
    assert CustomLinear(32).get_extra_state().numel() == 0  # no FP8 ran: TE's empty tensor


def test_reset_and_restore_meta_tensors(generator):
    module = _custom(generator)
    with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=2)):
        module(torch.randn(16, 32, generator=generator))
    saved = module.get_fp8_meta_tensors()
    fwd = module.fp8_meta["scaling_fwd"]
    assert saved["scaling_fwd"][0].data_ptr() != fwd.scale.data_ptr()  # copies
    module.reset_fp8_meta_tensors()
    assert (fwd.scale == 1).all() and (fwd.amax_history == 0).all() and (fwd.scale_inv == 1).all()
    module.reset_fp8_meta_tensors(saved)
    torch.testing.assert_close(fwd.scale, saved["scaling_fwd"][0], rtol=0, atol=0)
    torch.testing.assert_close(fwd.amax_history, saved["scaling_fwd"][1], rtol=0, atol=0)


def test_history_length_change_keeps_rows_and_scales(generator):
    module = _custom(generator)
    with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=3)):
        module(torch.randn(16, 32, generator=generator))
    before = module.fp8_meta["scaling_fwd"]
    history, scale = before.amax_history.clone(), before.scale.clone()
    with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=5)):
        module.init_fp8_metadata(num_gemms=1)
    after = module.fp8_meta["scaling_fwd"]
    assert after.amax_history.shape == (5, 3)
    torch.testing.assert_close(after.amax_history[:3], history, rtol=0, atol=0)
    assert (after.amax_history[3:] == 0).all()
    torch.testing.assert_close(after.scale, scale, rtol=0, atol=0)
    assert module.quantizers["scaling_fwd"][0].scale.data_ptr() == after.scale.data_ptr()


def test_recipe_kind_change_warns_and_replaces_the_states(generator):
    module = _custom(generator)
    x = torch.randn(16, 32, generator=generator)
    with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling()):
        module(x)
    assert all(isinstance(q, Float8Quantizer) for q in module.quantizers["scaling_fwd"])
    with pytest.warns(UserWarning, match="Recipe type changed from DelayedScaling to Float8CurrentScaling"):
        with te_fuser.fp8_autocast(fp8_recipe=Float8CurrentScaling()):
            y = module(x)
    assert all(isinstance(q, Float8CurrentScalingQuantizer) for q in module.quantizers["scaling_fwd"])
    w = module.weight.detach()
    scale = lambda t: E4M3_MAX / t.abs().amax()  # noqa: E731  current scaling: each tensor's own amax
    expected = ((reference_quantize(x, scale(x), torch.float8_e4m3fn).double() / scale(x).double())
                @ (reference_quantize(w, scale(w), torch.float8_e4m3fn).double() / scale(w).double()).t())
    torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=1e-6)


def test_outside_fp8_autocast_and_dtype_checks(generator):
    module = _custom(generator)
    x = torch.randn(8, 32, generator=generator)
    torch.testing.assert_close(module(x), x @ module.weight.detach().t())
    assert not module.fp8 and module.activation_dtype == torch.float32 and "scaling_fwd" not in module.fp8_meta
    with pytest.raises(TypeError, match="'weight'"):
        module(x.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module(x)
    assert module.activation_dtype == torch.bfloat16
    with pytest.raises(TypeError, match="prepare_forward"):
        with te_fuser.Linear(16, 16).prepare_forward(x):
            pass
    for method, args in (("set_meta_tensor", (True, DelayedScaling())), ("adjust_amax_history_length", (4,))):
        with pytest.raises(TypeError, match=method):  # te_fuser's modules: their ops make the state
            getattr(te_fuser.Linear(16, 16), method)(*args)
    with pytest.raises(ValueError, match="length"):
        module.adjust_amax_history_length(0)


@pytest.mark.parametrize("module", ["Linear", "LayerNormMLP"])
def test_te_fuser_modules_warn_when_the_recipe_kind_changes(generator, module):
    layer = getattr(te_fuser, module)(32, 32)
    x = torch.randn(32, 32, generator=generator)
    with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling()):
        layer(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same kind (another margin) and no FP8 weights: no warning
        with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling(margin=1, amax_history_len=4)):
            layer(x)
        layer(x)  # outside fp8_autocast
    with pytest.warns(UserWarning, match="Recipe type changed from DelayedScaling to Float8CurrentScaling"):
        with te_fuser.fp8_autocast(fp8_recipe=Float8CurrentScaling()):
            layer(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the state follows the new recipe now
        with te_fuser.fp8_autocast(fp8_recipe=Float8CurrentScaling()):
            layer(x)
    quantizers = layer.quantizers["scaling_fwd"]
    assert len(quantizers) == (4 if module == "LayerNormMLP" else 2)  # input and weight per linear op
    assert all(isinstance(q, Float8CurrentScalingQuantizer) for q in quantizers)


def test_fp8_weights_warn_when_the_history_length_changes(generator):
    with te_fuser.fp8_model_init(recipe=DelayedScaling(amax_history_len=16)):
        layer = te_fuser.Linear(32, 32)
    with pytest.warns(UserWarning, match="Quantizer is being updated"):
        with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=1)):
            layer(torch.randn(32, 32, generator=generator))
    assert layer.fp8_meta["scaling_fwd"].amax_history.shape[0] == 1
