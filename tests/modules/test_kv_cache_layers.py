"""MultiheadAttention and TransformerLayer decoding with inference_params (TE's KV cache) match the whole
sequences run at once under a causal mask, in float64 (tests/modules/layer_reference.py), over a serving
schedule where sequences finish and others join (tests/kv_cache_schedule.py). With RoPE, each new token
is rotated at its position in its sequence: its cached length plus its index in the step."""

import pytest
import torch

import te_fuser

import layer_reference as ref
from kv_cache_schedule import REQUESTS, plan, run_incremental

HIDDEN, HEADS, GROUPS, MAX_BATCH, MAX_SEQ = 64, 4, 2, 3, 16
HEAD_DIM = HIDDEN // HEADS


def _rotary(seq, dim, base=10000.0):
    """TransformerEngine's RotaryPositionEmbedding output: [s, 1, 1, dim] angles, the halves duplicated."""
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


def _params(qkv_format, is_paged):
    paged = dict(page_size=4, total_num_pages=MAX_BATCH * MAX_SEQ // 4) if is_paged else {}
    return te_fuser.InferenceParams(MAX_BATCH, MAX_SEQ, GROUPS, HEAD_DIM, torch.float32, is_paged=is_paged,
                                    max_ctx_len=8, qkv_format=qkv_format, device="cpu", **paged)


def _per_sequence(fn, x, qkv_format):
    """fn on one whole sequence x [length, hidden] given in qkv_format's batched form (thd: as bshd)."""
    if qkv_format == "sbhd":
        return fn(x[:, None])[:, 0]
    return fn(x[None])[0]


def _layers(kind, qkv_format):
    if kind == "TransformerLayer":
        return [te_fuser.TransformerLayer(HIDDEN, 2 * HIDDEN, HEADS, num_gqa_groups=GROUPS, hidden_dropout=0.0,
                                          attention_dropout=0.0, layer_number=n, self_attn_mask_type="padding_causal",
                                          attn_input_format=qkv_format).eval() for n in (1, 2)]
    return [te_fuser.MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.0, layer_number=n,
                                        attn_mask_type="padding_causal", input_layernorm=True,
                                        qkv_format=qkv_format).eval() for n in (1, 2)]


@pytest.mark.parametrize("is_paged", [False, True], ids=["nonpaged", "paged"])
@pytest.mark.parametrize("qkv_format", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("kind", ["MultiheadAttention", "MultiheadAttention+RoPE", "TransformerLayer"])
def test_decoding_matches_whole_sequences(kind, qkv_format, is_paged):
    rope = kind.endswith("RoPE")
    kind = kind.split("+")[0]
    layers = _layers(kind, qkv_format)
    freqs = _rotary(MAX_SEQ, HEAD_DIM) if rope else None
    x = [torch.randn(ctx + gen, HIDDEN) for ctx, gen, _ in REQUESTS]
    params = _params(qkv_format, is_paged)

    def run(h, inference_params):
        for layer in layers:
            h = layer(h, inference_params=inference_params, rotary_pos_emb=freqs)
        return h

    with torch.no_grad():
        got = run_incremental(run, (x,), plan(REQUESTS, MAX_BATCH), qkv_format, params)
    assert sorted(params.cache_manager.cache) == [1, 2]  # allocated on first use, one per layer_number
    for seq, xs in enumerate(x):
        expected = _reference_output(kind, layers, xs, qkv_format, freqs)
        torch.testing.assert_close(got[seq].double(), expected, atol=1e-4, rtol=1e-4, msg=f"sequence {seq}")


def _reference_output(kind, layers, x, qkv_format, freqs):
    fmt = "sbhd" if qkv_format == "sbhd" else "bshd"
    h = x.double()
    for layer in layers:
        if kind == "TransformerLayer":
            h = _per_sequence(lambda t: ref.transformer_layer(layer, t), h, qkv_format)
        else:
            h = _per_sequence(lambda t: sum(ref.mha(layer, t, fmt, rotary=freqs)[:2]), h, qkv_format)
    return h


def test_rope_positions_must_cover_the_sequences():
    layer = _layers("MultiheadAttention", "bshd")[0]
    params = _params("bshd", False)
    params.pre_step({0: 5})
    with pytest.raises(ValueError, match="rotary_pos_emb"):
        layer(torch.randn(1, 5, HIDDEN), inference_params=params, rotary_pos_emb=_rotary(4, HEAD_DIM))
