"""Query/key normalization in te_fuser.MultiheadAttention and TransformerLayer: TE 2.6's use_qk_norm (one
shared L2 norm, `qk_norm`, after RoPE) and later TE's qk_norm_type (L2Normalization, RMSNorm, LayerNorm as
`q_norm` / `k_norm`, before or after RoPE), against float64 torch, forward and every gradient."""

import pytest
import torch

import te_fuser
from te_fuser.ops import L2Normalization

import layer_reference as ref

HIDDEN, HEADS, SEQ, BATCH = 64, 4, 16, 2


def _mha(**kwargs):
    module = te_fuser.MultiheadAttention(HIDDEN, HEADS, attention_dropout=0.0, device="cpu", fuse_qkv_params=True,
                                         num_gqa_groups=2, **kwargs)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:  # away from the identity, so that a skipped norm shows
                p.normal_(1.0 if "weight" in name else 0.0, 0.3)
    return module


def _rotary(seq, dim):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


@pytest.mark.parametrize("kind, before_rope", [("L2Normalization", False), ("RMSNorm", False), ("LayerNorm", False),
                                               ("RMSNorm", True), ("L2Normalization", True)])
def test_qk_norm_type_matches_float64(kind, before_rope, generator):
    module = _mha(qk_norm_type=kind, qk_norm_eps=1e-5, qk_norm_before_rope=before_rope)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator, requires_grad=True)
    freqs = _rotary(SEQ, HIDDEN // HEADS)
    out = module(x, rotary_pos_emb=freqs)

    def reference(x64, P):
        attn, bias, _ = ref.mha(module, x64, rotary=freqs, P=P, qk_norm_kind=kind, qk_norm_eps=1e-5,
                                qk_norm_before_rope=before_rope)
        return attn + bias

    ref.check_against_reference(module, x, out, reference, 1e-5)
    if kind == "L2Normalization":
        return  # RoPE rotates each head's pairs, which keeps its L2 norm: the order does not matter
    other_order = _mha(qk_norm_type=kind, qk_norm_eps=1e-5, qk_norm_before_rope=not before_rope)
    other_order.load_state_dict(module.state_dict())
    assert not torch.allclose(other_order(x.detach(), rotary_pos_emb=freqs), out.detach(), atol=1e-4)


def test_use_qk_norm_is_te_2_6s_shared_l2_norm_after_rope(generator):
    module = _mha(use_qk_norm=True, qk_norm_eps=1e-6)
    assert isinstance(module.qk_norm, L2Normalization) and module.q_norm is module.k_norm is module.qk_norm
    assert not hasattr(_mha(), "qk_norm") and _mha().q_norm is None
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator, requires_grad=True)
    freqs = _rotary(SEQ, HIDDEN // HEADS)
    out = module(x, rotary_pos_emb=freqs)

    def reference(x64, P):
        attn, bias, _ = ref.mha(module, x64, rotary=freqs, P=P, qk_norm_kind="L2Normalization", qk_norm_eps=1e-6)
        return attn + bias

    ref.check_against_reference(module, x, out, reference, 1e-5)


def test_qk_norm_in_cross_attention_and_transformer_layer(generator):
    cross = _mha(attention_type="cross", qk_norm_type="LayerNorm")
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator, requires_grad=True)
    memory = torch.randn(SEQ + 3, BATCH, HIDDEN, generator=generator)
    out = cross(x, encoder_output=memory)

    def reference(x64, P):
        attn, bias, _ = ref.mha(cross, x64, causal=False, encoder_output=memory, P=P, qk_norm_kind="LayerNorm")
        return attn + bias

    cross.attn_mask_type = cross.core_attention.attn_mask_type = "no_mask"
    out = cross(x, encoder_output=memory)
    ref.check_against_reference(cross, x, out, reference, 1e-5)

    torch.manual_seed(0)
    with_norm = te_fuser.TransformerLayer(HIDDEN, 4 * HIDDEN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                          use_qk_norm=True, device="cpu")
    torch.manual_seed(0)
    without = te_fuser.TransformerLayer(HIDDEN, 4 * HIDDEN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                        device="cpu")
    assert isinstance(with_norm.self_attention.qk_norm, L2Normalization)
    missing, unexpected = without.load_state_dict(with_norm.state_dict(), strict=False)
    assert not missing and all("_norm._extra_state" in key for key in unexpected)  # the same weights
    y = x.detach()
    assert not torch.allclose(with_norm(y), without(y), atol=1e-4)


def test_bad_qk_norm_arguments_name_themselves():
    with pytest.raises(ValueError, match="qk_norm_type must be None or one of"):
        _mha(qk_norm_type="BatchNorm")
    with pytest.raises(ValueError, match="use_qk_norm=True .* qk_norm_type"):
        _mha(use_qk_norm=True, qk_norm_type="RMSNorm")
    with pytest.raises(ValueError, match="eps"):
        _mha(use_qk_norm=True, qk_norm_eps=-1.0)
