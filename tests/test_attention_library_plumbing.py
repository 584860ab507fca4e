"""The call plumbing of the GPU library backends (cuDNN, FlashAttention), on meta tensors: torch's private
aten ops have meta kernels, so DotProductAttention's whole autograd Function runs forward and backward on
them without a GPU, under both torch builds CI runs. Checked: which op is called with which arguments in
which order, the shapes and layouts passed (q/k/v as [b, h, s, d] views, lse [b, h, s, 1] for cuDNN and
[b, h, s] for flash, [h, tokens] packed), that the RNG state the forward returned is what the backward
gets, and which tensors the Function saves."""

import pytest
import torch

import te_fuser
from te_fuser.attention.backends import clear_cache, cudnn, flash
from te_fuser.attention.dot_product_attention import dot_product_attention as dpa_module

META = torch.device("meta")
B, S, H, HKV, D = 2, 96, 4, 2, 64


class Recorder:
    """Stands in for torch.ops.aten in a backend module: runs each op and records (name, args, kwargs, result)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        op = getattr(torch.ops.aten, name)

        def call(*args, **kwargs):
            result = op(*args, **kwargs)
            self.calls.append((name, args, kwargs, result))
            return result
        return call

    def one(self, name):
        found = [c for c in self.calls if c[0] == name]
        assert len(found) == 1, [c[0] for c in self.calls]
        return found[0][1:]


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.delenv("TE_FUSER_ATTENTION_BACKEND", raising=False)
    clear_cache()
    yield
    clear_cache()


def _meta_qkv(fmt, seq_q=S, seq_kv=S):
    def one(seq, heads):
        shape = {"bshd": (B, seq, heads, D), "sbhd": (seq, B, heads, D), "thd": (seq, heads, D)}[fmt]
        return torch.empty(shape, device=META, dtype=torch.bfloat16, requires_grad=True)
    return one(seq_q, H), one(seq_kv, HKV), one(seq_kv, HKV)


def _heads_first(t, fmt):
    """The [b, h, s, d] view of a user-layout tensor the backend must pass (same storage, no copy)."""
    return t.transpose(1, 2) if fmt == "bshd" else t.permute(1, 2, 0, 3)


def _assert_view_of(passed, t, fmt):
    expected = _heads_first(t, fmt)
    assert passed.shape == expected.shape and passed.stride() == expected.stride(), (passed.shape, passed.stride())


def _run(module, q, k, v, **kwargs):
    out = module(q, k, v, **kwargs)
    node = out.grad_fn.next_functions[0][0]
    saved = node.saved_tensors
    out.backward(torch.ones_like(out))
    return out, node, saved


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_forward_and_backward(fmt, causal, monkeypatch):
    aten = Recorder()
    monkeypatch.setattr(cudnn, "_aten", aten)
    q, k, v = _meta_qkv(fmt)
    module = te_fuser.DotProductAttention(H, D, num_gqa_groups=HKV, qkv_format=fmt, softmax_scale=0.11,
                                          attn_mask_type="causal" if causal else "no_mask", attention_backend="cudnn")
    out, node, saved = _run(module, q, k, v)
    args, kwargs, result = aten.one("_scaled_dot_product_cudnn_attention")
    for passed, t in zip(args[:3], (q, k, v)):
        _assert_view_of(passed, t, fmt)
    assert args[3:] == (None, True, 0.0, causal, False) and kwargs == {"scale": 0.11}
    out_bhsd, lse, philox_seed, philox_offset = result[0], result[1], result[6], result[7]
    assert lse.shape == (B, H, S, 1) and lse.dtype == torch.float32
    # Saved: q, k, v, out (kernel layout), lse as [b, h, s], 4 empty length slots, cuDNN's two RNG tensors.
    assert len(saved) == 11 and all(t is None for t in saved[5:9])
    assert [tuple(t.shape) for t in saved[:4]] == [(B, S, H, D), (B, S, HKV, D), (B, S, HKV, D), (B, S, H, D)]
    assert saved[4].shape == (B, H, S) and saved[9] is philox_seed and saved[10] is philox_offset
    assert node.backend == "cudnn" and out.shape == (*q.shape[:2], H * D)

    args, kwargs, grads = aten.one("_scaled_dot_product_cudnn_attention_backward")
    assert tuple(args[0].shape) == (B, H, S, D)  # dout, heads first
    for passed, t in zip(args[1:4], (q, k, v)):
        _assert_view_of(passed, t, fmt)
    assert args[4].shape == out_bhsd.shape and args[5].shape == (B, H, S, 1) and args[5].stride() == lse.stride()
    assert args[6] is philox_seed and args[7] is philox_offset
    assert args[8:] == (None, None, None, S, S, 0.0, causal) and kwargs == {"scale": 0.11}
    assert [tuple(g.shape) for g in grads] == [(B, H, S, D), (B, HKV, S, D), (B, HKV, S, D)]
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_flash_dense_forward_and_backward(fmt, dropout, monkeypatch):
    """With dropout, flash draws from torch's generator and its RNG state reaches the backward; te_fuser's
    own (seed, offset) is not drawn (the default generator does not move on meta, nothing may call it)."""
    aten = Recorder()
    monkeypatch.setattr(flash, "_aten", aten)
    monkeypatch.setattr(dpa_module, "_dropout_seed", None)  # would raise if called
    q, k, v = _meta_qkv(fmt)
    module = te_fuser.DotProductAttention(H, D, num_gqa_groups=HKV, qkv_format=fmt, attention_dropout=dropout,
                                          softmax_scale=0.11, attn_mask_type="causal", attention_backend="flash")
    out, node, saved = _run(module, q, k, v)
    args, kwargs, result = aten.one("_scaled_dot_product_flash_attention")
    for passed, t in zip(args[:3], (q, k, v)):
        _assert_view_of(passed, t, fmt)
    assert args[3:] == (dropout, True, False) and kwargs == {"scale": 0.11}
    lse, rng_state, unused = result[1], result[6], result[7]
    assert lse.shape == (B, H, S) and rng_state.dtype == torch.uint64
    assert len(saved) == 11 and saved[4] is lse and saved[9] is rng_state and saved[10] is unused

    args, kwargs, grads = aten.one("_scaled_dot_product_flash_attention_backward")
    for passed, t in zip(args[1:4], (q, k, v)):
        _assert_view_of(passed, t, fmt)
    assert args[5] is lse and args[6:12] == (None, None, S, S, dropout, True)
    assert args[12] is rng_state and args[13] is unused and kwargs == {"scale": 0.11}
    assert [tuple(g.shape) for g in grads] == [(B, H, S, D), (B, HKV, S, D), (B, HKV, S, D)]
    assert node.call.dropout_p == dropout and node.call.seed == 0


@pytest.mark.parametrize("max_seqlen", [None, 40])
def test_flash_packed_thd_forward_and_backward(max_seqlen, monkeypatch):
    """thd runs _flash_attention_forward with cu_seqlens and TE's max_seqlen (the token count bounds it
    when it is not given on meta tensors); lse [h, tokens]; the cu_seqlens are saved, the max lengths
    kept as ints."""
    aten = Recorder()
    monkeypatch.setattr(flash, "_aten", aten)
    tokens = 100
    q, k, v = _meta_qkv("thd", tokens, tokens)
    cu = torch.empty(4, device=META, dtype=torch.int32)
    module = te_fuser.DotProductAttention(H, D, num_gqa_groups=HKV, qkv_format="thd",
                                          attn_mask_type="padding_causal", softmax_scale=0.11)
    assert te_fuser.kernels.attention.backend_for(q[None], k[None], cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                  causal=True, backend="flash").backend == "flash"
    module.attention_backend = "flash"
    out, node, saved = _run(module, q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_seqlen,
                            max_seqlen_kv=max_seqlen)
    expected_max = tokens if max_seqlen is None else max_seqlen
    args, kwargs, result = aten.one("_flash_attention_forward")
    assert [tuple(t.shape) for t in args[:3]] == [(tokens, H, D), (tokens, HKV, D), (tokens, HKV, D)]
    assert args[3] is cu and args[4] is not None and args[5:] == (expected_max, expected_max, 0.0, True, False)
    assert kwargs == {"scale": 0.11}
    lse, rng_state, unused = result[1:4]
    assert lse.shape == (H, tokens)
    assert saved[4] is lse and saved[5] is cu and saved[9] is rng_state and saved[10] is unused
    args, kwargs, grads = aten.one("_flash_attention_backward")
    assert args[5] is lse and args[6] is cu and args[8:12] == (expected_max, expected_max, 0.0, True)
    assert args[12] is rng_state and args[13] is unused and kwargs == {"scale": 0.11}
    assert node.call.max_seqlen_q == expected_max and out.shape == (tokens, H * D)
    assert q.grad.shape == q.shape


def test_library_kernels_are_not_given_what_they_cannot_express():
    """The same module on meta tensors, named to a library backend, refuses a padding mask (flash) and
    thd (cuDNN) with the backend's reason."""
    q, k, v = _meta_qkv("bshd")
    padded = te_fuser.DotProductAttention(H, D, num_gqa_groups=HKV, qkv_format="bshd", attn_mask_type="padding",
                                          attention_backend="flash")
    lens = torch.empty(B + 1, device=META, dtype=torch.int32)
    with pytest.raises(ValueError, match="'flash'.*padded batches"):
        padded(q, k, v, cu_seqlens_q=lens, cu_seqlens_kv=lens)
    tq, tk, tv = _meta_qkv("thd")
    packed = te_fuser.DotProductAttention(H, D, num_gqa_groups=HKV, qkv_format="thd", attn_mask_type="padding",
                                          attention_backend="cudnn")
    with pytest.raises(ValueError, match="'cudnn'.*dense batches only, not packed"):
        packed(tq, tk, tv, cu_seqlens_q=lens, cu_seqlens_kv=lens)
