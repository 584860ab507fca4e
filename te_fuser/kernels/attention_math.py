"""Attention in torch's own ops, for the CUDA problems te_fuser's CUDA kernels do not cover.

Those kernels take bfloat16, float16 and float8_e4m3fn q/k/v with head dims CUDA_HEAD_DIMS. TE sends the
other problems (float32 above all) to its unfused attention; te_fuser sends them here, with the kernels'
semantics (csrc/attention/attention.h): float32 scores, softmax and sums, a top-left causal mask, padded
(seqlens) and packed (cu_seqlens) sequences, GQA, and output 0 / lse -inf / zero gradients for query rows
that see no key. Like TE's unfused path it materializes the float32 [batch, heads, seq_q, seq_kv] scores, so
its memory grows with the square of the sequence length. Results are [b, s, h, d] views in float32.
"""

import torch

# Head dims of the CUDA kernels (TF_ATTN_CUDA_HEAD_DIMS in csrc/cuda/attention/attention_cuda.h).
CUDA_HEAD_DIMS = (32, 64, 96, 128)
CUDA_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)


def applies(q) -> bool:
    """Whether a problem with this q runs here rather than on te_fuser's kernels."""
    return q.is_cuda and (q.dtype not in CUDA_KERNEL_DTYPES or q.shape[3] not in CUDA_HEAD_DIMS)


def refuse_dropout(q, dropout_p: float) -> None:
    if dropout_p > 0.0:
        raise NotImplementedError(
            f"attention dropout on CUDA needs te_fuser's CUDA kernels (q, k, v in bfloat16, float16 or "
            f"float8_e4m3fn, head dim in {CUDA_HEAD_DIMS}); got {q.dtype} with head dim {q.shape[3]}")


def _visible(q, k, cu_q, cu_kv, lens_q, lens_kv, causal):
    """[batch, 1, seq_q, seq_kv] bool: which key each query sees."""
    iq = torch.arange(q.shape[1], device=q.device)
    ik = torch.arange(k.shape[1], device=q.device)
    if cu_q is not None:
        num_seqs = cu_q.numel() - 1
        cu_q, cu_kv = cu_q.long(), cu_kv.long()
        # A token's sequence: the last offset at or before it (past cu[N]: sequence N, which is no sequence).
        seq_q = torch.searchsorted(cu_q, iq, right=True) - 1
        seq_k = torch.searchsorted(cu_kv, ik, right=True) - 1
        visible = (seq_q[:, None] == seq_k[None, :]) & (seq_q < num_seqs)[:, None]
        if causal:
            visible &= (ik - cu_kv[seq_k])[None, :] <= (iq - cu_q[seq_q])[:, None]
        return visible[None, None]
    visible = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device)
    if causal:
        visible = ik[None, :] <= iq[:, None]
    visible = visible.expand(q.shape[0], -1, -1)
    if lens_q is not None:
        visible = visible & (iq[None, :] < lens_q[:, None])[:, :, None]
    if lens_kv is not None:
        visible = visible & (ik[None, :] < lens_kv[:, None])[:, None, :]
    return visible[:, None]


def _heads_first(t, descale, groups=1):
    """[b, s, h, d] in any float dtype (FP8 with its descale) as float32 [b, h * groups, s, d]."""
    t = t.float() if descale is None else t.float() * descale
    return t.repeat_interleave(groups, dim=2).transpose(1, 2)


def _probabilities(qf, kf, visible, scale, lse=None):
    """(p, lse) with p = exp(scores - lse) on visible keys, 0 elsewhere; lse computed when not given."""
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    # Rows that see no key have lse -inf: subtracting 0 there keeps their probabilities 0, not NaN.
    shift = lse.masked_fill(lse == float("-inf"), 0.0)
    return torch.exp(scores - shift.unsqueeze(-1)), lse


def attention_fwd(q, k, v, cu_q, cu_kv, lens_q, lens_kv, scale, causal, descales):
    """(out, lse): out float32 [b, s, h, d], lse as the attention_fwd op gives it."""
    groups = q.shape[2] // k.shape[2]
    q_descale, k_descale, v_descale = descales
    visible = _visible(q, k, cu_q, cu_kv, lens_q, lens_kv, causal)
    p, lse = _probabilities(_heads_first(q, q_descale), _heads_first(k, k_descale, groups), visible, scale)
    out = torch.matmul(p, _heads_first(v, v_descale, groups))
    return out.transpose(1, 2), (lse[0] if cu_q is not None else lse).contiguous()


def attention_bwd(dout, q, k, v, out, lse, cu_q, cu_kv, lens_q, lens_kv, scale, causal, descales):
    """(dq, dk, dv), float32 [b, s, h, d]."""
    groups = q.shape[2] // k.shape[2]
    q_descale, k_descale, v_descale = descales
    visible = _visible(q, k, cu_q, cu_kv, lens_q, lens_kv, causal)
    qf, kf, vf = (_heads_first(q, q_descale), _heads_first(k, k_descale, groups),
                  _heads_first(v, v_descale, groups))
    p, _ = _probabilities(qf, kf, visible, scale, lse[None] if cu_q is not None else lse)
    do = _heads_first(dout, None)
    delta = (do * _heads_first(out, None)).sum(-1, keepdim=True)
    ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, kf) * scale
    b, h, skv, d = kf.shape
    dk = (torch.matmul(ds.transpose(-1, -2), qf) * scale).view(b, h // groups, groups, skv, d).sum(2)
    dv = torch.matmul(p.transpose(-1, -2), do).view(b, h // groups, groups, skv, d).sum(2)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
