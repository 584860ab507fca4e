"""FlashAttention as torch ships it (FA2 in torch's CUDA build): aten::_scaled_dot_product_flash_attention for
dense batches and aten::_flash_attention_forward with cum_seq_q / cum_seq_k for packed (thd) ones, with
their backwards.

Its causal mask is aligned to the bottom right when a sequence has fewer queries than keys; te_fuser's
(TE's `causal`) to the top left, so causal problems go here only when every sequence is square. Its dropout
draws from torch's CUDA generator at call time (DotProductAttention calls it inside its RNG tracker's
fork); the RNG state it returns is saved for the backward. It cannot draw the mask of a given seed.
Padded batches (seqlens) are not expressible in these calls: rows past a sequence's length would attend.
"""

import torch

from ...kernels.attention import in_order_of
from .base import NO_DESCALES, Backend, refuse_unless
from .problem import Call
from .schema import schema_problem

_aten = torch.ops.aten

DENSE_SCHEMAS = {
    "_scaled_dot_product_flash_attention":
        "aten::_scaled_dot_product_flash_attention(Tensor query, Tensor key, Tensor value, float dropout_p=0., "
        "bool is_causal=False, bool return_debug_mask=False, *, float? scale=None) -> (Tensor output, "
        "Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, Tensor rng_state, "
        "Tensor unused, Tensor debug_attn_mask)",
    "_scaled_dot_product_flash_attention_backward":
        "aten::_scaled_dot_product_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, "
        "Tensor value, Tensor out, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, "
        "SymInt max_k, float dropout_p, bool is_causal, Tensor philox_seed, Tensor philox_offset, *, "
        "float? scale=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)",
}
PACKED_SCHEMAS = {
    # torch after 2.11 added block_table and num_splits, which _forward_packed does not pass: both forms take its call
    "_flash_attention_forward": tuple(
        "aten::_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, "
        "Tensor? cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, bool return_debug_mask, "
        "*, float? scale=None, SymInt? window_size_left=None, SymInt? window_size_right=None, "
        f"Tensor? seqused_k=None, Tensor? alibi_slopes=None{added}) "
        "-> (Tensor output, Tensor softmax_logsumexp, Tensor rng_state, Tensor unused, Tensor debug_attn_mask)"
        for added in (", Tensor? block_table=None, int? num_splits=None", "")),
    "_flash_attention_backward":
        "aten::_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
        "Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, "
        "bool is_causal, Tensor rng_state, Tensor unused, *, float? scale=None, SymInt? window_size_left=None, "
        "SymInt? window_size_right=None) -> (Tensor, Tensor, Tensor)",
}

_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256


def flash_built() -> bool:
    """Whether torch was built with FlashAttention."""
    return torch.backends.cuda.is_flash_attention_available()


def _on_hardware(problem):
    """(ok, reason) of the CUDA device and torch build; meta tensors (shapes only) pass."""
    if problem.device == "meta":
        return True, ""
    if problem.device != "cuda":
        return False, f"a CUDA kernel, not for {problem.device} tensors"
    return refuse_unless(
        (flash_built(), f"torch {torch.__version__} was built without it"),
        (problem.capability >= (8, 0), f"it needs compute capability 8.0 or newer, not {problem.capability}"))


class FlashAttention(Backend):
    name = "flash"
    te_switch = "NVTE_FLASH_ATTN"

    def supports(self, problem):
        ok, reason = refuse_unless(
            _on_hardware(problem),
            sixteen_bit_inputs(problem),
            (problem.head_dim % 8 == 0 and problem.head_dim <= MAX_HEAD_DIM,
             f"head dim {problem.head_dim}: it takes multiples of 8 up to {MAX_HEAD_DIM}"),
            (problem.layout != "padded", "padded batches (seqlens): use thd, or te_fuser's kernels"),
            (square_when_causal(problem), "causal with sequences of fewer queries than keys: its causal mask is "
                                          "aligned to the bottom right, te_fuser's to the top left"),
            (problem.dropout != "seeded", "dropout from a given seed: it draws from torch's CUDA generator"),
            (problem.positive_scale, "a softmax scale <= 0"),
            (not problem.empty, "an empty problem"))
        if not ok:
            return ok, reason
        schema = schema_problem(PACKED_SCHEMAS if problem.layout == "packed" else DENSE_SCHEMAS)
        return schema is None, schema or ""

    def complete(self, call, q, k, lengths):
        if lengths.cu_seqlens_q is None or (call.max_seqlen_q is not None and call.max_seqlen_kv is not None):
            return call
        return call._replace(max_seqlen_q=call.max_seqlen_q or longest(lengths.cu_seqlens_q, q.shape[1]),
                             max_seqlen_kv=call.max_seqlen_kv or longest(lengths.cu_seqlens_kv, k.shape[1]))

    def forward(self, q, k, v, lengths, call, descales=NO_DESCALES, out_dtype=None):
        if lengths.cu_seqlens_q is not None:
            return self._forward_packed(q, k, v, lengths, call)
        out, lse, _, _, _, _, rng_state, unused, _ = _aten._scaled_dot_product_flash_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), call.dropout_p, call.causal, False,
            scale=call.softmax_scale)
        return in_order_of(out.transpose(1, 2), q), lse, (rng_state, unused)

    def backward(self, dout, q, k, v, out, lse, state, lengths, call, descales=NO_DESCALES):
        if lengths.cu_seqlens_q is not None:
            return self._backward_packed(dout, q, k, v, out, lse, state, lengths, call)
        rng_state, unused = state
        grads = _aten._scaled_dot_product_flash_attention_backward(
            *(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse, None, None, q.shape[1], k.shape[1],
            call.dropout_p, call.causal, rng_state, unused, scale=call.softmax_scale)
        return tuple(g.transpose(1, 2) for g in grads)

    @staticmethod
    def _forward_packed(q, k, v, lengths, call: Call):
        cu_q, cu_kv = lengths.cu_seqlens_q, lengths.cu_seqlens_kv
        out, lse, rng_state, unused, _ = _aten._flash_attention_forward(
            q[0], k[0], v[0], cu_q, cu_kv, call.max_seqlen_q, call.max_seqlen_kv, call.dropout_p, call.causal,
            False, scale=call.softmax_scale)
        # Tokens past the last sequence belong to none: output 0 and lse -inf, as te_fuser's kernels give them
        # (the kernel leaves those rows unwritten).
        outside = past_last_sequence(cu_q, q.shape[1])
        out = out.masked_fill_(outside[:, None, None], 0.0)
        lse = lse.masked_fill_(outside[None, :], float("-inf"))
        return out[None], lse, (rng_state, unused)

    @staticmethod
    def _backward_packed(dout, q, k, v, out, lse, state, lengths, call: Call):
        cu_q, cu_kv = lengths.cu_seqlens_q, lengths.cu_seqlens_kv
        rng_state, unused = state
        dq, dk, dv = _aten._flash_attention_backward(
            dout[0], q[0], k[0], v[0], out[0], lse, cu_q, cu_kv, call.max_seqlen_q, call.max_seqlen_kv,
            call.dropout_p, call.causal, rng_state, unused, scale=call.softmax_scale)
        outside_q, outside_kv = past_last_sequence(cu_q, q.shape[1]), past_last_sequence(cu_kv, k.shape[1])
        return (dq.masked_fill_(outside_q[:, None, None], 0.0)[None],
                dk.masked_fill_(outside_kv[:, None, None], 0.0)[None],
                dv.masked_fill_(outside_kv[:, None, None], 0.0)[None])


def sixteen_bit_inputs(problem):
    """The (condition, reason) of the library kernels that take bf16 and fp16 q/k/v only."""
    return (problem.dtype in _DTYPES, f"it takes bfloat16 and float16 q/k/v, not {problem.dtype}"
            + (" (FP8 attention runs on te_fuser's FP8 kernels)" if problem.dtype.itemsize == 1 else ""))


def square_when_causal(problem) -> bool:
    return not problem.causal or problem.square


def past_last_sequence(cu_seqlens, tokens):
    """[tokens] bool: the tokens at or past cu_seqlens[-1] (no device sync)."""
    return torch.arange(tokens, device=cu_seqlens.device) >= cu_seqlens[-1]


def longest(cu_seqlens, tokens) -> int:
    """The longest sequence of cu_seqlens (TE's max_seqlen, read from the device as TE does when it is not
    given); the tensor's token count bounds it on meta tensors and under torch.compile."""
    if cu_seqlens.device.type == "meta" or torch.compiler.is_compiling():
        return int(tokens)
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item()) if cu_seqlens.numel() > 1 else 0
