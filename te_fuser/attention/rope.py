"""Rotary position embedding (RoPE) applied to q or k, in torch, with TransformerEngine's conventions."""

import torch


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the halves of the last dim, or over its (even, odd) pairs when interleaved."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd",
                         interleaved: bool = False) -> torch.Tensor:
    """t * cos(freqs) + rotate_half(t) * sin(freqs) on the first freqs.shape[-1] channels of each head.

    t: [s, b, h, d] (sbhd) or [b, s, h, d] (bshd). freqs: float angles [s2, 1, 1, d2] (or
    [s2, b, 1, d2]) with s2 >= s and d2 <= d even; positions 0..s-1 are used. The remaining
    d - d2 channels pass through unchanged.
    """
    if tensor_format not in ("sbhd", "bshd"):
        raise NotImplementedError(f"rotary_pos_emb with qkv_format={tensor_format!r}: te_fuser applies RoPE "
                                  "in the sbhd and bshd layouts only")
    if not isinstance(freqs, torch.Tensor) or freqs.dim() != 4 or freqs.shape[2] != 1:
        raise ValueError(f"rotary_pos_emb must be a [s, 1, 1, d] (or [s, b, 1, d]) tensor of angles, got "
                         f"{tuple(freqs.shape) if isinstance(freqs, torch.Tensor) else type(freqs).__name__}")
    seq_dim = 0 if tensor_format == "sbhd" else 1
    seq, rot_dim = t.shape[seq_dim], freqs.shape[-1]
    if freqs.shape[0] < seq:
        raise ValueError(f"rotary_pos_emb covers {freqs.shape[0]} positions, the sequence has {seq}")
    if rot_dim > t.shape[-1] or rot_dim % 2:
        raise ValueError(f"rotary_pos_emb's last dim ({rot_dim}) must be even and at most the head dim "
                         f"({t.shape[-1]})")
    freqs = freqs[:seq]
    if tensor_format == "bshd":
        freqs = freqs.transpose(0, 1)
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    rot, rest = t[..., :rot_dim], t[..., rot_dim:]
    return torch.cat((rot * cos + _rotate_half(rot, interleaved) * sin, rest), dim=-1)
