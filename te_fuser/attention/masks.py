"""Attention mask types and the conversion of padding masks to sequence lengths."""

from typing import Optional, Tuple

import torch

# The masks of the fused backends; "arbitrary" runs in torch operators (attention/torch_attention.py).
MASK_TYPES = ("no_mask", "causal", "padding", "padding_causal")
_ALL_MASK_TYPES = MASK_TYPES + ("arbitrary",)


def check_mask_type(attn_mask_type: str) -> str:
    if attn_mask_type not in _ALL_MASK_TYPES:
        raise NotImplementedError(
            f"attn_mask_type={attn_mask_type!r} is not supported; te_fuser supports {', '.join(_ALL_MASK_TYPES)}")
    return attn_mask_type


def check_window_size(window_size, attn_mask_type: str) -> None:
    """Only the windows that mean 'no window' (or the causal one with a causal mask) are implemented."""
    if window_size is None:
        return
    window = tuple(window_size)
    if window == (-1, -1) or (window == (-1, 0) and "causal" in attn_mask_type):
        return
    raise NotImplementedError(
        f"window_size={window_size!r} (sliding-window attention) is not supported with "
        f"attn_mask_type={attn_mask_type!r}; use None, (-1, -1), or (-1, 0) with a causal mask")


def _lengths_from_mask(mask: torch.Tensor, name: str, batch: int, seq: int) -> torch.Tensor:
    """Valid lengths of a TransformerEngine padding mask (True = masked out), [b, 1, 1, s] or [b, s]."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a torch.bool tensor (True = masked out)")
    if mask.dim() == 4:
        if mask.shape[1] != 1 or mask.shape[2] != 1:
            raise ValueError(f"{name} must have shape [b, 1, 1, s] for padding, got {tuple(mask.shape)}")
        mask = mask.reshape(mask.shape[0], mask.shape[3])
    if mask.dim() != 2 or tuple(mask.shape) != (batch, seq):
        raise ValueError(f"{name} must have shape [{batch}, 1, 1, {seq}], got {tuple(mask.shape)}")
    lengths = (~mask).sum(dim=1, dtype=torch.int32)
    if mask.device.type == "cpu":
        # The kernels take lengths, so the valid tokens must come first (right padding).
        right_padded = (mask == (torch.arange(seq, device=mask.device)[None, :] >= lengths[:, None])).all()
        if torch.compiler.is_compiling():  # a data-dependent check that traces (a RuntimeError when run)
            torch._assert_async(right_padded, f"{name} must mask a suffix of every sequence (right padding)")
        elif not right_padded:
            raise ValueError(f"{name} must mask a suffix of every sequence (right padding)")
    return lengths


def padding_lengths(attention_mask, batch: int, seq_q: int, seq_kv: int,
                    self_attention: bool) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(seqlens_q, seqlens_kv) of a padding mask: one [b,1,1,s] mask for self-attention, or a pair."""
    if attention_mask is None:
        return None, None
    if isinstance(attention_mask, (tuple, list)):
        if len(attention_mask) != 2:
            raise ValueError("attention_mask must be one mask or a pair (query mask, key/value mask)")
        mask_q, mask_kv = attention_mask
    elif self_attention and seq_q == seq_kv:
        mask_q = mask_kv = attention_mask
    else:
        raise ValueError("cross-attention padding needs attention_mask=(query mask, key/value mask)")
    lengths_q = _lengths_from_mask(mask_q, "attention_mask", batch, seq_q)
    lengths_kv = lengths_q if mask_kv is mask_q else _lengths_from_mask(mask_kv, "attention_mask[1]", batch, seq_kv)
    return lengths_q, lengths_kv


def lengths_from_cu_seqlens(cu_seqlens: torch.Tensor, name: str, batch: int) -> torch.Tensor:
    """Per-sequence lengths of cu_seqlens offsets, for padded batched (bshd/sbhd) layouts."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() != batch + 1:
        raise ValueError(f"{name} must be a 1-D tensor of batch + 1 = {batch + 1} offsets")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must hold int32 or int64 offsets, got {cu_seqlens.dtype}")
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling() and bool((lengths < 0).any()):
        raise ValueError(f"{name} must not decrease, got {cu_seqlens.tolist()}")
    return lengths.to(torch.int32)
