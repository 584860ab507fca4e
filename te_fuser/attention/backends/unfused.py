"""Attention in torch's own ops (te_fuser.kernels.attention_math), TE's unfused attention: any device and
dtype, with te_fuser's semantics, but the float32 [batch, heads, seq_q, seq_kv] scores are materialized, so
its memory grows with the square of the sequence length. Chosen where no fused kernel covers a problem."""

import torch

from ...kernels import attention_math
from ...kernels.attention import FP8_INPUT_DTYPES, empty_in_order_of
from .base import NO_DESCALES, Backend, refuse_unless


class Unfused(Backend):
    name = "unfused"
    te_switch = "NVTE_UNFUSED_ATTN"

    def supports(self, problem):
        return refuse_unless(
            (problem.device in ("cpu", "cuda"), f"needs values, not {problem.device} tensors"),
            (problem.dropout == "none", "it has no dropout"))

    def forward(self, q, k, v, lengths, call, descales=NO_DESCALES, out_dtype=None):
        out, lse = attention_math.attention_fwd(q, k, v, *lengths, call.softmax_scale, call.causal, descales)
        dtype = out_dtype or (torch.float32 if q.dtype in FP8_INPUT_DTYPES else q.dtype)
        return empty_in_order_of(q, dtype).copy_(out), lse, ()

    def backward(self, dout, q, k, v, out, lse, state, lengths, call, descales=NO_DESCALES):
        grads = attention_math.attention_bwd(dout, q, k, v, out, lse, *lengths, call.softmax_scale, call.causal,
                                             descales)
        return tuple(empty_in_order_of(like, dout.dtype).copy_(g) for g, like in zip(grads, (q, k, v)))
