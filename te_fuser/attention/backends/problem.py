"""What an attention backend needs to know about a problem to say whether it runs it, and the scalars of
one call.

Tensors are in te_fuser's kernel layout (te_fuser/kernels/attention.py): q [batch, seq_q, heads_q, head_dim],
k and v [batch, seq_kv, heads_kv, head_dim]; packed (thd) problems have batch 1 and cu_seqlens offsets.
"""

from typing import NamedTuple, Optional, Tuple

import torch

from ...kernels import cpu

# How a problem's dropout mask is drawn: none; from the (seed, offset) the caller gives (te_fuser's Philox:
# attention_fwd's seed/offset, the autograd Function's); or from torch's generator at call time
# (DotProductAttention, which runs the call inside its RNG tracker's fork).
DROPOUT_KINDS = ("none", "seeded", "generator")


class Problem(NamedTuple):
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


def _dims(t, qkv_format):
    """(batch, seq, heads, head_dim) of a tensor in qkv_format ("kernel": te_fuser's kernel layout)."""
    if qkv_format == "sbhd":
        seq, batch, heads, dim = t.shape
        return batch, seq, heads, dim
    if qkv_format == "thd":
        seq, heads, dim = t.shape
        return 1, seq, heads, dim
    return tuple(t.shape)  # bshd and the kernel layout


def describe(q, k, lengths: Lengths, causal: bool, dropout: str, softmax_scale: float,
             dtype: Optional[torch.dtype] = None, qkv_format: str = "kernel") -> Problem:
    """The Problem of q and k (in qkv_format, by default te_fuser's kernel layout) with these lengths; dtype
    is what the kernel is given, when not q's (float8_e4m3fn for 16-bit q, k, v that fp8_dpa quantizes)."""
    if dropout not in DROPOUT_KINDS:
        raise ValueError(f"dropout must be one of {DROPOUT_KINDS}, got {dropout!r}")
    _, seq_q, heads_q, head_dim = _dims(q, qkv_format)
    _, seq_kv, heads_kv, _ = _dims(k, qkv_format)
    cu_q, cu_kv, lens_q, lens_kv = lengths
    if cu_q is not None:
        # Packed sequences are known square without reading the offsets when q and kv share one tensor
        # of them (self-attention given one cu_seqlens).
        layout, square = "packed", cu_q is cu_kv
    elif lens_q is not None or lens_kv is not None:
        layout, square = "padded", False
    else:
        layout, square = "dense", seq_q == seq_kv
    device = q.device
    return Problem(
        device.type, _capability(device) if device.type == "cuda" else None,
        cpu.current_isa() if device.type == "cpu" else None, dtype or q.dtype,
        int(head_dim), heads_q != heads_kv, layout, bool(causal), bool(square), seq_kv == 1, dropout,
        softmax_scale > 0.0, q.numel() == 0 or k.numel() == 0, torch.are_deterministic_algorithms_enabled())
