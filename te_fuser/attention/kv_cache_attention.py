"""DotProductAttention over an InferenceParams KV cache: a step's new queries against the cached and new keys.

TE aligns the causal mask of a step to the bottom right: new token i of a sequence with c cached tokens sees
keys 0 .. c + i. te_fuser's kernels align it to the top left, so the step runs as two calls on te_fuser's
backends, merged through their log-sum-exps: the new queries against the c cached keys (no mask), and
against the new keys themselves (the mask asked for, square, where both alignments agree). Everything
runs in the kernel layout [batch, seq, heads, dim] with per-sequence lengths; thd steps are padded to it.
No autograd Function runs, so nothing of a step is kept for a backward.
"""

import torch

from .backends import BACKENDS, Call, Lengths
from .function import choose_backend
from .inference import new_tokens, token_indices


def _attend(q, k, v, lens_q, lens_kv, softmax_scale, causal, backend):
    """(out [b, s, h, d], lse [b, h, s]) on one of te_fuser's backends (no dropout)."""
    lengths = Lengths(None, None, lens_q, lens_kv)
    name = choose_backend(q, k, "bshd", lengths, softmax_scale, causal, "none", False, backend)
    impl = BACKENDS[name]
    call = impl.complete(Call(float(softmax_scale), bool(causal)), q, k, lengths)
    out, lse, _ = impl.forward(q, k, v, lengths, call)
    return out, lse


def _merge(parts, dtype):
    """softmax over the union of the parts' keys, from each part's normalized output and lse."""
    lses = [lse.transpose(1, 2).unsqueeze(-1) for _, lse in parts]  # [b, s, h, 1]
    top = torch.stack(lses).amax(0)
    top = top.masked_fill(top == float("-inf"), 0.0)
    weights = [torch.exp(lse - top) for lse in lses]
    total = sum(weights)
    out = sum(w * o.float() for w, (o, _) in zip(weights, parts))
    return torch.where(total > 0, out / total.clamp_min(torch.finfo(torch.float32).tiny), 0.0).to(dtype)


def _padded(t, batch, within, batch_size, length):
    """Packed tokens [tokens, h, d] as [batch_size, length, h, d], zeros elsewhere."""
    out = t.new_zeros(batch_size, length, *t.shape[1:])
    out[batch, within] = t
    return out


def cached_attention(q, k, v, qkv_format: str, inference_params, layer_number: int, softmax_scale: float,
                     causal: bool, backend=None) -> torch.Tensor:
    """The step's attention output in q's layout ([.., heads, dim]); writes k and v into the cache."""
    params = inference_params
    batch_size = params.batch_size
    if batch_size == 0:
        raise RuntimeError("inference_params has no step: call inference_params.pre_step(step_dict) first")
    if params.cu_seqlens_q.device != q.device:
        raise ValueError(f"inference_params' cache is on {params.cu_seqlens_q.device}, query_layer on {q.device} "
                         f"(InferenceParams' device chooses)")
    if params.dtype != q.dtype:
        raise ValueError(f"inference_params' cache holds {params.dtype} (its dtype), query_layer is {q.dtype}")
    batch_dim = {"bshd": 0, "sbhd": 1}.get(qkv_format)
    # Batches padded past the step's sequences (to max_batch_size, for CUDA graphs in TE) give 0 there.
    if batch_dim is not None and q.shape[batch_dim] < batch_size:
        raise ValueError(f"query_layer holds {q.shape[batch_dim]} sequences, inference_params' step has "
                         f"{batch_size} (the step_dict given to pre_step)")
    new_counts = [total - pre for total, pre in zip(params.sequences.values(), params.sequences_pre_step.values())]
    tokens, max_new = sum(new_counts), max(new_counts)
    if qkv_format == "thd" and q.shape[0] < tokens:
        raise ValueError(f"query_layer has {q.shape[0]} tokens, the step has {tokens}")
    if batch_dim is not None and q.shape[1 - batch_dim] < max_new:
        raise ValueError(f"query_layer's sequence dim is {q.shape[1 - batch_dim]}, the step has {max_new} new "
                         f"tokens in a sequence")

    k_cache, v_cache = params.step(layer_number, k, v, qkv_format)[:2]
    lens_new = (params.cu_seqlens_q[1:batch_size + 1] - params.cu_seqlens_q[:batch_size]).to(torch.int32)
    lens_cached = params.pre_step_seqlens[:batch_size]
    if qkv_format == "thd":
        batch, within, _ = token_indices(params.cu_seqlens_q, params.cu_seqlens_kv, batch_size)
        qk, kk, vk = (_padded(new_tokens(t, "thd", batch, within), batch, within, batch_size, max_new)
                      for t in (q, k, v))
    else:
        qk, kk, vk = ((t.permute(1, 0, 2, 3) if qkv_format == "sbhd" else t)[:batch_size] for t in (q, k, v))

    parts = [_attend(qk, kk, vk, lens_new, lens_new, softmax_scale, causal, backend)]
    max_cached = max(params.sequences_pre_step.values())
    if max_cached > 0:
        if params.is_paged:
            k_old, v_old = params.convert_paged_to_nonpaged(layer_number, max_cached)
        else:
            k_old, v_old = k_cache[:, :max_cached], v_cache[:, :max_cached]
        parts.append(_attend(qk, k_old, v_old, lens_new, lens_cached, softmax_scale, False, backend))
    out = _merge(parts, q.dtype) if len(parts) > 1 else parts[0][0]

    if qkv_format == "thd":
        packed = out.new_zeros(q.shape[0], *out.shape[2:])
        packed[:tokens] = out[batch, within]
        return packed
    if out.shape[0] < q.shape[batch_dim]:
        out = torch.cat((out, out.new_zeros(q.shape[batch_dim] - out.shape[0], *out.shape[1:])))
    return out.permute(1, 0, 2, 3) if qkv_format == "sbhd" else out
