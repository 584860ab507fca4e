"""InferenceParams and the KV cache of DotProductAttention (TE's names and semantics).

Decoding a serving schedule step by step (prefill, then one token at a time, sequences finishing and new
ones joining: tests/kv_cache_schedule.py) gives, for every token, the float64 attention of the whole
sequence under a causal mask; the cache holds exactly the tokens written so far, in batch order (non-paged)
or in the pages of the page table (paged); the cache tensors are allocated once and written in place.
tests/modules/test_kv_cache_layers.py runs MultiheadAttention and TransformerLayer the same way.
"""

import math
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F

import te_fuser
from te_fuser.attention.inference import InferenceParams, NonPagedKVCacheManager, PagedKVCacheManager
from te_fuser.memory import MemoryTracker

from kv_cache_schedule import REQUESTS, plan, run_incremental, step_dict, step_input

HEADS, HEAD_DIM, MAX_BATCH, MAX_SEQ, PAGE = 4, 16, 3, 16, 4


def make_params(num_gqa_groups, qkv_format="bshd", is_paged=False, dtype=torch.float32, **overrides):
    kwargs = dict(max_batch_size=MAX_BATCH, max_sequence_length=MAX_SEQ, num_heads_kv=num_gqa_groups,
                  head_dim_k=HEAD_DIM, dtype=dtype, is_paged=is_paged, max_ctx_len=8, qkv_format=qkv_format,
                  device="cpu")
    if is_paged:
        kwargs.update(page_size=PAGE, total_num_pages=MAX_BATCH * MAX_SEQ // PAGE)
    kwargs.update(overrides)
    return InferenceParams(**kwargs)


def sequences(num_gqa_groups, dtype=torch.float32):
    """q, k, v: one [length, heads, dim] tensor per request, edge values included."""
    q, k, v = ([torch.randn(ctx + gen, heads, HEAD_DIM, dtype=dtype) for ctx, gen, _ in REQUESTS]
               for heads in (HEADS, num_gqa_groups, num_gqa_groups))
    q[0][0, 0, :] = 4.0  # a large score: softmax sharply peaked on some rows
    v[1][2, :, :] = -3.0
    return q, k, v


def reference(q, k, v, last_visible):
    """Float64 attention of q [n, h, d] over k, v [L, g, d], row i seeing keys 0 .. last_visible[i]."""
    groups = q.shape[1] // k.shape[1]
    qf, kf, vf = (t.double().transpose(0, 1) for t in (q, k.repeat_interleave(groups, 1),
                                                       v.repeat_interleave(groups, 1)))
    mask = torch.arange(k.shape[0])[None, :] <= torch.as_tensor(last_visible)[:, None]
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=1.0 / math.sqrt(q.shape[-1]))
    return out.transpose(0, 1).flatten(1)


def causal_reference(q, k, v):
    return [reference(qs, ks, vs, torch.arange(qs.shape[0])) for qs, ks, vs in zip(q, k, v)]


def dpa(num_gqa_groups, qkv_format, attn_mask_type="padding_causal", layer_number=1, backend=None):
    return te_fuser.DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=num_gqa_groups, qkv_format=qkv_format,
                                        attn_mask_type=attn_mask_type, layer_number=layer_number,
                                        attention_backend=backend)


@pytest.mark.parametrize("backend", ["te_fuser", "unfused"])
@pytest.mark.parametrize("num_gqa_groups", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("is_paged", [False, True], ids=["nonpaged", "paged"])
@pytest.mark.parametrize("qkv_format", ["bshd", "sbhd", "thd"])
def test_decoding_matches_full_causal_attention(qkv_format, is_paged, num_gqa_groups, backend):
    q, k, v = sequences(num_gqa_groups)
    params = make_params(num_gqa_groups, qkv_format, is_paged)
    params.allocate_memory(1)
    with torch.no_grad():
        got = run_incremental(dpa(num_gqa_groups, qkv_format, backend=backend), (q, k, v),
                              plan(REQUESTS, MAX_BATCH), qkv_format, params)
    for seq, expected in enumerate(causal_reference(q, k, v)):
        torch.testing.assert_close(got[seq].double(), expected, atol=2e-5, rtol=1e-5, msg=f"sequence {seq}")


@pytest.mark.parametrize("qkv_format", ["bshd", "thd"])
def test_padding_mask_sees_the_whole_step(qkv_format):
    """attn_mask_type='padding': a step's new tokens see every cached and every new token of their sequence."""
    q, k, v = sequences(2)
    steps = plan(REQUESTS, MAX_BATCH)
    last_visible = {seq: [] for seq in range(len(REQUESTS))}
    for step in steps:
        for seq, (cached, new) in step.items():
            last_visible[seq] += [cached + new - 1] * new
    params = make_params(2, qkv_format, is_paged=True)
    with torch.no_grad():
        got = run_incremental(dpa(2, qkv_format, "padding"), (q, k, v), steps, qkv_format, params)
    for seq in range(len(REQUESTS)):
        torch.testing.assert_close(got[seq].double(), reference(q[seq], k[seq], v[seq], last_visible[seq]),
                                   atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decoding_in_16_bit(dtype):
    q, k, v = sequences(2, dtype)
    params = make_params(2, "sbhd", is_paged=True, dtype=dtype)
    with torch.no_grad():
        got = run_incremental(dpa(2, "sbhd"), (q, k, v), plan(REQUESTS, MAX_BATCH), "sbhd", params)
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    for seq, expected in enumerate(causal_reference(q, k, v)):
        assert got[seq].dtype == dtype
        torch.testing.assert_close(got[seq].double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("qkv_format", ["bshd", "sbhd"])
def test_batch_padded_to_max_batch_size(qkv_format):
    """As TE's CUDA-graph runs feed it: rows past the step's sequences are ignored and give 0."""
    q, k, v = sequences(2)
    steps = plan(REQUESTS, MAX_BATCH)[:4]
    batch_dim = 0 if qkv_format == "bshd" else 1

    def padded(*inputs, inference_params):
        pad = [t.narrow(batch_dim, 0, 1).mul(0).add(7.0) for t in inputs]  # junk rows
        wide = [torch.cat([t] + [p] * (MAX_BATCH + 1 - t.shape[batch_dim]), dim=batch_dim)
                for t, p in zip(inputs, pad)]
        out = dpa(2, qkv_format)(*wide, inference_params=inference_params)
        batch = inputs[0].shape[batch_dim]
        assert not out.narrow(batch_dim, batch, out.shape[batch_dim] - batch).any()
        return out.narrow(batch_dim, 0, batch)

    with torch.no_grad():
        got = run_incremental(padded, (q, k, v), steps, qkv_format, make_params(2, qkv_format))
        expected = run_incremental(dpa(2, qkv_format), (q, k, v), steps, qkv_format, make_params(2, qkv_format))
    for seq, rows in enumerate(expected):
        torch.testing.assert_close(got[seq], rows, atol=0, rtol=0)


def cached_tokens(params, layer_number):
    """{seq_id: (k, v) of its cached tokens}, read through the page table (paged) or the batch rows."""
    if params.is_paged:
        k_cache, v_cache = params.convert_paged_to_nonpaged(layer_number)
    else:
        k_cache, v_cache = params.cache_manager.cache[layer_number]
    return {seq: (k_cache[b, :length], v_cache[b, :length]) for b, (seq, length) in enumerate(params.sequences.items())}


@pytest.mark.parametrize("is_paged", [False, True], ids=["nonpaged", "paged"])
def test_cache_holds_the_written_tokens_and_frees_finished_sequences(is_paged):
    q, k, v = sequences(2)
    params = make_params(2, "bshd", is_paged)
    steps = plan(REQUESTS, MAX_BATCH)
    attention = dpa(2, "bshd")

    def check(index):
        for seq, (k_cached, v_cached) in cached_tokens(params, 1).items():
            length = sum(steps[index][seq])
            assert torch.equal(k_cached, k[seq][:length]) and torch.equal(v_cached, v[seq][:length]), seq
        if is_paged:
            manager = params.cache_manager
            in_use = [page for seq in params.sequences for page in manager.get_page_list(seq)]
            assert len(set(in_use)) == len(in_use), "a page given to two sequences"
            assert sorted(in_use + list(manager.free_pages)) == list(range(manager.total_num_pages))
            for b, seq in enumerate(params.sequences):
                assert manager.get_page_count(seq) == -(-params.sequences[seq] // PAGE)
                assert manager.page_table[b, :manager.get_page_count(seq)].tolist() == manager.get_page_list(seq)

    with torch.no_grad():
        run_incremental(attention, (q, k, v), steps, "bshd", params, on_step=check)
    params.reset()
    assert not params.sequences
    if is_paged:
        assert len(params.cache_manager.free_pages) == params.total_num_pages
        assert not params.cache_manager.page_table.any()


def watch_decoding(params, layers, num_gqa_groups=2):
    """(whether a cache tensor moved, peak bytes of the decoding, bytes it left allocated, one K cache's bytes)."""
    q, k, v = sequences(num_gqa_groups)
    steps = plan(REQUESTS, MAX_BATCH)
    # On torch's math ops: te_fuser's CPU kernel takes a workspace that grows with the thread count.
    modules = [dpa(num_gqa_groups, "bshd", layer_number=layer, backend="unfused") for layer in layers]
    for layer in layers:
        params.allocate_memory(layer)
    caches = [params.cache_manager.cache[layer] for layer in layers]
    addresses = [(kc.data_ptr(), vc.data_ptr()) for kc, vc in caches]
    moved = []

    def run(*step_inputs, inference_params):
        out = None
        for module in modules:
            out = module(*step_inputs, inference_params=inference_params)
        return out.detach()

    def check(_):
        now = [(kc.data_ptr(), vc.data_ptr()) for kc, vc in (params.cache_manager.cache[l] for l in layers)]
        moved.append(now != addresses)

    with torch.no_grad(), MemoryTracker("cpu") as tracker:
        outputs = run_incremental(run, (q, k, v), steps, "bshd", params, on_step=check)
        del outputs
    return any(moved), tracker.peak_bytes, tracker.retained_bytes, caches[0][0].nbytes


def big_cache_params(is_paged, custom_cache_manager=None):
    """A cache much larger than a step's working memory: a cache-sized allocation stands out."""
    kwargs = dict(max_sequence_length=1024, custom_cache_manager=custom_cache_manager)
    if is_paged:
        kwargs.update(page_size=16, total_num_pages=MAX_BATCH * 1024 // 16)
    return make_params(2, "bshd", is_paged, **kwargs)


@pytest.mark.parametrize("is_paged", [False, True], ids=["nonpaged", "paged"])
def test_cache_is_allocated_once_and_reused(is_paged):
    moved, peak, retained, cache_bytes = watch_decoding(big_cache_params(is_paged), layers=(1, 2))
    assert not moved, "a cache tensor was reallocated during decoding"
    assert peak < cache_bytes // 4, f"decoding allocated {peak} bytes at its peak; one K cache is {cache_bytes}"
    assert retained == 0


def _reallocating(base):
    class Reallocating(base):
        """Bug-on control: a manager that copies its cache into new tensors at every step."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs, device="cpu")

        def step(self, layer_number, *args):
            self.cache[layer_number] = tuple(c.clone() for c in self.cache[layer_number])
            return super().step(layer_number, *args)
    return Reallocating


@pytest.mark.parametrize("is_paged", [False, True], ids=["nonpaged", "paged"])
def test_measurement_catches_a_cache_reallocated_per_step(is_paged):
    manager = _reallocating(PagedKVCacheManager if is_paged else NonPagedKVCacheManager)
    moved, peak, retained, cache_bytes = watch_decoding(big_cache_params(is_paged, manager), layers=(1,))
    assert moved and peak >= cache_bytes and retained >= cache_bytes


def test_no_autograd_graph_kept_by_a_step():
    """Under grad mode too, the attention over the cache builds no graph: nothing of a step sits on a ctx."""
    q, k, v = sequences(2)
    params = make_params(2, "bshd")
    step = plan(REQUESTS, MAX_BATCH)[0]
    params.pre_step(step_dict(step))
    inputs = [step_input(t, step, "bshd").requires_grad_() for t in (q, k, v)]
    out = dpa(2, "bshd")(*inputs, inference_params=params)
    assert out.grad_fn is None and not out.requires_grad


def test_paged_cache_full_raises_and_leaves_the_state():
    params = make_params(2, is_paged=True, total_num_pages=3)
    params.pre_step(OrderedDict([(0, 4)]))
    with pytest.raises(RuntimeError, match="total_num_pages=3"):
        params.pre_step(OrderedDict([(0, 1), (1, 5)]))
    assert list(params.sequences.items()) == [(0, 4)] and len(params.cache_manager.free_pages) == 2


@pytest.mark.parametrize("kwargs, error", [
    (dict(num_heads_kv=None), "num_heads_kv"),
    (dict(dtype=None), "dtype"),
    (dict(dtype=torch.int32), "dtype"),
    (dict(max_batch_size=0), "max_batch_size"),
    (dict(max_sequence_length=2.5), "max_sequence_length"),
    (dict(head_dim_k=-1), "head_dim_k"),
    (dict(qkv_format="bhsd"), "qkv_format"),
    (dict(qkv_format="thd", max_ctx_len=None), "max_ctx_len"),
    (dict(max_ctx_len=MAX_SEQ + 1), "max_ctx_len"),
    (dict(is_paged=True, page_size=None, total_num_pages=4), "page_size"),
    (dict(is_paged=True, page_size=5, total_num_pages=4), "page_size"),
    (dict(is_paged=True, page_size=4, total_num_pages=0), "total_num_pages"),
    (dict(page_size=4), "page_size"),
])
def test_bad_constructor_arguments_name_themselves(kwargs, error):
    with pytest.raises(ValueError, match=error):
        make_params(2, **kwargs)


@pytest.mark.parametrize("step, error", [
    ({}, "step_dict"),
    ({0: 0}, r"step_dict\[0\]"),
    ({0: 1, 1: 1, 2: 1, 3: 1}, "max_batch_size"),
    ({0: MAX_SEQ}, "max_sequence_length"),
    ({2: 3, 0: 1}, "step_dict must list the continuing sequences first"),
    ({1: 1, 0: 1}, "step_dict must list the continuing sequences first"),
])
@pytest.mark.parametrize("is_paged", [False, True], ids=["nonpaged", "paged"])
def test_bad_steps_name_step_dict_or_the_limit(step, error, is_paged):
    params = make_params(2, is_paged=is_paged)
    params.pre_step(OrderedDict([(0, 2), (1, 2)]))
    with pytest.raises(ValueError, match=error):
        params.pre_step(OrderedDict(step))


def test_attention_refuses_what_the_cache_cannot_serve():
    q, k, v = (torch.randn(2, 3, heads, HEAD_DIM) for heads in (HEADS, 2, 2))
    params = make_params(2)
    params.pre_step(OrderedDict([(0, 3), (1, 3)]))
    with pytest.raises(ValueError, match="layer_number"):
        te_fuser.DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=2, qkv_format="bshd")(
            q, k, v, attn_mask_type="padding_causal", inference_params=params)
    with pytest.raises(ValueError, match="attn_mask_type"):
        dpa(2, "bshd", attn_mask_type="causal")(q, k, v, inference_params=params)
    with pytest.raises(ValueError, match="query_layer holds 1 sequences"):
        dpa(2, "bshd")(q[:1], k[:1], v[:1], inference_params=params)
    with pytest.raises(ValueError, match="its dtype"):
        dpa(2, "bshd")(q.half(), k.half(), v.half(), inference_params=params)
    with pytest.raises(TypeError, match="inference_params must be an InferenceParams"):
        dpa(2, "bshd")(q, k, v, inference_params={"max_batch_size": 2})
    with pytest.raises(RuntimeError, match="pre_step"):
        dpa(2, "bshd")(q, k, v, inference_params=make_params(2))


def test_exported_as_in_transformer_engine():
    assert te_fuser.InferenceParams is te_fuser.attention.InferenceParams is InferenceParams
