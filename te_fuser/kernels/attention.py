"""Fused attention kernels: validated Python entry points and fake (meta) kernels.

The kernels are torch.ops.te_fuser.attention_fwd / attention_bwd (C on CPU,
CUDA C on GPU); the schemas and semantics are documented in
csrc/attention/attention.h. Tensors are in the kernel layout: q is
[batch, seq_q, heads_q, head_dim], k and v [batch, seq_kv, heads_kv, head_dim]
with a contiguous last dim (other strides free, so an sbhd tensor permuted to
bshd needs no copy). Packed (thd) inputs have batch 1 and cu_seqlens offsets.
attention_fwd / attention_bwd always run te_fuser's kernels (CUDA problems the CUDA kernels do not cover,
float32 and other head dims, run torch's math, attention_math.py). DotProductAttention chooses among
these kernels and torch's library kernels (cuDNN, FlashAttention, the CPU flash kernel) per problem:
backend_for says which one it would run and why the others were passed over
(te_fuser/attention/backends/selection.py).
"""

import math
from typing import Optional

import torch

from . import attention_math
from .validate import (call_checked, check_dtype, check_one_device_in_fake, check_same_device, check_scalar_f32,
                       check_tensor, FLOAT_DTYPES)

_ops = torch.ops.te_fuser

FP8_INPUT_DTYPES = (torch.float8_e4m3fn,)
_QKV_DTYPES = FLOAT_DTYPES + FP8_INPUT_DTYPES


def _check_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dtype(t, name, _QKV_DTYPES)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, seq, heads, head_dim], got shape {tuple(t.shape)}")
        if t.shape[3] > 1 and t.stride(3) != 1:
            raise ValueError(f"{name} must have a contiguous last (head_dim) dimension, got strides {t.stride()}")
    for name, t in (("k", k), ("v", v)):
        check_same_device(t, name, q, "q")
        if t.dtype != q.dtype:
            raise TypeError(f"q, k and v must share a dtype, got q {q.dtype} and {name} {t.dtype}")
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} has batch size {t.shape[0]} but q has {q.shape[0]}")
        if t.shape[3] != q.shape[3]:
            raise ValueError(f"{name} has head_dim {t.shape[3]} but q has {q.shape[3]}")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"k and v must have the same sequence length and heads, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"q's heads ({q.shape[2]}) must be a multiple of k's heads ({k.shape[2]})")
    if q.shape[3] == 0:
        raise ValueError("head_dim must be positive")


def _check_int32_vector(t, name, numel, like):
    if t is None:
        return
    check_tensor(t, name)
    if t.dtype != torch.int32 or t.dim() != 1:
        raise TypeError(f"{name} must be a 1-D torch.int32 tensor, got dtype {t.dtype} and shape {tuple(t.shape)}")
    if t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements, got {t.numel()}")
    check_same_device(t, name, like, "q")


def _inspectable(t) -> bool:
    """Values can be checked without a device sync or a traced graph."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def _check_lengths(q, k, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv):
    if (cu_seqlens_q is None) != (cu_seqlens_kv is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_kv must be given together")
    if cu_seqlens_q is not None:
        if q.shape[0] != 1:
            raise ValueError(f"packed (cu_seqlens) inputs must have batch size 1, got {q.shape[0]}")
        if seqlens_q is not None or seqlens_kv is not None:
            raise ValueError("seqlens and cu_seqlens cannot be combined")
        check_tensor(cu_seqlens_q, "cu_seqlens_q")
        if cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 1:
            raise ValueError(f"cu_seqlens_q must be 1-D with N + 1 offsets, got shape {tuple(cu_seqlens_q.shape)}")
        n = cu_seqlens_q.numel()
        for name, cu, tokens in (("cu_seqlens_q", cu_seqlens_q, q.shape[1]),
                                 ("cu_seqlens_kv", cu_seqlens_kv, k.shape[1])):
            _check_int32_vector(cu, name, n, q)
            if _inspectable(cu):
                if cu[0].item() != 0 or bool((cu[1:] < cu[:-1]).any()) or cu[-1].item() > tokens:
                    raise ValueError(f"{name} must start at 0, be non-decreasing and end at most at the "
                                     f"{tokens} tokens of the tensor, got {cu.tolist()}")
    for name, lens, seq in (("seqlens_q", seqlens_q, q.shape[1]), ("seqlens_kv", seqlens_kv, k.shape[1])):
        _check_int32_vector(lens, name, q.shape[0], q)
        if lens is not None and _inspectable(lens) and bool(((lens < 0) | (lens > seq)).any()):
            raise ValueError(f"{name} must lie in [0, {seq}], got {lens.tolist()}")


def _check_scalars(softmax_scale, dropout_p):
    # Under torch.compile(dynamic=True) the default scale is symbolic (from the head dim), and finite;
    # the C kernels check the value they are given again.
    if not torch.compiler.is_compiling() and not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p}")


def _check_descales(q, q_descale, k_descale, v_descale):
    fp8 = q.dtype in FP8_INPUT_DTYPES
    for name, d in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if fp8:
            if d is None:
                raise ValueError(f"{name} is required for {q.dtype} inputs")
            check_scalar_f32(d, name, q, "q")
        elif d is not None:
            raise ValueError(f"{name} is only accepted with float8_e4m3fn inputs, got {q.dtype} inputs")
    return fp8


def _check_problem(q, k, v, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv, softmax_scale, dropout_p,
                   q_descale, k_descale, v_descale):
    """The checks attention_fwd and attention_bwd share: (softmax_scale with its default, whether q is FP8)."""
    _check_qkv(q, k, v)
    _check_lengths(q, k, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv)
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    _check_scalars(scale, float(dropout_p))
    return scale, _check_descales(q, q_descale, k_descale, v_descale)


def attention_fwd(q, k, v, *, cu_seqlens_q=None, cu_seqlens_kv=None, seqlens_q=None, seqlens_kv=None,
                  softmax_scale: Optional[float] = None, causal: bool = False, dropout_p: float = 0.0,
                  seed: int = 0, offset: int = 0, q_descale=None, k_descale=None, v_descale=None,
                  out_dtype: Optional[torch.dtype] = None):
    """(out, lse) of softmax(scale q k^T + mask) v. softmax_scale defaults to 1/sqrt(head_dim).

    FP8 inputs (float8_e4m3fn q, k, v) need their descales; out is then in
    out_dtype (default float32). lse is float32 [batch, heads_q, seq_q] or
    [heads_q, tokens] when packed.
    """
    def check():
        scale, fp8 = _check_problem(q, k, v, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv, softmax_scale,
                                    dropout_p, q_descale, k_descale, v_descale)
        if out_dtype is not None:
            if out_dtype not in FLOAT_DTYPES:
                raise ValueError(f"out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype!r}")
            if not fp8 and out_dtype != q.dtype:
                raise ValueError(f"out_dtype must be q's dtype {q.dtype} for non-FP8 inputs, got {out_dtype}")
        return scale, fp8

    scalars = _kernel_scalars(q, softmax_scale, causal, dropout_p, seed, offset)
    # The binding reads an int out_dtype as a ScalarType: only None or a float dtype reaches it unchecked.
    if scalars is not None and (out_dtype is None or out_dtype in FLOAT_DTYPES):
        return call_checked(check, _ops.attention_fwd, q, k, v, cu_seqlens_q, cu_seqlens_kv, seqlens_q,
                            seqlens_kv, *scalars, q_descale, k_descale, v_descale, out_dtype)
    softmax_scale, fp8 = check()
    if attention_math.applies(q):
        attention_math.refuse_dropout(q, dropout_p)
        out, lse = attention_math.attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv,
                                                softmax_scale, bool(causal), (q_descale, k_descale, v_descale))
        # One pass: the conversion to the output dtype happens in the copy into q's dim order.
        return empty_in_order_of(q, out_dtype or (torch.float32 if fp8 else q.dtype)).copy_(out), lse
    return _ops.attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv, softmax_scale,
                              bool(causal), float(dropout_p), int(seed), int(offset), q_descale, k_descale,
                              v_descale, out_dtype)


def _kernel_scalars(q, softmax_scale, causal, dropout_p, seed, offset):
    """The op's (softmax_scale, causal, dropout_p, seed, offset) when the problem goes straight to te_fuser's
    CPU kernel, else None: the checked path.

    The CPU binding checks every argument itself, so that path checks them in Python only after the binding
    refused them (validate.call_checked): on a small problem the Python checks cost more than the kernel.
    It is decided on q alone: a CPU tensor, not under torch.compile. The checked path still takes an empty q
    (attention_bwd answers it without the kernel), a dropout_p outside [0, 1) (the binding rounds a tiny
    negative one to -0.0 and takes it) and any argument these conversions fail on: it raises the error that
    names the first bad argument.
    """
    if torch.compiler.is_compiling() or type(q) is not torch.Tensor or not q.is_cpu or not q.numel():
        return None
    try:
        scalars = (1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale), bool(causal),
                   float(dropout_p), int(seed), int(offset))
    except Exception:  # the checked path raises it, or the error of an argument it checks before
        return None
    return scalars if 0.0 <= scalars[2] < 1.0 else None


def in_order_of(t, like):
    """t ([b, s, h, d]) with dims 0..2 in like's stride order (the kernels' output contract): t itself when it
    already has the strides of such a tensor, else a copy."""
    target = empty_in_order_of(like, t.dtype)
    return t if target.stride() == t.stride() else target.copy_(t)


def fp8_tensor_cores(device) -> bool:
    """Whether attention_fwd runs float8_e4m3fn inputs on FP8 tensor cores on `device`.

    True on GPUs that run the sm_90a kernels (Hopper: wgmma with e4m3
    operands, P quantized to e4m3 for the P V product). Elsewhere FP8 tiles
    are decoded inside the kernels and multiplied in 16 bits (CUDA, and CPUs
    with AMX: bf16 tiles, float32 accumulation) or float32 (other CPUs).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return bool(_ops.attention_fp8_tensor_cores(torch.empty(0, device=device)))


def attention_bwd(dout, q, k, v, out, lse, *, cu_seqlens_q=None, cu_seqlens_kv=None, seqlens_q=None,
                  seqlens_kv=None, softmax_scale: Optional[float] = None, causal: bool = False,
                  dropout_p: float = 0.0, seed: int = 0, offset: int = 0, q_descale=None, k_descale=None,
                  v_descale=None):
    """(dq, dk, dv) for attention_fwd's output gradient dout; same arguments as that forward call.

    The gradients have dout's dtype and the dim order of q, k and v.
    """
    def check():
        scale, fp8 = _check_problem(q, k, v, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv, softmax_scale,
                                    dropout_p, q_descale, k_descale, v_descale)
        for name, t in (("dout", dout), ("out", out)):
            check_dtype(t, name)
            check_same_device(t, name, q, "q")
            if t.shape != q.shape:
                raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
            if t.shape[3] > 1 and t.stride(3) != 1:
                raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
        if out.dtype != dout.dtype:
            raise TypeError(f"out and dout must share a dtype, got {out.dtype} and {dout.dtype}")
        if not fp8 and dout.dtype != q.dtype:
            raise TypeError(f"dout must have q's dtype {q.dtype}, got {dout.dtype}")
        check_dtype(lse, "lse", (torch.float32,))
        check_same_device(lse, "lse", q, "q")
        expected = _lse_shape(q, cu_seqlens_q)
        if tuple(lse.shape) != expected or not lse.is_contiguous():
            raise ValueError(f"lse must be a contiguous float32 tensor of shape {expected}, got {tuple(lse.shape)}")
        return scale, fp8

    scalars = _kernel_scalars(q, softmax_scale, causal, dropout_p, seed, offset)
    if scalars is not None:
        return call_checked(check, _ops.attention_bwd, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv,
                            seqlens_q, seqlens_kv, *scalars, q_descale, k_descale, v_descale)
    softmax_scale, _ = check()
    if q.numel() == 0:  # no query: nothing reaches k or v
        return (empty_in_order_of(q, dout.dtype), empty_in_order_of(k, dout.dtype).zero_(),
                empty_in_order_of(v, dout.dtype).zero_())
    if attention_math.applies(q):
        attention_math.refuse_dropout(q, dropout_p)
        grads = attention_math.attention_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv, seqlens_q,
                                             seqlens_kv, softmax_scale, bool(causal), (q_descale, k_descale, v_descale))
        return tuple(empty_in_order_of(like, dout.dtype).copy_(g) for g, like in zip(grads, (q, k, v)))
    return _ops.attention_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv,
                              softmax_scale, bool(causal), float(dropout_p), int(seed), int(offset),
                              q_descale, k_descale, v_descale)


def backend_for(q, k, v=None, *, cu_seqlens_q=None, cu_seqlens_kv=None, seqlens_q=None, seqlens_kv=None,
                softmax_scale: Optional[float] = None, causal: bool = False, dropout_p: float = 0.0,
                seeded_dropout: bool = False, backend: Optional[str] = None):
    """Which attention backend DotProductAttention would run for these kernel-layout tensors (arguments as
    attention_fwd's), and why each other backend was passed over: a Choice, whose str() explains it.

    dropout_p > 0 is dropout drawn from torch's generator at call time, as DotProductAttention draws it;
    seeded_dropout=True is dropout from a given (seed, offset) (attention_fwd's, which only te_fuser's kernels
    can draw). backend names one backend as a module's attention_backend does. The environment
    (TE_FUSER_ATTENTION_BACKEND, NVTE_FLASH_ATTN, NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN) counts as it is now.
    Raises what the call would raise when no backend (or not the one named) can run the problem.
    """
    from ..attention.backends import Lengths, choose, describe

    _check_qkv(q, k, k if v is None else v)
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    dropout = "none" if dropout_p == 0.0 else ("seeded" if seeded_dropout else "generator")
    lengths = Lengths(cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv)
    return choose(describe(q, k, lengths, causal, dropout, scale), backend)


def _lse_shape(q, cu_seqlens_q):
    b, s, h, _ = q.shape
    return (h, s) if cu_seqlens_q is not None else (b, h, s)


def empty_in_order_of(like, dtype):
    """An empty tensor of like's shape with dims 0..2 in the order of like's strides, as the kernels allocate."""
    order = sorted(range(3), key=lambda d: -like.stride(d))  # stable: ties keep their dim order
    t = like.new_empty([like.shape[o] for o in order] + [like.shape[3]], dtype=dtype)
    return t.permute([order.index(d) for d in range(3)] + [3])


@torch.library.register_fake("te_fuser::attention_fwd")
def _(q, k, v, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv, softmax_scale, causal, dropout_p, seed,
      offset, q_descale, k_descale, v_descale, out_dtype):
    check_one_device_in_fake(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                             seqlens_q=seqlens_q, seqlens_kv=seqlens_kv, q_descale=q_descale,
                             k_descale=k_descale, v_descale=v_descale)
    dtype = (out_dtype or torch.float32) if q.dtype in FP8_INPUT_DTYPES else q.dtype
    return empty_in_order_of(q, dtype), q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)


@torch.library.register_fake("te_fuser::attention_bwd")
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv, softmax_scale, causal,
      dropout_p, seed, offset, q_descale, k_descale, v_descale):
    check_one_device_in_fake(q=q, k=k, v=v, dout=dout, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q,
                             cu_seqlens_kv=cu_seqlens_kv, seqlens_q=seqlens_q, seqlens_kv=seqlens_kv,
                             q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    return (empty_in_order_of(q, dout.dtype), empty_in_order_of(k, dout.dtype),
            empty_in_order_of(v, dout.dtype))
