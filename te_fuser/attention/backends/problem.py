"""What an attention backend needs to know about a problem to say whether it runs it, and the scalars of
one call.

Tensors are in te_fuser's kernel layout (te_fuser/kernels/attention.py): q [batch, seq_q, heads_q, head_dim],
k and v [batch, seq_kv, heads_kv, head_dim]; packed (thd) problems have batch 1 and cu_seqlens offsets.
"""

from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch

from ...kernels import cpu

# How a problem's dropout mask is drawn: none; from the (seed, offset) the caller gives (te_fuser's Philox:
# attention_fwd's seed/offset, the autograd Function's); or from torch's generator at call time
# (DotProductAttention, which runs the call inside its RNG tracker's fork).
DROPOUT_KINDS = ("none", "seeded", "generator")


@dataclass(frozen=True)
class Problem:
    """The properties of an attention problem that decide which backend may run it (hashable: selections
    are cached by it). Sequence lengths enter only through what a backend's semantics depend on."""
    device: str                  # "cpu", "cuda" or "meta" (shapes only)
    capability: Optional[Tuple[int, int]]  # CUDA compute capability, None elsewhere
    isa: Optional[str]           # te_fuser's CPU tier (te_fuser.kernels.cpu), None elsewhere
    dtype: torch.dtype
    head_dim: int
    gqa: bool                    # fewer k/v heads than q heads (GQA/MQA)
    layout: str                  # "dense" (bshd/sbhd), "padded" (seqlens) or "packed" (thd, cu_seqlens)
    causal: bool
    square: bool                 # every sequence has as many queries as keys (what a causal mask aligns on)
    single_key: bool             # seq_kv == 1
    dropout: str                 # one of DROPOUT_KINDS
    positive_scale: bool
    empty: bool                  # no query or no key
    deterministic: bool          # torch.use_deterministic_algorithms is on


class Call(NamedTuple):
    """The Python scalars of one call (kept on the autograd ctx; tensors never are)."""
    softmax_scale: float
    causal: bool
    dropout_p: float = 0.0
    seed: int = 0
    offset: int = 0
    max_seqlen_q: Optional[int] = None   # packed problems: the longest sequence (TE's max_seqlen_q)
    max_seqlen_kv: Optional[int] = None


class Lengths(NamedTuple):
    """The sequence-length tensors of a call (saved with save_for_backward)."""
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_kv: Optional[torch.Tensor] = None
    seqlens_q: Optional[torch.Tensor] = None
    seqlens_kv: Optional[torch.Tensor] = None


def _capability(device: torch.device) -> Optional[Tuple[int, int]]:
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


def describe(q, k, lengths: Lengths, causal: bool, dropout: str, softmax_scale: float,
             dtype: Optional[torch.dtype] = None) -> Problem:
    """The Problem of kernel-layout q and k with these lengths; dtype is what the kernel is given, when not
    q's (float8_e4m3fn for 16-bit q, k, v that fp8_dpa quantizes)."""
    if dropout not in DROPOUT_KINDS:
        raise ValueError(f"dropout must be one of {DROPOUT_KINDS}, got {dropout!r}")
    cu_q, cu_kv, lens_q, lens_kv = lengths
    if cu_q is not None:
        # Packed sequences are known square without reading the offsets when q and kv share one tensor
        # of them (self-attention given one cu_seqlens).
        layout, square = "packed", cu_q is cu_kv
    elif lens_q is not None or lens_kv is not None:
        layout, square = "padded", False
    else:
        layout, square = "dense", q.shape[1] == k.shape[1]
    return Problem(
        device=q.device.type, capability=_capability(q.device),
        isa=cpu.current_isa() if q.device.type == "cpu" else None, dtype=dtype or q.dtype, head_dim=int(q.shape[3]),
        gqa=q.shape[2] != k.shape[2], layout=layout, causal=bool(causal), square=bool(square),
        single_key=k.shape[1] == 1, dropout=dropout, positive_scale=softmax_scale > 0.0,
        empty=q.numel() == 0 or k.numel() == 0, deterministic=torch.are_deterministic_algorithms_enabled())
