"""Attention in torch operators: DotProductAttention's path for attn_mask_type="arbitrary", and its form
under te_fuser.export.onnx_export(True), which torch.onnx translates (the sequence dimension may be dynamic).

softmax(q k^T * scale, masked) v in float32, returned in q's dtype. The masks are the module's: causal
aligned top-left (query i sees keys j <= i); padding from a TE bool mask (True = masked out; [b, 1, 1, s], or
a (query, key/value) pair), with the rows of padded queries 0 as the kernels leave them; arbitrary, a bool
mask broadcastable to [b, h, s_q, s_kv] (True = masked out) whose scores are set to -10000 before the softmax,
as TE's unfused attention does (a fully masked row then averages v). GQA repeats each key/value head for its
query heads. Autograd keeps torch's own saved tensors (the probabilities among them), released by its backward.
"""

import torch

from .masks import padding_lengths

_ARBITRARY_MASK_FILL = -10000.0


def _key_mask(mask: torch.Tensor) -> torch.Tensor:
    """[b, 1, 1, s] (or [b, s]) -> [b, 1, 1, s], True = masked out."""
    return mask.reshape(mask.shape[0], 1, 1, mask.shape[-1])


def _check_arbitrary_mask(mask, shape) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError("attention_mask must be a torch.bool tensor (True = masked out) with attn_mask_type "
                        "'arbitrary'")
    try:
        torch.broadcast_shapes(tuple(mask.shape), tuple(shape))
    except RuntimeError:
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape "
                         f"[b, h, s_q, s_kv] = {list(shape)}") from None
    return mask


def torch_attention(q, k, v, qkv_format: str, mask_type: str, attention_mask, softmax_scale: float,
                    self_attention: bool, dropout_p: float = 0.0) -> torch.Tensor:
    """The attention output [s, b, h*d] (sbhd) or [b, s, h*d] (bshd), in q's dtype."""
    if qkv_format not in ("sbhd", "bshd"):
        raise NotImplementedError(f"this attention path (arbitrary masks, ONNX export) takes qkv_format 'sbhd' "
                                  f"or 'bshd', got {qkv_format!r}")
    to_bhsd = (1, 2, 0, 3) if qkv_format == "sbhd" else (0, 2, 1, 3)
    qf, kf, vf = (t.float().permute(*to_bhsd) for t in (q, k, v))
    group = qf.shape[1] // kf.shape[1]
    if group > 1:
        kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * softmax_scale
    query_padding = None
    if mask_type == "arbitrary":
        if attention_mask is not None:
            scores = scores.masked_fill(_check_arbitrary_mask(attention_mask, scores.shape), _ARBITRARY_MASK_FILL)
    else:
        masked = None
        if "causal" in mask_type:
            rows = torch.arange(scores.shape[-2], device=q.device)
            cols = torch.arange(scores.shape[-1], device=q.device)
            masked = cols[None, :] > rows[:, None]
        if "padding" in mask_type and attention_mask is not None:
            padding_lengths(attention_mask, qf.shape[0], qf.shape[2], kf.shape[2], self_attention)  # its checks
            mask_q, mask_kv = (attention_mask if isinstance(attention_mask, (tuple, list))
                               else (attention_mask, attention_mask))
            masked = _key_mask(mask_kv) if masked is None else masked | _key_mask(mask_kv)
            query_padding = _key_mask(mask_q).transpose(-1, -2)  # [b, 1, s_q, 1]
        if masked is not None:
            scores = scores.masked_fill(masked, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, dropout_p)
    out = torch.matmul(probs, vf)
    if query_padding is not None:
        out = out.masked_fill(query_padding, 0.0)
    out = out.permute(*(2, 0, 1, 3) if qkv_format == "sbhd" else (0, 2, 1, 3))
    return out.reshape(*out.shape[:2], -1).to(q.dtype)
