"""Rotary position embedding (RoPE) with TransformerEngine's interface: the angle table
(RotaryPositionEmbedding) and its application to q or k (apply_rotary_pos_emb), in C for every layout."""

from typing import Optional

import torch

from ..kernels.rope import rope

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb"]


class RotaryPositionEmbedding(torch.nn.Module):
    """The RoPE angles of https://arxiv.org/abs/2104.09864 as a [max_seq_len, 1, 1, dim] float32 table.

    dim: the rotated channels (times rotary_percent when that is below 1). rotary_base: the base of
    the inverse frequencies base^(-2i/dim). seq_len_interpolation_factor with
    pretrained_max_position_embeddings: positions divided by the factor (position interpolation,
    https://arxiv.org/abs/2306.15595), or by max_seq_len / pretrained_max_position_embeddings when the
    sequence is longer than the factor covers. interleaved: each angle repeated for the channel pair
    (2i, 2i + 1) rather than for (i, i + dim/2).
    """

    def __init__(self, dim: int, rotary_percent: float = 1.0, seq_len_interpolation_factor: Optional[int] = None,
                 pretrained_max_position_embeddings: Optional[int] = None, rotary_base: float = 10000.0,
                 interleaved: bool = False):
        super().__init__()
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.rotary_base = rotary_base
        self.interleaved = interleaved
        exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
        self.register_buffer("inv_freq", 1.0 / (rotary_base ** exponents))

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """Angles of positions offset .. offset + max_seq_len - 1: [max_seq_len, 1, 1, dim] float32."""
        positions = torch.arange(max_seq_len, dtype=self.inv_freq.dtype, device=self.inv_freq.device) + offset
        factor, pretrained = self.seq_len_interpolation_factor, self.pretrained_max_position_embeddings
        if factor is not None and pretrained is not None:
            if max_seq_len > pretrained * factor:
                positions = positions * (1 / (max_seq_len / pretrained))
            else:
                positions = positions * (1 / factor)
        angles = torch.outer(positions, self.inv_freq)
        if self.interleaved:
            table = angles.repeat_interleave(2, dim=-1)
        else:
            table = torch.cat((angles, angles), dim=-1)
        return table.reshape(table.shape[0], 1, 1, table.shape[1])


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd",
                         start_positions: Optional[torch.Tensor] = None, interleaved: bool = False,
                         fused: bool = False, cu_seqlens: Optional[torch.Tensor] = None, cp_size: int = 1,
                         cp_rank: int = 0) -> torch.Tensor:
    """RoPE on the first freqs.shape[-1] channels of each head of t; the other channels pass through.

    t: [s, b, h, d] (sbhd), [b, s, h, d] (bshd) or [t, h, d] (thd, sequences packed as cu_seqlens
    [b + 1] says; positions restart at each sequence). freqs: angles [s2, 1, 1, d2] (or [s2, b, 1, d2])
    with d2 <= d even and s2 covering every position used. start_positions [b]: each sequence's
    first position (inference; cp_size 1 only). cp_size / cp_rank: context parallelism, where this
    rank holds chunks cp_rank and 2 cp_size - cp_rank - 1 of each sequence (in thd, cu_seqlens are then
    the padded global boundaries). fused: accepted for TransformerEngine's interface; both values run
    te_fuser's C kernel (float32 math, one rounding to t's dtype). Returns a new contiguous tensor.
    On a GPU, cu_seqlens and start_positions are not read on the host (nothing waits): tokens that they
    place outside a sequence or outside freqs come out NaN instead of raising.
    """
    del fused  # one implementation
    return rope(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank)
