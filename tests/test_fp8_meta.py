"""Modules' `fp8_meta` (TE's "scaling_fwd" / "scaling_bwd" / "recipe"), the delayed-scaling state in TE's
history layout, FP8GlobalStateManager.get_meta_tensor_key, and TE's update functions (fp8._amax_and_scale_update,
tex.fused_amax_and_scale_update_after_reduction).

References: the delayed-scaling rule written out in float64 / float32 torch math (TE's semantics: row 0 the
amax recorded since the last update, rows 1.. the completed ones oldest first; a tensor that recorded
nothing keeps its history and scale).
"""

import pytest
import torch

import te_fuser
import te_fuser.tex as tex
from fp8_reference import FLT_MAX, reference_delayed_update
from te_fuser.fp8 import FP8GlobalStateManager, _amax_and_scale_update, _default_sf_compute
from te_fuser.quantization import DelayedScalingState
from te_fuser.recipe import DelayedScaling, Float8CurrentScaling, Format
from te_fuser.te_dtype import DType

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _scale(amax, fp8_max, margin):
    """fp8_max / amax / 2^margin in float64, rounded once to float32 (what a float32 division gives)."""
    return (torch.tensor(fp8_max, dtype=torch.float64) / amax.double()).float() / 2.0 ** margin


def _step(layer, x, recipe, **kwargs):
    with te_fuser.fp8_autocast(fp8_recipe=recipe):
        y = layer(x, **kwargs)
    y.backward(torch.ones_like(y))


def test_meta_tensor_keys():
    assert FP8GlobalStateManager.get_meta_tensor_key(forward=True) == "scaling_fwd"
    assert FP8GlobalStateManager.get_meta_tensor_key(forward=False) == "scaling_bwd"
    assert FP8GlobalStateManager.get_meta_tensor_key() == "scaling_fwd"


@pytest.mark.parametrize("module", ["Linear", "LayerNormLinear"])
def test_fp8_meta_is_the_state_te_fuser_casts_with(module, generator):
    layer = getattr(te_fuser, module)(32, 32, device="cpu")
    assert set(layer.fp8_meta) == {"recipe"} and layer.fp8_meta["recipe"] == DelayedScaling()  # TE's default
    recipe = DelayedScaling(amax_history_len=4)
    _step(layer, torch.randn(16, 32, generator=generator), recipe)
    meta = layer.fp8_meta
    fwd, bwd = next(op for op in layer._ops if op.num_forward_quantizers)._fp8_states
    # The state's recipe: an equal one (the modules run one object per distinct recipe, see canonical_recipe).
    assert meta["recipe"] == recipe and meta["scaling_fwd"] is fwd and meta["scaling_bwd"] is bwd
    assert (fwd.mode, fwd.dtype, bwd.mode, bwd.dtype) == ("forward", DType.kFloat8E4M3, "backward", DType.kFloat8E5M2)
    quantizers = fwd.quantizers()
    history = meta["scaling_fwd"].amax_history
    # The quantizers cast with views of the same tensors: their amax is row 0 of the history.
    assert quantizers[1].amax.data_ptr() == history[0, 1:].data_ptr()
    assert quantizers[0].scale.data_ptr() == meta["scaling_fwd"].scale.data_ptr()
    FP8GlobalStateManager.reset()  # quantizers() marked the state for an update: forget it


def test_history_is_in_tes_layout(generator):
    layer = te_fuser.Linear(16, 16, device="cpu")
    recipe = DelayedScaling(amax_history_len=3, margin=1)
    xs = [torch.randn(16, 16, generator=generator) * (step + 1) for step in range(4)]
    for step, x in enumerate(xs):
        with te_fuser.fp8_autocast(fp8_recipe=recipe):
            layer(x)
            history = layer.fp8_meta["scaling_fwd"].amax_history
            assert history[0, 0].item() == x.abs().max().item()  # row 0: recorded during this step
    w_amax = layer.weight.detach().abs().max()
    x_amaxes = torch.stack([x.abs().max() for x in xs])
    # After the last update: row 0 reset, rows 1.. the two newest completed steps, oldest first.
    assert torch.equal(history[:, 0], torch.stack([torch.tensor(0.0), x_amaxes[2], x_amaxes[3]]))
    assert torch.equal(history[:, 1], torch.stack([torch.tensor(0.0), w_amax, w_amax]))
    # The last scale reduced the window of three: the amaxes of steps 1, 2 and 3.
    scale = layer.fp8_meta["scaling_fwd"].scale
    assert scale[0].item() == _scale(x_amaxes[1:].max(), E4M3_MAX, 1).item()


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("is_first_microbatch", [None, True, False])
def test_writes_through_fp8_meta_drive_the_next_update(algo, is_first_microbatch, generator):
    """What TE's test_recipe does: tweak amax_history and scale through fp8_meta, run a step, and find the
    update made from the tweaked tensors. A cached weight (is_first_microbatch=False) records no amax, so
    its column neither rolls nor changes its scale."""
    margin, length = 2, 5
    recipe = DelayedScaling(margin=margin, fp8_format=Format.HYBRID, amax_history_len=length, amax_compute_algo=algo)
    layer = te_fuser.Linear(16, 16, device="cpu")
    _step(layer, torch.randn(16, 16, generator=generator), recipe, is_first_microbatch=True)
    fwd, bwd = layer.fp8_meta["scaling_fwd"], layer.fp8_meta["scaling_bwd"]
    fwd.amax_history.copy_(2 * torch.rand(length, 2, generator=generator) + 0.5)
    fwd.amax_history[0].zero_()
    fwd.scale.copy_(2 * torch.rand(2, generator=generator) + 0.5)
    bwd.amax_history[0].zero_()
    history_fwd, history_bwd, scale_fwd = fwd.amax_history.clone(), bwd.amax_history.clone(), fwd.scale.clone()

    x = torch.randn(16, 16, generator=generator)
    _step(layer, x, recipe, is_first_microbatch=is_first_microbatch)
    weight_cast = is_first_microbatch is not False
    # The input's and the grad's columns: TE's roll with this step's amax last, row 0 reset.
    recorded = torch.stack([x.abs().max(), layer.weight.detach().abs().max()])
    for column in ([0, 1] if weight_cast else [0]):
        expected = torch.cat([torch.zeros(1), history_fwd[2:, column], recorded[column:column + 1]])
        assert torch.equal(fwd.amax_history[:, column], expected), column
        window = torch.cat([history_fwd[1:, column], recorded[column:column + 1]])
        amax = window.max() if algo == "max" else recorded[column]
        assert fwd.scale[column].item() == _scale(amax, E4M3_MAX, margin).item(), column
    if not weight_cast:
        assert torch.equal(fwd.amax_history[:, 1], history_fwd[:, 1]) and fwd.scale[1] == scale_fwd[1]
    # The backward state recorded the gradient's amax (1) and rolled at the end of backward, as TE's does.
    assert torch.equal(bwd.amax_history[:, 0], torch.cat([torch.zeros(1), history_bwd[2:, 0], torch.ones(1)]))
    window = torch.cat([history_bwd[1:, 0], torch.ones(1)])
    amax = window.max() if algo == "max" else torch.tensor(1.0)
    assert bwd.scale[0].item() == _scale(amax, E5M2_MAX, margin).item()


def test_modules_without_one_state_have_no_fp8_meta():
    mlp = te_fuser.LayerNormMLP(32, 64, device="cpu")
    with pytest.raises(AttributeError, match="LayerNormMLP has one FP8 scaling state per linear op"):
        mlp.fp8_meta
    assert not hasattr(mlp, "fp8_meta")  # what client code (Megatron) checks
    with pytest.raises(AttributeError, match="LayerNorm has no FP8 GEMM"):
        te_fuser.LayerNorm(32, device="cpu").fp8_meta


def test_current_scaling_fp8_meta_is_its_stateless_state(generator):
    layer = te_fuser.Linear(16, 16, device="cpu")
    recipe = Float8CurrentScaling()
    _step(layer, torch.randn(16, 16, generator=generator), recipe)
    meta = layer.fp8_meta
    assert meta["recipe"] == recipe and meta["scaling_fwd"].mode == "forward"
    assert meta["scaling_fwd"].dtype is DType.kFloat8E4M3 and meta["scaling_bwd"].dtype is DType.kFloat8E5M2


def test_delayed_state_is_float32_whatever_the_default_dtype():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        state = DelayedScalingState(DelayedScaling(amax_history_len=2), 3)
    finally:
        torch.set_default_dtype(previous)
    assert {t.dtype for t in (state.amax_history, state.amax, state.scale, state.scale_inv)} == {torch.float32}


def test_an_older_state_dict_is_converted_to_tes_layout(generator):
    """te_fuser's states saved before it kept TE's layout ({amax, amax_history newest first}) load into the
    same window, so every later scale is what it would have been."""
    length, n = 4, 3
    old_history = torch.rand(length, n, generator=generator) * 10  # completed amaxes, newest first
    amax = torch.rand(n, generator=generator) * 10
    amax[2] = 0.0
    scale = torch.rand(n, generator=generator) + 0.5
    state = DelayedScalingState(DelayedScaling(amax_history_len=length), n)
    state.load_state_dict({"amax_history": old_history, "amax": amax, "scale": scale, "scale_inv": 1 / scale})
    # TE's layout: the recorded amax in row 0, then the len - 1 newest completed ones, oldest first.
    assert torch.equal(state.amax_history, torch.cat([amax[None], old_history[:-1].flip(0)]))
    state.update()
    window = torch.cat([amax[None], old_history[:-1]])  # the old update's window: the amax and len - 1 completed
    assert state.scale[0].item() == _scale(window[:, 0].max(), E4M3_MAX, 0).item()
    assert state.scale[2].item() == scale[2].item()  # nothing recorded: kept, as TE does
    assert set(state.state_dict()) == {"amax_history", "scale", "scale_inv"}


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_fused_update_after_reduction_matches_the_rule(algo, generator):
    histories = [torch.rand(5, n, generator=generator) * 10 for n in (2, 3)]
    histories[1][0, 1] = 0.0  # recorded nothing, and the buffer has nothing for it either
    scales = [torch.rand(n, generator=generator) + 0.5 for n in (2, 3)]
    buffer = torch.tensor([7.0, 0.0, 3.0, 0.0, 1e-3])  # a zero entry: the history's own row 0 stands
    expected = []
    for history, scale, reduced in zip(histories, scales, buffer.split([2, 3])):
        recorded = history.clone()
        recorded[0] = torch.where(reduced != 0, reduced, history[0])
        expected.append(reference_delayed_update(recorded, scale, E5M2_MAX, 1, algo))
    tex.fused_amax_and_scale_update_after_reduction(buffer, histories, scales, algo, DType.kFloat8E5M2, 1)
    for history, scale, (want_history, want_scale, _) in zip(histories, scales, expected):
        assert torch.equal(history, want_history) and torch.equal(scale, want_scale)
    with pytest.raises(ValueError, match="amax_reduction_buffer has 4 elements, the histories 5 columns"):
        tex.fused_amax_and_scale_update_after_reduction(buffer[:4], histories, scales, algo, DType.kFloat8E5M2, 1)
    with pytest.raises(ValueError, match="amax_histories has 2 tensors but scales 1"):
        tex.fused_amax_and_scale_update_after_reduction(None, histories, scales[:1], algo, DType.kFloat8E5M2, 1)


@pytest.mark.parametrize("case", ["zero", "tiny", "normal", "inf", "nan"])
@pytest.mark.parametrize("fused", [True, False])
def test_tes_scale_update_scenarios(case, fused):
    """TE's test_scale_update_numeric_scenarios, on both of te_fuser's paths: one amax, history_len 1."""
    tiny = torch.tensor(E4M3_MAX) / torch.tensor(FLT_MAX)
    amax, expected = {"zero": (0.0, 1.0), "tiny": ((tiny / 2).item(), FLT_MAX), "normal": (0.75, None),
                      "inf": (float("inf"), 1.0), "nan": (float("nan"), 1.0)}[case]
    expected = _scale(torch.tensor(amax), E4M3_MAX, 0).item() if expected is None else expected
    meta = tex.FP8TensorMeta()
    meta.scale, meta.amax_history = torch.ones(1), torch.tensor([[amax]])
    recipe = DelayedScaling(fp8_format=Format.E4M3)
    if fused:
        tex.fused_amax_and_scale_update_after_reduction(meta.amax_history.clone().view(-1), [meta.amax_history],
                                                        [meta.scale], recipe.amax_compute_algo, DType.kFloat8E4M3,
                                                        recipe.margin)
    else:
        _amax_and_scale_update(meta.amax_history, meta.scale, E4M3_MAX, recipe)
    assert meta.scale.item() == expected


def test_default_sf_compute_keeps_the_scale_where_amax_is_useless():
    amax = torch.tensor([0.0, float("inf"), float("nan"), 2.0, 1e-45])
    scale = torch.full((5,), 3.0)
    got = _default_sf_compute(amax, scale, E4M3_MAX, 1)
    assert got[:3].tolist() == [3.0, 3.0, 3.0] and got[3].item() == 112.0 and got[4].item() == FLT_MAX / 2


@pytest.mark.parametrize("module", ["Linear", "LayerNormMLP"])
def test_init_fp8_metadata_makes_the_state_a_forward_uses(generator, module):
    """TE's pattern (its ONNX tests): init_fp8_metadata inside fp8_autocast, then a scale set on each forward
    quantizer of `quantizers`; the forward casts with those scales (checked against torch's cast)."""
    layer = getattr(te_fuser, module)(32, 32, bias=False)
    x = torch.randn(32, 32, generator=generator)
    layer.init_fp8_metadata(2)  # outside fp8_autocast: nothing to make
    assert layer.quantizers["scaling_fwd"] == []
    with pytest.raises(ValueError, match="num_gemms"):
        layer.init_fp8_metadata(0)
    with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling()):
        layer.init_fp8_metadata(2)
        quantizers = layer.quantizers["scaling_fwd"]
        assert len(quantizers) == (2 if module == "Linear" else 4)
        for q in quantizers:
            q.scale = torch.full((1,), 3.0)
        out = layer(x)
    if module == "Linear":
        qdq = lambda t: (t * 3.0).to(torch.float8_e4m3fn).float() / 3.0  # noqa: E731  (|t| * 3 < 448 here)
        torch.testing.assert_close(out, qdq(x) @ qdq(layer.weight.detach()).t(), atol=1e-5, rtol=1e-5)
    assert [q.scale.item() for q in layer.quantizers["scaling_fwd"]] == [3.0] * len(quantizers)
