"""Rotary position embedding kernels (te_fuser::rope_forward / rope_backward): the validated entry
point, the fake kernels and the autograd rule.

The kernels are C (csrc/ops/rope.c). They read q or k in place through its strides (views of a
fused QKV projection need no copy) and return a new contiguous tensor; math is float32 on float32
angles, as TransformerEngine's fused RoPE. The backward is the exact transpose of the forward map,
so it keeps only the small tensors that say where each token sits (freqs, start_positions,
cu_seqlens), never the activation.
"""

from typing import Optional

import torch

from .validate import FLOAT_DTYPES, call_checked, check_dtype, check_one_device_in_fake, check_same_device, check_tensor

_ops = torch.ops.te_fuser

# The codes of csrc/ops/rope.h's tf_rope_format.
TENSOR_FORMATS = {"sbhd": 0, "bshd": 1, "thd": 2}
_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_index_tensor(v, name: str, t: torch.Tensor) -> None:
    check_tensor(v, name)
    if v.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be an int32 tensor (int64 is converted), got {v.dtype}")
    if v.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(v.shape)}")
    check_same_device(v, name, t, "t")


def _check_sequences(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank) -> None:
    """The values of cu_seqlens and start_positions, and the positions they need from freqs."""
    rows = freqs.shape[0]
    if tensor_format == "thd":
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu}")
        if cu[-1] != t.shape[0] * cp_size:
            raise ValueError(f"cu_seqlens must end at the token count of t ({t.shape[0]}) times cp_size "
                             f"({cp_size}), got {cu[-1]}")
        if cp_size > 1 and any(c % (2 * cp_size) for c in cu):
            raise ValueError(f"with cp_size={cp_size}, every cu_seqlens entry must be a multiple of "
                             f"2 * cp_size, got {cu}")
        lengths = [b - a for a, b in zip(cu, cu[1:])]
    else:
        seq, batch = (t.shape[0], t.shape[1]) if tensor_format == "sbhd" else (t.shape[1], t.shape[0])
        lengths = [seq] * (batch if start_positions is not None else 1)
    if cp_size > 1:
        if tensor_format != "thd" and lengths[0] % 2:
            raise ValueError(f"with cp_size={cp_size}, the local sequence length must be even, got {lengths[0]}")
        full = max(lengths, default=0) * (1 if tensor_format == "thd" else cp_size)
        if full > rows:
            raise ValueError(f"freqs covers {rows} positions; sequences of {full} positions need more")
        return
    starts = start_positions.tolist() if start_positions is not None else [0] * len(lengths)
    for i, (start, length) in enumerate(zip(starts, lengths)):
        if length and (start < 0 or start + length > rows):
            raise ValueError(f"freqs covers {rows} positions; sequence {i} needs positions {start} to "
                             f"{start + length - 1} (start_positions must be >= 0)")


def _check(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, name="t") -> None:
    check_dtype(t, name)
    thd = tensor_format == "thd"
    if t.dim() != (3 if thd else 4):
        raise ValueError(f"{name} must be {'[t, h, d]' if thd else f'[{tensor_format[0]}, {tensor_format[1]}, h, d]'} "
                         f"for tensor_format={tensor_format!r}, got shape {tuple(t.shape)}")
    if thd and cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens must have at least one element")
    batch = cu_seqlens.shape[0] - 1 if thd else t.shape[1 if tensor_format == "sbhd" else 0]
    if freqs.dim() != 4 or freqs.shape[2] != 1 or freqs.shape[1] not in (1, batch):
        raise ValueError(f"freqs must be [s, 1, 1, d2] or [s, b, 1, d2] with b = {batch}, got shape "
                         f"{tuple(freqs.shape)}")
    check_same_device(freqs, "freqs", t, name)
    rot_dim = freqs.shape[3]
    if rot_dim % 2 or rot_dim > t.shape[-1]:
        raise ValueError(f"freqs' last dim ({rot_dim}) must be even and at most the head dim of {name} "
                         f"({t.shape[-1]})")
    if start_positions is not None and start_positions.shape[0] != batch:
        raise ValueError(f"start_positions must have one entry per sequence ({batch}), got "
                         f"{start_positions.shape[0]}")
    if not torch.compiler.is_compiling():
        _check_sequences(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)


def _check_scalars(tensor_format, start_positions, cu_seqlens, cp_size, cp_rank) -> None:
    if tensor_format not in TENSOR_FORMATS:
        raise ValueError(f"tensor_format must be one of {tuple(TENSOR_FORMATS)}, got {tensor_format!r}")
    if tensor_format == "thd" and cu_seqlens is None:
        raise ValueError("cu_seqlens must not be None when tensor_format is 'thd'")
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, cp_size={cp_size}), got {cp_rank!r}")
    if start_positions is not None and cp_size > 1:
        raise ValueError("start_positions is supported with cp_size=1 only (TransformerEngine's inference path)")


def rope(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd",
         start_positions: Optional[torch.Tensor] = None, interleaved: bool = False,
         cu_seqlens: Optional[torch.Tensor] = None, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """RoPE of t (sbhd, bshd or thd) with angles freqs [s2, 1 or b, 1, d2]; differentiable in t.

    Any floating freqs is converted to float32, int64 start_positions / cu_seqlens to int32.
    cu_seqlens is read only for thd.
    """
    _check_scalars(tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    check_dtype(t, "t")
    check_tensor(freqs, "freqs")
    if not freqs.is_floating_point():
        raise TypeError(f"freqs must be a floating tensor of angles, got {freqs.dtype}")
    if freqs.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError("a gradient for freqs: te_fuser's RoPE differentiates t only, as "
                                  "TransformerEngine's fused RoPE (detach freqs)")
    if tensor_format != "thd":
        cu_seqlens = None
    for name, v in (("start_positions", start_positions), ("cu_seqlens", cu_seqlens)):
        if v is not None:
            _check_index_tensor(v, name, t)
    freqs = freqs.to(torch.float32).contiguous()
    start_positions = None if start_positions is None else start_positions.to(torch.int32).contiguous()
    cu_seqlens = None if cu_seqlens is None else cu_seqlens.to(torch.int32).contiguous()

    def check():
        _check(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)

    return call_checked(check, _ops.rope_forward, t, freqs, start_positions, cu_seqlens,
                        TENSOR_FORMATS[tensor_format], bool(interleaved), cp_size, cp_rank)


def _setup_context(ctx, inputs, output) -> None:
    _, freqs, start_positions, cu_seqlens, tensor_format, interleaved, cp_size, cp_rank = inputs
    ctx.save_for_backward(freqs, start_positions, cu_seqlens)
    ctx.args = (tensor_format, interleaved, cp_size, cp_rank)


def _backward(ctx, grad):
    freqs, start_positions, cu_seqlens = ctx.saved_tensors
    dx = _ops.rope_backward(grad, freqs, start_positions, cu_seqlens, *ctx.args)
    return dx, None, None, None, None, None, None, None


torch.library.register_autograd("te_fuser::rope_forward", _backward, setup_context=_setup_context)


def _fake(x, freqs, start_positions, cu_seqlens, tensor_format, interleaved, cp_size, cp_rank):
    check_one_device_in_fake(x=x, freqs=freqs, start_positions=start_positions, cu_seqlens=cu_seqlens)
    if x.dtype not in FLOAT_DTYPES:
        raise RuntimeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    return x.new_empty(x.shape)


torch.library.register_fake("te_fuser::rope_forward")(_fake)
torch.library.register_fake("te_fuser::rope_backward")(_fake)
