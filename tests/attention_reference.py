"""Float64 reference attention for the tests: torch SDPA per sequence, with explicit boolean masks."""

import torch
import torch.nn.functional as F


def segments(batch, seq_q, seq_kv, lens_q=None, lens_kv=None, cu_q=None, cu_kv=None):
    """(batch index, q start, q len, kv start, kv len) of every sequence in the kernel layout."""
    if cu_q is not None:
        cu_q, cu_kv = cu_q.tolist(), cu_kv.tolist()
        return [(0, cu_q[i], cu_q[i + 1] - cu_q[i], cu_kv[i], cu_kv[i + 1] - cu_kv[i]) for i in range(len(cu_q) - 1)]
    lq = lens_q.tolist() if lens_q is not None else [seq_q] * batch
    lkv = lens_kv.tolist() if lens_kv is not None else [seq_kv] * batch
    return [(b, 0, lq[b], 0, lkv[b]) for b in range(batch)]


def attention(q, k, v, segs, causal, scale, dropout_mask=None, dropout_p=0.0):
    """Output in the kernel layout [B, S, H, D] of float64 q, k, v in that layout; rows outside every sequence are 0.

    dropout_mask, when given, is a bool [B or N, H, Sq, Skv] keep mask indexed by
    (sequence, head, row, col) inside each sequence.
    """
    out = torch.zeros_like(q)
    group = q.shape[2] // k.shape[2]
    for n, (b, q0, lq, k0, lkv) in enumerate(segs):
        if lq == 0 or lkv == 0:
            continue
        qs = q[b, q0:q0 + lq].transpose(0, 1)  # [H, lq, D]
        ks = k[b, k0:k0 + lkv].repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[b, k0:k0 + lkv].repeat_interleave(group, dim=1).transpose(0, 1)
        allowed = torch.ones(lq, lkv, dtype=torch.bool)
        if causal:
            allowed = allowed.tril()
        if dropout_mask is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale)
        else:
            s = (qs @ ks.transpose(1, 2)) * scale
            p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
            keep = dropout_mask[n, :, :lq, :lkv].to(p.dtype) / (1.0 - dropout_p)
            o = (p * keep) @ vs
        rows = torch.arange(q0, q0 + lq)
        out = out.index_put((torch.full_like(rows, b), rows), o.transpose(0, 1), accumulate=True)
    return out
