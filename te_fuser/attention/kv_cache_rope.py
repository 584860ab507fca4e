"""Rotary position embedding of a KV-cache inference step: each new token rotated by its position in its
sequence (the sequence's cached length plus its index among the step's new tokens), as TE's
MultiheadAttention offsets the embedding by inference_params.get_seqlens_pre_step()."""

import torch

from .inference import token_indices
from .rope import apply_rotary_pos_emb


def _positions(t: torch.Tensor, qkv_format: str, params) -> torch.Tensor:
    """The position of every row of t's tokens, flattened in t's order (rows past a sequence: 0)."""
    batch_size = params.batch_size
    cached = params.pre_step_seqlens[:batch_size].long()
    if qkv_format == "bshd":
        return (cached[:, None] + torch.arange(t.shape[1], device=cached.device)[None, :]).flatten()
    if qkv_format == "sbhd":
        return (torch.arange(t.shape[0], device=cached.device)[:, None] + cached[None, :]).flatten()
    _, _, position = token_indices(params.cu_seqlens_q, params.cu_seqlens_kv, batch_size)
    return torch.cat((position, position.new_zeros(t.shape[0] - position.numel())))


def _rotate(t, freqs, positions, interleaved):
    if not isinstance(freqs, torch.Tensor) or freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"rotary_pos_emb with inference_params must be a [s, 1, 1, d] tensor of angles, got "
                         f"{tuple(freqs.shape) if isinstance(freqs, torch.Tensor) else type(freqs).__name__}")
    tokens = t.reshape(-1, 1, *t.shape[-2:])
    rows = freqs[positions.clamp(max=freqs.shape[0] - 1)]
    return apply_rotary_pos_emb(tokens, rows, tensor_format="sbhd", interleaved=interleaved).reshape(t.shape)


def apply_step_rotary_pos_emb(query, key, q_freqs, k_freqs, qkv_format: str, params, interleaved: bool):
    """(query, key) rotated at the positions of the step's new tokens in their sequences."""
    longest = max(params.sequences.values())
    for name, freqs in (("q", q_freqs), ("k", k_freqs)):
        if isinstance(freqs, torch.Tensor) and freqs.shape[0] < longest:
            raise ValueError(f"rotary_pos_emb ({name}) covers {freqs.shape[0]} positions, a sequence of the step "
                             f"reaches {longest}")
    positions = _positions(query, qkv_format, params)
    return _rotate(query, q_freqs, positions, interleaved), _rotate(key, k_freqs, positions, interleaved)
