"""te_fuser.TransformerLayer against a float64 torch layer built from F.layer_norm, F.linear and SDPA,
reading TransformerEngine's parameter names; FP8; dropout; the saved-tensor discipline with its
bug-on controls; state_dict; bad arguments."""

import pytest
import torch

import te_fuser
from te_fuser import recipe

import layer_reference as ref
from activation_reference import GATED64
from _module_memory import leaky_attention, reachable_after_backward, retained_step_bytes, without_clearing

HIDDEN, FFN, HEADS, SEQ, BATCH = 64, 128, 4, 16, 2


def _layer(**kwargs):
    kwargs.setdefault("hidden_dropout", 0.0)
    kwargs.setdefault("attention_dropout", 0.0)
    layer = te_fuser.TransformerLayer(HIDDEN, FFN, HEADS, device="cpu", **kwargs)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "bias" in name or "layer_norm" in name or name.startswith("layernorm."):
                p.normal_(0.0 if "bias" in name else 1.0, 0.2)
    return layer


CONFIGS = {
    "seed_001": dict(fuse_qkv_params=True),
    "split_qkv_relu": dict(activation="relu"),
    "srelu": dict(activation="srelu", fuse_qkv_params=True),
    "qgeglu_bshd": dict(activation="qgeglu", attn_input_format="bshd", fuse_qkv_params=True),
    "rmsnorm_swiglu_gqa_bshd": dict(normalization="RMSNorm", activation="swiglu", num_gqa_groups=2,
                                    attn_input_format="bshd", fuse_qkv_params=True),
    "post_layernorm_residual": dict(apply_residual_connection_post_layernorm=True, fuse_qkv_params=True),
    "output_layernorm": dict(output_layernorm=True, fuse_qkv_params=True),
    "parallel_attention_mlp": dict(parallel_attention_mlp=True, fuse_qkv_params=True),
    "decoder": dict(layer_type="decoder", fuse_qkv_params=True),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_float64_forward_and_backward(config, generator):
    kwargs = CONFIGS[config]
    layer = _layer(**kwargs)
    bshd = kwargs.get("attn_input_format") == "bshd"
    x = torch.randn((BATCH, SEQ, HIDDEN) if bshd else (SEQ, BATCH, HIDDEN), generator=generator, requires_grad=True)
    enc = torch.randn(24, BATCH, HIDDEN, generator=generator) if config == "decoder" else None
    out = layer(x, encoder_output=enc)
    assert out.shape == x.shape
    gated = kwargs.get("activation", "gelu") in GATED64  # fc1 holds both halves, as in TE
    assert layer.layernorm_mlp.fc1_weight.shape == ((2 if gated else 1) * FFN, HIDDEN)

    def reference(x64, P):
        return ref.transformer_layer(layer, x64, kwargs.get("activation", "gelu"),
                                     kwargs.get("normalization", "LayerNorm"), encoder_output=enc, P=P)

    ref.check_against_reference(layer, x, out, reference, 1e-4)


def test_te_submodules_and_parameter_names():
    layer = _layer(fuse_qkv_params=True, layer_number=2, seq_length=SEQ)
    assert isinstance(layer.self_attention, te_fuser.MultiheadAttention)
    assert isinstance(layer.self_attention.layernorm_qkv, te_fuser.LayerNormLinear)
    assert isinstance(layer.layernorm_mlp, te_fuser.LayerNormMLP)
    assert {k for k in layer.state_dict() if not k.endswith("_extra_state")} == {
        "self_attention.layernorm_qkv.layer_norm_weight", "self_attention.layernorm_qkv.layer_norm_bias",
        "self_attention.layernorm_qkv.weight", "self_attention.layernorm_qkv.bias",
        "self_attention.proj.weight", "self_attention.proj.bias",
        "layernorm_mlp.layer_norm_weight", "layernorm_mlp.layer_norm_bias", "layernorm_mlp.fc1_weight",
        "layernorm_mlp.fc1_bias", "layernorm_mlp.fc2_weight", "layernorm_mlp.fc2_bias"}
    assert layer.self_attention.layer_number == 2
    decoder = _layer(layer_type="decoder", output_layernorm=True)
    assert isinstance(decoder.inter_attention.layernorm_query, te_fuser.LayerNormLinear)
    assert isinstance(decoder.layernorm, te_fuser.LayerNorm) and not hasattr(decoder.self_attention, "layernorm_qkv")


@pytest.mark.parametrize("fp8_recipe", [recipe.DelayedScaling(fp8_dpa=True, amax_history_len=4),
                                        recipe.Float8CurrentScaling(fp8_dpa=True)], ids=["delayed", "current"])
def test_fp8_and_fp8_dpa_within_tolerance(fp8_recipe, generator):
    layer = _layer(fuse_qkv_params=True)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator, requires_grad=True)
    with torch.no_grad():
        expect = ref.transformer_layer(layer, x)
    for _ in range(2):
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            out = layer(x)
        out.sum().backward()
    rel = ((out.double() - expect).norm() / expect.norm()).item()
    assert 1e-5 < rel < 0.05, rel  # FP8 ran, within FP8 precision (the residual keeps x exact)
    assert layer.self_attention.core_attention._fp8_state is not None
    assert torch.isfinite(x.grad).all()


def test_hidden_dropout_follows_torch_manual_seed(generator):
    layer = _layer(hidden_dropout=0.5, fuse_qkv_params=True)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    torch.manual_seed(7)
    a = layer(x)
    torch.manual_seed(7)
    b = layer(x)
    c = layer(x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(a, c)
    layer.eval()
    with torch.no_grad():
        torch.testing.assert_close(layer(x).double(), ref.transformer_layer(layer, x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fp8_recipe", [None, recipe.DelayedScaling(fp8_dpa=True, amax_history_len=4)],
                         ids=["no_fp8", "delayed_fp8_dpa"])
def test_nothing_left_on_ctx_after_backward_and_both_bugs_are_caught(fp8_recipe, monkeypatch, generator):
    layer = _layer(fuse_qkv_params=True)
    x = torch.randn(32, BATCH, HIDDEN, generator=generator, requires_grad=True)

    def forward():
        with te_fuser.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            return layer(x)

    before, after, _ = reachable_after_backward(layer, forward)
    assert before and after == []
    held, expected = retained_step_bytes(layer, forward, [x])
    assert held <= expected + 1024, (held, expected)

    # Each bug brings back at least one of q, k, v (FP8: 1 byte, else 4 bytes per element).
    one_of_qkv = 32 * BATCH * HIDDEN * (1 if fp8_recipe is not None else 4)
    for bug in (without_clearing, leaky_attention):
        with monkeypatch.context() as patch:
            bug(patch)
            _, after_leaky, _ = reachable_after_backward(layer, forward)
            assert after_leaky, f"the graph walk missed the tensors left on ctx by {bug.__name__}"
            held_leaky, expected = retained_step_bytes(layer, forward, [x])
            assert held_leaky >= expected + one_of_qkv, (bug.__name__, held_leaky, expected)


def test_state_dict_round_trip_with_fp8_state(generator):
    layer = _layer(fuse_qkv_params=True)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    for _ in range(2):
        with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
            layer(x)
    state = layer.state_dict()
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        expect = layer(x)
    fresh = te_fuser.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                      fuse_qkv_params=True, device="cpu")
    fresh.load_state_dict(state)
    with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
        got = fresh(x)
    # The same weights and the same scaling state (scales and amax histories): the same FP8 result.
    torch.testing.assert_close(got, expect, rtol=0, atol=0)


def test_meta_device_then_reset_parameters_of_each_submodule():
    layer = te_fuser.TransformerLayer(HIDDEN, FFN, HEADS, fuse_qkv_params=True, device="meta")
    assert all(p.device.type == "meta" for p in layer.parameters())
    for module in layer.modules():  # what FSDP does to materialize a meta-device model
        if any(p.device.type == "meta" for p in module.parameters(recurse=False)):
            module.to_empty(device="cpu", recurse=False)
            module.reset_parameters()
    assert all(p.device.type == "cpu" for p in layer.parameters())
    assert torch.equal(layer.layernorm_mlp.layer_norm_weight, torch.ones(HIDDEN))
    assert 0.015 < layer.self_attention.layernorm_qkv.weight.std().item() < 0.031
    assert torch.isfinite(layer(torch.randn(SEQ, BATCH, HIDDEN))).all()


def test_bad_arguments():
    with pytest.raises(ValueError, match="layer_type"):
        _layer(layer_type="encoder-decoder")
    with pytest.raises(NotImplementedError, match="ub_tp_comm_overlap"):
        _layer(ub_tp_comm_overlap=True)
    with pytest.raises(ValueError, match="fuse_wgrad_accumulation"):
        _layer(fuse_wgrad_accumulation=True)
    with pytest.raises(ValueError, match="parallel_attention_mlp"):
        _layer(parallel_attention_mlp=True, layer_type="decoder")
    with pytest.raises(ValueError, match="normalization"):
        _layer(normalization="BatchNorm")
    with pytest.raises(ValueError, match="hidden_dropout"):
        _layer(hidden_dropout=1.5)
    with pytest.raises(NotImplementedError, match="attn_mask_type='causal_bottom_right'"):
        _layer(self_attn_mask_type="causal_bottom_right")
    with pytest.raises(ValueError, match="encoder_output"):
        _layer(layer_type="decoder")(torch.randn(SEQ, BATCH, HIDDEN))
    with pytest.raises(ValueError, match="sequence parallelism: hidden_states has 16 rows"):
        _layer(tp_size=2, set_parallel_mode=True, sequence_parallel=True, seq_length=SEQ)(
            torch.randn(SEQ, BATCH, HIDDEN))


def test_drop_path_drops_whole_dim0_entries():
    layer = _layer(drop_path_rate=0.5, fuse_qkv_params=True)
    drop = layer.drop_path
    torch.manual_seed(3)
    out = drop(torch.ones(64, BATCH, HIDDEN))
    per_entry = out.flatten(1)
    assert ((per_entry == 0).all(1) | (per_entry == 2).all(1)).all()  # kept entries are scaled by 1 / keep
    assert 0 < (per_entry[:, 0] == 0).sum() < 64
    drop.eval()
    assert torch.equal(drop(torch.ones(3, 2)), torch.ones(3, 2))


def test_thd_rotary_positions_restart_per_sequence(generator):
    """TransformerLayer passes rotary_pos_emb and cu_seqlens down to RoPE: packed thd sequences give what
    each gives alone in bshd, forward and input gradient."""
    bshd = _layer(fuse_qkv_params=True, attn_input_format="bshd")
    thd = _layer(fuse_qkv_params=True, attn_input_format="thd", self_attn_mask_type="padding_causal")
    thd.load_state_dict(bshd.state_dict())
    freqs = te_fuser.RotaryPositionEmbedding(HIDDEN // HEADS)(9)
    lengths = [9, 4]
    seqs = [torch.randn(1, n, HIDDEN, generator=generator, requires_grad=True) for n in lengths]
    packed_in = torch.cat([s[0] for s in seqs]).detach().requires_grad_()
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    packed = thd(packed_in, rotary_pos_emb=freqs, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    expect = torch.cat([bshd(s, rotary_pos_emb=freqs)[0] for s in seqs])
    torch.testing.assert_close(packed, expect, rtol=1e-5, atol=1e-5)
    grad = torch.randn(packed.shape, generator=generator)
    packed.backward(grad)
    expect.backward(grad)
    torch.testing.assert_close(packed_in.grad, torch.cat([s.grad[0] for s in seqs]), rtol=1e-5, atol=1e-5)
