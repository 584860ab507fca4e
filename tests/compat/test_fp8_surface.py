"""FP8GlobalStateManager, fp8_model_init / quantized_model_init, TE's recipe arguments, QuantizedTensor."""

import inspect

import pytest
import torch

import te_fuser
from te_fuser.fp8 import FP8GlobalStateManager, fp8_model_init, quantized_model_init
from te_fuser.quantization import FP8GlobalState
from te_fuser.recipe import (CustomRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format,
                             MMParams, MXFP8BlockScaling, NVFP4BlockScaling, QParams)


def test_manager_reports_the_autocast_state():
    assert not FP8GlobalStateManager.is_fp8_enabled()
    assert FP8GlobalStateManager.get_fp8_recipe() == DelayedScaling()  # TE's default outside autocast
    assert FP8GlobalStateManager.get_fp8_group() is None
    recipe, group = DelayedScaling(margin=2), object()
    with te_fuser.fp8_autocast(fp8_recipe=recipe, fp8_group=group):
        assert FP8GlobalStateManager.is_fp8_enabled() and not FP8GlobalStateManager.is_fp8_calibration()
        assert FP8GlobalStateManager.get_fp8_recipe() is recipe and FP8GlobalStateManager.get_fp8_group() is group
        state = FP8GlobalStateManager.quantization_state
        assert state.fp8_enabled and state.fp8_recipe is recipe and state.fp8_distributed_group is group
        assert state.autocast_depth == 1 and state.fp8_parameters is False
        assert FP8GlobalStateManager.is_first_fp8_module()
        assert not FP8GlobalStateManager.is_first_fp8_module()  # once per outermost autocast
        with te_fuser.fp8_autocast(enabled=False, calibrating=True):
            assert not FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.is_fp8_calibration()
            assert not FP8GlobalStateManager.is_first_fp8_module()  # nesting does not reset it
    with te_fuser.fp8_autocast():
        assert FP8GlobalStateManager.quantization_state.is_first_fp8_module
        FP8GlobalStateManager.quantization_state.is_first_fp8_module = False
        assert not FP8GlobalStateManager.is_first_fp8_module()
    assert not FP8GlobalStateManager.with_fp8_parameters() and not FP8GlobalStateManager.fp8_graph_capturing()


def test_fp8_availability_on_this_machine():
    available, reason = FP8GlobalStateManager.is_fp8_available()
    if not torch.cuda.is_available():
        assert (available, reason) == (True, "")  # te_fuser's FP8 runs on the CPU
    else:
        assert available == (torch.cuda.get_device_capability() >= (8, 9))
    # The block-scaled recipes run on the CPU only so far.
    for check in (FP8GlobalStateManager.is_mxfp8_available, FP8GlobalStateManager.is_fp8_block_scaling_available):
        available, reason = check()
        assert available == (not torch.cuda.is_available()) and ("CPU only" in reason) == torch.cuda.is_available()


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="a torch built without CUDA")
def test_block_scaling_available_when_cuda_is_only_claimed(monkeypatch):
    """A torch built without CUDA makes only CPU tensors, so the block-scaled recipes stay available even when
    torch.cuda claims a device (as TE's test suite's CUDA-to-CPU shim makes it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for check in (FP8GlobalStateManager.is_mxfp8_available, FP8GlobalStateManager.is_fp8_block_scaling_available,
                  FP8GlobalStateManager.is_nvfp4_available):
        assert check() == (True, "")


def test_reduce_and_update_updates_only_the_asked_direction():
    layer = te_fuser.Linear(32, 32, device="cpu")
    recipe = DelayedScaling(amax_history_len=2)
    with te_fuser.fp8_autocast(fp8_recipe=recipe):
        out = layer(torch.randn(16, 32) * 5)
    out.sum().backward()  # records the backward amax and updates the backward scale, as TE's does
    fwd, bwd = layer._ops[0]._fp8_states
    with te_fuser.fp8_autocast(fp8_recipe=recipe):
        layer(torch.randn(16, 32) * 50)  # a larger input amax: its scale must drop
        bwd.amax.fill_(1e4)  # as if a backward had recorded a larger gradient amax: its scale must drop
        before_fwd, before_bwd = fwd.scale.clone(), bwd.scale.clone()
        FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=True)
        assert fwd.scale[0] < before_fwd[0] and torch.equal(bwd.scale, before_bwd)
        assert any(s is bwd for s in FP8GlobalState._pending) and not any(s is fwd for s in FP8GlobalState._pending)
        FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
        assert bwd.scale[0] < before_bwd[0]


@pytest.mark.parametrize("init", [fp8_model_init, quantized_model_init])
def test_model_init_contexts(init):
    # Megatron probes the optional arguments with inspect.signature.
    assert list(inspect.signature(init).parameters) == ["enabled", "recipe", "preserve_high_precision_init_val"]
    with init(enabled=False, recipe=DelayedScaling(), preserve_high_precision_init_val=True):
        layer = te_fuser.Linear(16, 16, device="cpu")
    assert layer.weight.dtype == torch.float32 and not isinstance(layer.weight, te_fuser.QuantizedTensor)
    with init(enabled=True, recipe=DelayedScaling()):
        assert FP8GlobalStateManager.with_fp8_parameters()
        layer = te_fuser.Linear(16, 16, device="cpu")
    assert not FP8GlobalStateManager.with_fp8_parameters()
    assert isinstance(layer.weight, te_fuser.QuantizedTensor) and layer.weight.dtype == torch.float32
    with pytest.raises(TypeError, match="recipe must be DelayedScaling or Float8CurrentScaling"):
        with init(recipe="hybrid"):
            pass
    assert te_fuser.fp8_model_init is fp8_model_init and te_fuser.quantized_model_init is quantized_model_init


def test_recipes_accept_what_te_ignores_and_reject_the_rest():
    # What megatron/core/fp8_utils.py passes to DelayedScaling.
    recipe = DelayedScaling(margin=0, fp8_format=Format.HYBRID, amax_compute_algo="max", amax_history_len=16,
                            override_linear_precision=(False, False, True), fp8_dpa=False, fp8_mha=False,
                            params_dtype=torch.bfloat16, device="cpu")
    assert recipe == DelayedScaling(amax_history_len=16)
    assert "params_dtype" not in vars(recipe) and "override_linear_precision" not in vars(recipe)
    assert Float8CurrentScaling(fp8_format=Format.E4M3, fp8_dpa=True, params_dtype=torch.float32, device="cpu")
    with pytest.raises(TypeError, match="unexpected keyword argument 'amax_history_length'"):
        DelayedScaling(amax_history_length=4)
    with pytest.raises(TypeError, match="scaling_factor_compute_algo must be None or a callable"):
        DelayedScaling(scaling_factor_compute_algo="max")
    assert DelayedScaling.delayed() and recipe.delayed() and not recipe.float8_current_scaling()
    assert Float8CurrentScaling().float8_per_tensor_scaling() and not DelayedScaling.mxfp8()


def test_format_values_are_tes_maxima():
    """TE's Format members hold _FormatHelper(max_fwd, max_bwd) (TE's tests read Format.HYBRID.value.max_fwd);
    the torch dtypes they stand for, from torch's own tables."""
    for fmt, (fwd, bwd) in {Format.E4M3: (torch.float8_e4m3fn,) * 2, Format.E5M2: (torch.float8_e5m2,) * 2,
                            Format.HYBRID: (torch.float8_e4m3fn, torch.float8_e5m2)}.items():
        assert (fmt.fwd_dtype, fmt.bwd_dtype) == (fwd, bwd)
        assert (fmt.value.max_fwd, fmt.value.max_bwd) == (torch.finfo(fwd).max, torch.finfo(bwd).max)
        assert fmt.value == (fmt.max_fwd, fmt.max_bwd)


def test_custom_recipe_takes_tes_fields():
    """TE 2.9's CustomRecipe(qfactory, fp8_dpa, fp8_mha), with later TE's fp8_format (HYBRID by default);
    qfactory is required, as in TE (tests/modules/test_custom_recipe.py runs it)."""
    def factory(role):
        return te_fuser.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)

    recipe = CustomRecipe(qfactory=factory)
    assert (recipe.qfactory, recipe.fp8_format, recipe.fp8_dpa, recipe.fp8_mha) == (factory, Format.HYBRID, False,
                                                                                     False)
    assert recipe.custom() and not recipe.float8_per_tensor_scaling() and not DelayedScaling.custom()
    with pytest.raises(TypeError, match="qfactory"):
        CustomRecipe(fp8_format=Format.HYBRID)


def test_nvfp4_recipe_takes_tes_fields_and_derives_its_qparams():
    recipe = NVFP4BlockScaling()
    assert recipe.nvfp4() and not recipe.mxfp8() and not recipe.float8_block_scaling()
    assert (recipe.fp4_format, recipe.fp8_format) == (Format.E2M1, Format.E4M3)
    assert (recipe.disable_rht, recipe.disable_stochastic_rounding, recipe.disable_2d_quantization) == (False,) * 3
    # TE's defaults: the transform on the input's and the gradient's (columnwise) data, stochastic rounding
    # on gradients, 16x16 blocks on weights.
    assert recipe.fp4_quant_fwd_inp == QParams(random_hadamard_transform=True)
    assert recipe.fp4_quant_fwd_weight == QParams(fp4_2d_quantization=True)
    assert recipe.fp4_quant_bwd_grad == QParams(random_hadamard_transform=True, stochastic_rounding=True)
    plain = NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True,
                              params_dtype=torch.bfloat16)
    assert plain.fp4_quant_fwd_inp == plain.fp4_quant_fwd_weight == plain.fp4_quant_bwd_grad == QParams()
    assert Format.E2M1.value == (6.0, 6.0)
    with pytest.raises(ValueError, match="no torch dtype"):
        Format.E2M1.fwd_dtype
    with pytest.raises(ValueError, match="fp4_format"):
        NVFP4BlockScaling(fp4_format=Format.E4M3)
    with pytest.raises(ValueError, match="fp8_format"):
        NVFP4BlockScaling(fp8_format=Format.E5M2)
    assert NVFP4BlockScaling(fp8_dpa=True).fp8_dpa  # FP8 attention beside NVFP4 linears: NVTE_DPA_FP8_RECIPE
    with pytest.raises(NotImplementedError, match="fp8_mha"):
        NVFP4BlockScaling(fp8_mha=True)
    with pytest.raises(NotImplementedError, match="backward_override"):
        NVFP4BlockScaling(backward_override="dequantized")
    with pytest.raises(TypeError, match="fp4_quant_fwd_inp"):
        NVFP4BlockScaling(fp4_quant_fwd_inp=QParams())
    with pytest.raises(ValueError, match="NVFP4BlockScaling"):
        MXFP8BlockScaling(fp8_format=Format.E2M1)


def test_block_scaled_recipes_take_tes_fields():
    recipe = Float8BlockScaling(fp8_format=Format.HYBRID, fp8_quant_fwd_inp=QParams(power_2_scale=False,
                                                                                   amax_epsilon=1e-6),
                                x_block_scaling_dim=1, w_block_scaling_dim=2, grad_block_scaling_dim=1,
                                fp8_gemm_fprop=MMParams(use_split_accumulator=True), params_dtype=torch.bfloat16)
    assert recipe.float8_block_scaling() and not recipe.mxfp8() and not recipe.float8_per_tensor_scaling()
    assert recipe.fp8_quant_fwd_inp.amax_epsilon == 1e-6 and recipe.fp8_quant_fwd_weight.power_2_scale  # TE's default
    mx = MXFP8BlockScaling(margin=0, fp8_format=Format.E4M3, backward_override=None, enable_2d_quantization=False)
    assert mx.mxfp8() and mx == MXFP8BlockScaling()
    with pytest.warns(UserWarning, match="HYBRID"):
        MXFP8BlockScaling(fp8_format=Format.HYBRID)
    with pytest.raises(ValueError, match="E5M2"):
        MXFP8BlockScaling(fp8_format=Format.E5M2)
    with pytest.raises(NotImplementedError, match="enable_2d_quantization"):
        MXFP8BlockScaling(enable_2d_quantization=True)
    with pytest.raises(ValueError, match="x_block_scaling_dim and w_block_scaling_dim are both 2"):
        Float8BlockScaling(x_block_scaling_dim=2)
    with pytest.raises(ValueError, match="fp8_gemm_dgrad"):
        Float8BlockScaling(fp8_gemm_dgrad=MMParams(use_split_accumulator=False))
    with pytest.raises(ValueError, match="amax_epsilon"):
        QParams(amax_epsilon=-1.0)
    with pytest.raises(NotImplementedError, match="backward_override"):
        Float8BlockScaling(backward_override="high_precision")


def _te_reference_update(te_history, scale, fp8_max, recipe):
    """TE's unfused update: amax from the callable (or max), scale from the callable, roll the history."""
    amax = recipe.amax_compute_algo(te_history) if callable(recipe.amax_compute_algo) else te_history.max(0).values
    new_scale = recipe.scaling_factor_compute_algo(amax, scale, fp8_max, recipe)
    return torch.roll(te_history, -1, 0).index_fill_(0, torch.tensor([0]), 0.0), new_scale


def test_callable_amax_and_scaling_factor_algorithms(generator):
    def mean_of_history(history):  # a window statistic where the rows' meaning matters
        return history.mean(dim=0) + history[0]

    def quarter_scale(amax, scale, fp8_max, recipe):
        return torch.where(amax > 0, torch.full_like(amax, fp8_max) / amax / 4, scale)

    recipe = DelayedScaling(amax_history_len=3, amax_compute_algo=mean_of_history,
                            scaling_factor_compute_algo=quarter_scale)
    layer = te_fuser.Linear(32, 32, bias=False, device="cpu")
    te_history, te_scale = torch.zeros(3, 2), torch.ones(2)
    for factor in (1.0, 8.0, 0.25, 2.0):
        x = torch.randn(16, 32, generator=generator) * factor
        with torch.no_grad(), te_fuser.fp8_autocast(fp8_recipe=recipe):
            layer(x)
        te_history[0] = torch.stack([x.abs().max(), layer.weight.detach().abs().max()])
        te_history, te_scale = _te_reference_update(te_history, te_scale, 448.0, recipe)
        fwd = layer._ops[0]._fp8_states[0]
        assert torch.equal(fwd.scale, te_scale), (factor, fwd.scale, te_scale)
        assert torch.equal(fwd.scale_inv, 1.0 / te_scale)
        assert torch.equal(fwd.amax_history, te_history)


def test_quantized_tensor_base():
    from te_fuser.tensor import Float8Tensor, QuantizedTensor

    x8 = te_fuser.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(torch.randn(16, 16))
    assert isinstance(x8, QuantizedTensor) and Float8Tensor is te_fuser.Float8Tensor
    assert te_fuser.QuantizedTensor is QuantizedTensor
    assert isinstance(x8, torch.Tensor) and x8.shape == (16, 16) and x8.dtype == torch.float32
