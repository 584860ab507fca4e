"""Float64 rotary position embedding written from its definition, for tests/test_rope.py.

Each channel pair (a, b) -- (j, j + d2/2), or (2i, 2i + 1) when interleaved -- of a token at position p
is rotated by the angles of p: y[a] = x[a] cos f[a] - x[b] sin f[a], y[b] = x[b] cos f[b] + x[a] sin f[b];
channels from d2 on are copied. Positions are derived without the kernel's formula: with context
parallelism a sequence of L * cp positions is cut into 2 cp chunks, and rank r holds chunks r and
2 cp - 1 - r, in that order.
"""

from typing import List, Optional

import torch


def _local_positions(length: int, start: int, cp_size: int, cp_rank: int) -> List[int]:
    if cp_size == 1:
        return [start + s for s in range(length)]
    chunk = length // 2
    whole = list(range(length * cp_size))
    chunks = [whole[i * chunk:(i + 1) * chunk] for i in range(2 * cp_size)]
    return chunks[cp_rank] + chunks[2 * cp_size - 1 - cp_rank]


def _rotate(x: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [..., d] with angles [..., d2] broadcast against it."""
    d2 = angles.shape[-1]
    if interleaved:
        a, b = torch.arange(0, d2, 2), torch.arange(1, d2, 2)
    else:
        a, b = torch.arange(d2 // 2), torch.arange(d2 // 2, d2)
    out = x.clone()
    fa, fb = angles[..., a], angles[..., b]
    xa, xb = x[..., a], x[..., b]
    out[..., a] = xa * torch.cos(fa) - xb * torch.sin(fa)
    out[..., b] = xb * torch.cos(fb) + xa * torch.sin(fb)
    return out


def rope(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd",
         start_positions: Optional[torch.Tensor] = None, interleaved: bool = False,
         cu_seqlens: Optional[torch.Tensor] = None, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """The RoPE of t in float64 (differentiable in t), with apply_rotary_pos_emb's arguments."""
    t = t.double()
    freqs = freqs.double()
    starts = start_positions.tolist() if start_positions is not None else None
    if tensor_format == "thd":
        cu = [c // cp_size for c in cu_seqlens.tolist()]
        pieces = []
        for i, (b0, b1) in enumerate(zip(cu, cu[1:])):
            pos = _local_positions(b1 - b0, starts[i] if starts else 0, cp_size, cp_rank)
            angles = freqs[pos, i if freqs.shape[1] > 1 else 0]  # [L, 1, d2]
            pieces.append(_rotate(t[b0:b1], angles, interleaved))
        return torch.cat(pieces) if pieces else t.clone()
    bshd = t if tensor_format == "bshd" else t.transpose(0, 1)
    rows = []
    for i in range(bshd.shape[0]):
        pos = _local_positions(bshd.shape[1], starts[i] if starts else 0, cp_size, cp_rank)
        rows.append(_rotate(bshd[i], freqs[pos, i if freqs.shape[1] > 1 else 0], interleaved))
    out = torch.stack(rows) if rows else bshd.clone()
    return out if tensor_format == "bshd" else out.transpose(0, 1)


def rope_angles(max_seq_len: int, dim: int, base: float = 10000.0, interleaved: bool = False,
                offset: int = 0, position_scale: float = 1.0) -> torch.Tensor:
    """RotaryPositionEmbedding's table in float64: position (offset + i) * position_scale times
    base^(-2k/dim), each angle on its channel pair; [max_seq_len, 1, 1, 2 ceil(dim / 2)]."""
    inv = torch.tensor([base ** (-(2.0 * k) / dim) for k in range((dim + 1) // 2)], dtype=torch.float64)
    pos = (torch.arange(max_seq_len, dtype=torch.float64) + offset) * position_scale
    angles = pos[:, None] * inv[None, :]
    table = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return table[:, None, None, :]
