"""DotProductAttention's `_extra_state` in TE's format.

Facts from TE's source (transformer_engine/pytorch/attention/dot_product_attention/):
DotProductAttention is a TE base module that runs prepare_forward(num_gemms=3), so
its payload has 9 forward and 6 backward slots; its FP8 attention scales q, k
and v together in forward slot 2 (META_QKV = GEMM1_OUTPUT), O in slot 3, S in
slot 8, and dQKV / dO / dP in backward slots 0 / 3 / 5. TE 1.6 and 1.7 saved
that payload under `core_attention.fused_attention._extra_state`; TE <= 1.5
saved none.
"""

import io
import os
import pickle

import pytest
import torch

import te_fuser
from te_fuser.kernels import cpu
from te_fuser.module._te_pickle import UnsafeExtraStateError, safe_loads
from te_fuser.recipe import DelayedScaling, Float8CurrentScaling
from test_extra_state import E4M3_MAX, random_te_state, te_payload, te_update

HEADS, HEAD_DIM, BATCH, SEQ = 2, 16, 2, 8
QKV_SLOT, PER_TENSOR_SLOTS = 2, [0, 1, 4]

# TE's TransformerLayer(fuse_qkv_params=True) state_dict names (TE's LayerNormLinear / Linear /
# LayerNormMLP / DotProductAttention, each TE base module with an `_extra_state`).
TE_TRANSFORMER_LAYER_KEYS = {
    "self_attention.layernorm_qkv.layer_norm_weight", "self_attention.layernorm_qkv.layer_norm_bias",
    "self_attention.layernorm_qkv.weight", "self_attention.layernorm_qkv.bias",
    "self_attention.layernorm_qkv._extra_state",
    "self_attention.core_attention._extra_state",
    "self_attention.proj.weight", "self_attention.proj.bias", "self_attention.proj._extra_state",
    "layernorm_mlp.layer_norm_weight", "layernorm_mlp.layer_norm_bias", "layernorm_mlp.fc1_weight",
    "layernorm_mlp.fc1_bias", "layernorm_mlp.fc2_weight", "layernorm_mlp.fc2_bias", "layernorm_mlp._extra_state",
}


def _dpa():
    return te_fuser.DotProductAttention(HEADS, HEAD_DIM, qkv_format="bshd", attn_mask_type="no_mask")


def _qkv(generator, factors=(1.0, 1.0, 1.0)):
    return [torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, generator=generator) * f for f in factors]


def _reference(q, k, v, scales):
    """float64 attention on q, k, v cast to E4M3 with `scales` by torch (what fp8_dpa computes)."""
    q, k, v = ((t.float() * s).to(torch.float8_e4m3fn).double() / float(s) for t, s in zip((q, k, v), scales))
    scores = torch.einsum("bshd,bthd->bhst", q, k) / HEAD_DIM ** 0.5
    out = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v)
    return out.reshape(BATCH, SEQ, HEADS * HEAD_DIM)


def _te_dpa_state(fake_te, generator, length, margin=0, algo="max"):
    state = random_te_state(fake_te, generator, length, num_gemms=3, margin=margin, algo=algo)
    state["recipe"].fp8_dpa = True
    # A QKV scale that puts q, k, v deep in E4M3's subnormals: the output shows which scale was used.
    state["scale_fwd"][QKV_SLOT] = 0.004 + 0.004 * torch.rand((), generator=generator).item()
    return state


@pytest.mark.parametrize("algo,margin", [("max", 0), ("most_recent", 1)])
def test_te_state_loads_and_the_next_fp8_dpa_forward_uses_its_qkv_scale(fake_te, generator, algo, margin):
    length = 4
    state = _te_dpa_state(fake_te, generator, length, margin, algo)
    module = _dpa()
    module.load_state_dict({"_extra_state": te_payload(fake_te, state)}, strict=True)
    recipe = DelayedScaling(fp8_dpa=True, amax_history_len=length, margin=margin, amax_compute_algo=algo)
    assert module._fp8_recipe == recipe
    qkv_scale = state["scale_fwd"][QKV_SLOT]
    assert torch.equal(module._fp8_state.scale, qkv_scale.repeat(3))

    q, k, v = _qkv(generator, (1.0, 4.0, 0.25))
    with torch.no_grad(), te_fuser.fp8_autocast(fp8_recipe=recipe):
        out = module(q, k, v)
    expect = _reference(q, k, v, [qkv_scale] * 3)
    # From the avx512_bf16 tier up (vdpbf16ps, AMX), P is rounded to bf16 for the P.V product: out may move
    # by 2^-8 of max|v| there.
    atol = 2.0**-8 * v.abs().max().item() if cpu.current_isa() in ("avx512_bf16", "amx") else 1e-5
    torch.testing.assert_close(out.double(), expect, rtol=1e-4, atol=atol)
    # The check can fail: a fresh module (scale 1) gives a clearly different result.
    with torch.no_grad(), te_fuser.fp8_autocast(fp8_recipe=recipe):
        fresh = _dpa()(q, k, v)
    assert (fresh.double() - expect).abs().max() > 100 * (out.double() - expect).abs().max() + 1e-3

    # Each of q, k, v continues from the QKV slot's history with its own amax, as TE's update.
    for column, tensor in enumerate((q, k, v)):
        history, scale = state["amax_history_fwd"][:, QKV_SLOT:QKV_SLOT + 1].clone(), qkv_scale.reshape(1).clone()
        history[0] = torch.maximum(history[0], tensor.abs().max())
        te_update(history, scale, E4M3_MAX, margin, algo)
        assert torch.equal(module._fp8_state.scale[column:column + 1], scale), (column, module._fp8_state.scale)


def _train(module, recipe, generator, steps):
    outs = []
    for step in range(steps):
        q, k, v = (t.requires_grad_() for t in _qkv(generator, (1.0 + step, 8.0, 0.125 * (step + 1))))
        with te_fuser.fp8_autocast(fp8_recipe=recipe):
            out = module(q, k, v)
        out.square().sum().backward()
        outs.append(out.detach())
    return outs


def test_te_fuser_round_trip_continues_with_identical_scales(generator):
    recipe = DelayedScaling(fp8_dpa=True, amax_history_len=3)
    module = _dpa()
    _train(module, recipe, generator, 3)
    scales = module._fp8_state.scale.clone()
    assert len(set(scales.tolist())) == 3, scales  # q, k, v were scaled differently

    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    clone = _dpa()
    clone.load_state_dict(torch.load(buffer, weights_only=True), strict=True)
    assert torch.equal(clone._fp8_state.scale, scales)
    seed = generator.initial_seed() + 1
    for mine, theirs in zip(_train(module, recipe, torch.Generator().manual_seed(seed), 3),
                            _train(clone, recipe, torch.Generator().manual_seed(seed), 3)):
        assert torch.equal(mine, theirs)
    assert torch.equal(module._fp8_state.scale, clone._fp8_state.scale)
    assert torch.equal(module._fp8_state.amax_history, clone._fp8_state.amax_history)


def test_te_reads_the_qkv_slot_and_a_te_trained_state_comes_back_through_it(fake_te, generator):
    recipe = DelayedScaling(fp8_dpa=True, amax_history_len=3)
    module = _dpa()
    _train(module, recipe, generator, 2)
    fuser = module._fp8_state
    te_state = pickle.loads(module.get_extra_state().numpy().tobytes())  # TE's set_extra_state
    assert isinstance(te_state["recipe"], fake_te.DelayedScaling) and te_state["recipe"].fp8_dpa
    assert te_state["extra_fp8_variables"]["num_gemms"] == 3
    assert {k: tuple(te_state[k].shape) for k in ("scale_fwd", "amax_history_fwd", "scale_bwd",
                                                   "amax_history_bwd")} == {
        "scale_fwd": (9,), "amax_history_fwd": (3, 9), "scale_bwd": (6,), "amax_history_bwd": (3, 6)}
    # QKV: the scale that overflows none of q, k, v, and their joint amaxes.
    assert te_state["scale_fwd"][QKV_SLOT] == fuser.scale.min()
    assert torch.equal(te_state["amax_history_fwd"][:, QKV_SLOT], fuser.amax_history.amax(dim=1))
    # O, S and the unused slots as a fresh TE module holds them; no backward FP8 in te_fuser's attention.
    others = [s for s in range(9) if s != QKV_SLOT and s not in PER_TENSOR_SLOTS]
    assert torch.equal(te_state["scale_fwd"][others], torch.ones(len(others)))
    assert not te_state["amax_history_fwd"][:, others].any()
    assert torch.equal(te_state["scale_bwd"], torch.ones(6)) and not te_state["amax_history_bwd"].any()

    # TE trains on: one QKV amax per step (max over q, k, v), all slots rolled and updated.
    history, scale = te_state["amax_history_fwd"], te_state["scale_fwd"]
    for factor in (2.0, 0.5):
        history[0, QKV_SLOT] = torch.maximum(history[0, QKV_SLOT], torch.tensor(factor * 3.0))
        te_update(history, scale, E4M3_MAX, 0, "max")
    back = _dpa()
    back.set_extra_state(te_payload(fake_te, te_state))
    assert torch.equal(back._fp8_state.scale, scale[QKV_SLOT].repeat(3))
    assert torch.equal(back._fp8_state.amax_history, history[:, QKV_SLOT:QKV_SLOT + 1].repeat(1, 3))


def test_no_state_stateless_recipes_and_bad_payloads(fake_te, generator, tmp_path):
    module = _dpa()
    assert module.get_extra_state().dtype == torch.uint8 and module.get_extra_state().numel() == 0
    q, k, v = _qkv(generator)
    with te_fuser.fp8_autocast(fp8_recipe=DelayedScaling()):  # FP8 without fp8_dpa: attention stays high precision
        module(q, k, v)
    assert module.get_extra_state().numel() == 0
    with te_fuser.fp8_autocast(fp8_recipe=Float8CurrentScaling(fp8_dpa=True)):
        module(q, k, v)
    assert module._fp8_state is not None and module.get_extra_state().numel() == 0
    for empty in (None, torch.empty(0, dtype=torch.uint8)):
        fresh = _dpa()
        fresh.set_extra_state(empty)
        assert fresh._fp8_state is None

    marker = tmp_path / "pwned"

    class RunsCode:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    with pytest.raises(UnsafeExtraStateError, match=r"references (posix|os)\.system"):
        module.set_extra_state(te_payload(fake_te, {"recipe": fake_te.DelayedScaling(), "scale_fwd": RunsCode()}))
    assert not marker.exists()
    with pytest.raises(TypeError, match="got a dict"):
        module.set_extra_state({"scale_fwd": torch.ones(9)})
    linear_state = random_te_state(fake_te, generator, 2, num_gemms=1)  # a Linear's payload: 3 forward slots
    with pytest.raises(ValueError, match=r"scale_fwd' must have shape \(9,\)"):
        module.set_extra_state(te_payload(fake_te, linear_state))


def _transformer_layer():
    return te_fuser.TransformerLayer(HEADS * HEAD_DIM, 64, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                     fuse_qkv_params=True, device="cpu")


def test_transformer_layer_state_dict_has_te_keys_and_loads_strictly(fake_te, generator):
    layer = _transformer_layer()
    assert set(layer.state_dict()) == TE_TRANSFORMER_LAYER_KEYS
    mha = te_fuser.MultiheadAttention(HEADS * HEAD_DIM, HEADS, fuse_qkv_params=True, device="cpu")
    assert "core_attention._extra_state" in mha.state_dict()

    # A TE checkpoint: the same keys, a TE-format DotProductAttention payload.
    te_state = _te_dpa_state(fake_te, generator, 4)
    checkpoint = {k: v.clone() if k.endswith("_extra_state") else torch.randn(v.shape, generator=generator)
                  for k, v in layer.state_dict().items()}
    checkpoint["self_attention.core_attention._extra_state"] = te_payload(fake_te, te_state)
    target = _transformer_layer()
    target.load_state_dict(checkpoint, strict=True)
    core = target.self_attention.core_attention
    assert torch.equal(core._fp8_state.scale, te_state["scale_fwd"][QKV_SLOT].repeat(3))
    assert torch.equal(target.self_attention.proj.weight, checkpoint["self_attention.proj.weight"])

    # TE 1.6 / 1.7 kept it under core_attention.fused_attention; it loads from there when the newer key is absent.
    legacy = dict(checkpoint)
    legacy["self_attention.core_attention.fused_attention._extra_state"] = legacy.pop(
        "self_attention.core_attention._extra_state")
    older = _transformer_layer()
    older.load_state_dict(legacy, strict=True)
    assert torch.equal(older.self_attention.core_attention._fp8_state.scale, core._fp8_state.scale)
    # ... and is ignored next to it (TE does the same).
    both = dict(checkpoint, **{"self_attention.core_attention.fused_attention._extra_state": torch.tensor(
        [1, 2, 3], dtype=torch.uint8)})
    _transformer_layer().load_state_dict(both, strict=True)
    # TE <= 1.5 and older te_fuser checkpoints have no attention FP8 state: still a strict load.
    _transformer_layer().load_state_dict(
        {k: v for k, v in checkpoint.items() if k != "self_attention.core_attention._extra_state"}, strict=True)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        _transformer_layer().load_state_dict(dict(checkpoint, **{"self_attention.core_attention.other": 1}))
