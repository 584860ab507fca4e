"""The autograd Function of attention, whichever backend runs it.

Every backend (te_fuser's kernels, cuDNN, FlashAttention, torch's CPU flash kernel, the unfused math
path: te_fuser/attention/backends) runs inside this one Function. Its ctx keeps tensors only through
save_for_backward: q, k, v, out, lse, the int length tensors and the backend's RNG state (the library
kernels' dropout seed and offset tensors); every other ctx attribute is a Python scalar, a string, a
tuple of them, or an FP8 shell without buffers. After backward, the shells are dropped too, so the graph
node holds nothing (the bug of TransformerEngine issue #1935: FP8 attention kept its tensors on
ctx.tensor_objects and with them 20 GB alive).

Under fp8_dpa, q, k, v and out are all saved in FP8 E4M3 (one byte per element
plus a scale), never in 16 bits: q, k, v are the FP8 tensors the forward kernel
consumed (the backward kernel decodes them the same way). out is quantized once:
with the O quantizer when the caller asked for an FP8 output (fp8_output /
fp8_mha) -- the Function then returns those very bytes, so the output projection
that saves its FP8 input keeps no second copy -- else with current scaling (its
amax is known once the kernel has run). The backward needs out only for
D = rowsum(dout * out); it dequantizes it for the kernel call and frees it
right after. FP8 q, k, v run on te_fuser's FP8 kernels only: the selection never gives them to a 16-bit
library kernel, and naming one for them is refused.
"""

from typing import Optional, Sequence

import torch

from ..ops._fp8_io import high_precision
from ..tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Tensor, fp8_data
from ..tensor.quantized_tensor import prepare_for_saving, restore_from_saved
from .backends import BACKENDS, Call, Lengths, choose, describe


def to_kernel_layout(t: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """A [batch, seq, heads, head_dim] view of a tensor in qkv_format (no copy)."""
    if qkv_format == "bshd":
        return t
    if qkv_format == "sbhd":
        return t.permute(1, 0, 2, 3)
    return t.unsqueeze(0)  # thd: one packed batch entry


def from_kernel_layout(t: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """Inverse of to_kernel_layout."""
    if qkv_format == "bshd":
        return t
    if qkv_format == "sbhd":
        return t.permute(1, 0, 2, 3)
    return t.squeeze(0)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def fp8_input(t: torch.Tensor, quantizer) -> Float8Tensor:
    """t for the FP8 kernels: quantized, or, when it already is a Float8Tensor in the quantizer's
    format (fp8_mha: a view of the QKV projection's FP8 output), its bytes and scale as they are,
    in a new wrapper (prepare_for_saving empties the wrapper, never the caller's tensor)."""
    if isinstance(t, Float8Tensor) and t.fp8_dtype == quantizer.fp8_dtype:
        return t.rewrapped()
    return quantizer(t.dequantize() if isinstance(t, Float8Tensor) else t)


def _fp8_parts(t: Float8Tensor, qkv_format: str):
    return to_kernel_layout(fp8_data(t), qkv_format), t._scale_inv


def quantize_saved_output(out: torch.Tensor) -> Float8Tensor:
    """The FP8 E4M3 copy of the attention output that the backward keeps (current scaling)."""
    return Float8CurrentScalingQuantizer(torch.float8_e4m3fn, device=out.device, columnwise=False)(out)


def choose_backend(q, k, qkv_format: str, lengths: Lengths, softmax_scale: float, causal: bool, dropout: str,
                   fp8: bool, backend: Optional[str] = None) -> str:
    """The name of the backend that runs this problem (q, k in qkv_format; dropout one of
    backends.problem.DROPOUT_KINDS); backend names one explicitly."""
    problem = describe(q, k, lengths, causal, dropout, softmax_scale, torch.float8_e4m3fn if fp8 else None,
                       qkv_format)
    return choose(problem, backend).backend


def attention_forward(q, k, v, qkv_format: str, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv,
                      softmax_scale: float, causal: bool, dropout_p: float, seed: Optional[int], offset: Optional[int],
                      backend: Optional[str] = None, max_seqlens=None, quantizers: Optional[Sequence] = None,
                      output_quantizer=None, for_backward: bool = True):
    """(out, tensors to save, Float8Tensor shells or None, backend name, Call): FusedAttentionFunction's
    forward, and the whole of it under torch.no_grad (for_backward=False: nothing is kept, the FP8 output is
    not quantized again for saving).

    backend is the name of the backend to run (as choose_backend gives it); None chooses one, with dropout
    from (seed, offset). max_seqlens is TE's (max_seqlen_q, max_seqlen_kv) of packed inputs, when known.
    """
    lengths = Lengths(cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv)
    if backend is None or quantizers is not None:  # FP8 q/k/v: a named backend must take them (ValueError)
        backend = choose_backend(q, k, qkv_format, lengths, softmax_scale, causal,
                                 "seeded" if dropout_p > 0.0 else "none", quantizers is not None, backend)
    impl = BACKENDS[backend]
    max_q, max_kv = max_seqlens or (None, None)
    call = Call(float(softmax_scale), bool(causal), float(dropout_p), int(seed or 0), int(offset or 0), max_q, max_kv)
    if quantizers is None:
        # q, k, v and out are saved as the kernel-layout views the backward kernel reads.
        qk, kk, vk = to_kernel_layout(q, qkv_format), to_kernel_layout(k, qkv_format), to_kernel_layout(v, qkv_format)
        call = impl.complete(call, qk, kk, lengths)
        out_k, lse, state = impl.forward(qk, kk, vk, lengths, call)
        return from_kernel_layout(out_k, qkv_format), (qk, kk, vk, out_k, lse, *lengths, *state), None, backend, call
    q8, k8, v8 = (fp8_input(t, quantizer) for quantizer, t in zip(quantizers, (q, k, v)))
    (qd, qs), (kd, ks), (vd, vs) = (_fp8_parts(t, qkv_format) for t in (q8, k8, v8))
    call = impl.complete(call, qd, kd, lengths)
    out, lse, state = impl.forward(qd, kd, vd, lengths, call, descales=(qs, ks, vs), out_dtype=q.dtype)
    out = from_kernel_layout(out, qkv_format)
    if output_quantizer is not None:
        out = output_quantizer(out.contiguous())
    if not for_backward:
        return out, (), None, backend, call
    out_saved = quantize_saved_output(out) if output_quantizer is None else out.rewrapped()
    saved, objects = prepare_for_saving(q8, k8, v8, out_saved, lse, *lengths, *state)
    return out, saved, objects, backend, call


class FusedAttentionFunction(torch.autograd.Function):
    """out = attention(q, k, v) in qkv_format on one backend (see attention_forward), with FP8 inputs when
    quantizers are given, and out returned as a Float8Tensor when output_quantizer is given too."""

    @staticmethod
    def forward(ctx, q, k, v, qkv_format: str, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv,
                softmax_scale: float, causal: bool, dropout_p: float, seed: Optional[int], offset: Optional[int],
                backend: Optional[str] = None, max_seqlens=None, quantizers: Optional[Sequence] = None,
                output_quantizer=None):
        out, saved, objects, backend, call = attention_forward(
            q, k, v, qkv_format, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv, softmax_scale, causal,
            dropout_p, seed, offset, backend, max_seqlens, quantizers, output_quantizer)
        ctx.save_for_backward(*saved)
        # FP8: the Float8Tensor shells (prepare_for_saving handed their buffers to save_for_backward).
        ctx.tensor_objects = objects
        ctx.fp8 = quantizers is not None
        ctx.qkv_format = qkv_format
        ctx.backend = backend
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, dout):
        fmt = ctx.qkv_format
        descales = (None, None, None)
        # Under torch.compile this runs at trace time (dynamo may trace it more than once) on trace-time
        # objects: the graph's autograd node is AOTAutograd's, so there is nothing to check or clear.
        compiling = torch.compiler.is_compiling()
        if ctx.fp8 and ctx.tensor_objects is None and not compiling:
            raise RuntimeError("FP8 attention (fp8_dpa) frees its saved FP8 tensors in its first backward: a "
                               "second backward through the same graph (retain_graph=True) is not supported")
        if ctx.tensor_objects is None:  # saved in the kernel layout
            q, k, v, out, lse, *rest = ctx.saved_tensors
        else:
            q, k, v, out, lse, *rest = restore_from_saved(ctx.tensor_objects, ctx.saved_tensors)
            (qd, qs), (kd, ks), (vd, vs) = (_fp8_parts(t, fmt) for t in (q, k, v))
            descales = (qs, ks, vs)
            out8, out = out, to_kernel_layout(out.dequantize(), fmt)  # freed when backward returns
            if not compiling:
                for t in (q, k, v, out8):
                    t.clear()
                # The shells are no longer needed: nothing may outlive backward on ctx.
                ctx.tensor_objects = None
            q, k, v = qd, kd, vd
        lengths, state = Lengths(*rest[:4]), tuple(rest[4:])
        # An FP8 dout (the output projection's fp8_grad) is read as its values.
        dout = _last_dim_contiguous(to_kernel_layout(high_precision(dout), fmt)).to(out.dtype)
        dq, dk, dv = BACKENDS[ctx.backend].backward(dout, q, k, v, out, lse, state, lengths, ctx.call,
                                                    descales=descales)
        grads = tuple(from_kernel_layout(g, fmt) for g in (dq, dk, dv))
        return grads + (None,) * 14
