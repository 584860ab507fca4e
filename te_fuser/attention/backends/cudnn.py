"""cuDNN's fused attention as torch ships it: aten::_scaled_dot_product_cudnn_attention and its backward.

Dense batches only (torch's entry point takes no sequence lengths), 16-bit q/k/v, head dims that are
multiples of 8 up to 128 (256 on Hopper with cuDNN 9.10 or newer), GQA/MQA, compute capability 8.0 to 12.1
and cuDNN 9 or newer, as torch's own SDPA dispatch requires. Its lse is [b, h, s, 1]: the forward returns
the [b, h, s] view, the backward reads [b, h, s, 1] again. Not chosen for dropout (torch refuses cuDNN's
dropout on cuDNN 9.11 to 9.13 and limits it to multiples of 1/16), under deterministic algorithms (its
backward is not deterministic), for causal problems with fewer queries than keys (the mask alignment was
never checked against te_fuser's top-left one) nor for a single key.
"""

import torch

from ...kernels.attention import in_order_of
from .base import NO_DESCALES, Backend, refuse_unless
from .flash import sixteen_bit_inputs, square_when_causal
from .schema import schema_problem

_aten = torch.ops.aten

EXPECTED_SCHEMAS = {
    "_scaled_dot_product_cudnn_attention":
        "aten::_scaled_dot_product_cudnn_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, "
        "bool compute_log_sumexp, float dropout_p=0., bool is_causal=False, bool return_debug_mask=False, *, "
        "float? scale=None) -> (Tensor output, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, "
        "SymInt max_q, SymInt max_k, Tensor philox_seed, Tensor philox_offset, Tensor debug_attn_mask)",
    "_scaled_dot_product_cudnn_attention_backward":
        "aten::_scaled_dot_product_cudnn_attention_backward(Tensor grad_out, Tensor query, Tensor key, "
        "Tensor value, Tensor out, Tensor logsumexp, Tensor philox_seed, Tensor philox_offset, Tensor attn_bias, "
        "Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, *, "
        "float? scale=None) -> (Tensor, Tensor, Tensor)",
}


def cudnn_version():
    """The cuDNN version torch runs (91000 for 9.10), or None without cuDNN."""
    return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None


def _max_head_dim(problem) -> int:
    version = cudnn_version() if problem.device == "cuda" else None
    return 256 if problem.capability == (9, 0) and version is not None and version >= 91000 else 128


def _on_hardware(problem):
    if problem.device == "meta":
        return True, ""
    if problem.device != "cuda":
        return False, f"a CUDA kernel, not for {problem.device} tensors"
    version = cudnn_version()
    return refuse_unless(
        (version is not None, f"torch {torch.__version__} has no cuDNN"),
        (version is not None and version >= 90000, f"it needs cuDNN 9 or newer, not {version}"),
        ((8, 0) <= problem.capability <= (12, 1),
         f"torch runs it on compute capability 8.0 to 12.1, not {problem.capability}"))


class CudnnAttention(Backend):
    name = "cudnn"
    te_switch = "NVTE_FUSED_ATTN"

    def supports(self, problem):
        ok, reason = refuse_unless(
            _on_hardware(problem),
            sixteen_bit_inputs(problem),
            (problem.head_dim % 8 == 0 and problem.head_dim <= _max_head_dim(problem),
             f"head dim {problem.head_dim}: it takes multiples of 8 up to {_max_head_dim(problem)} here"),
            (problem.layout == "dense", f"torch's entry point takes dense batches only, not {problem.layout} ones"),
            (square_when_causal(problem), "causal with fewer queries than keys"),
            (problem.dropout == "none", "dropout (cuDNN-version dependent in torch)"),
            (not problem.deterministic, "deterministic algorithms are on and its backward is not deterministic"),
            (not problem.single_key, "a single key (torch does not run cuDNN attention on it)"),
            (problem.positive_scale, "a softmax scale <= 0"),
            (not problem.empty, "an empty problem"))
        if not ok:
            return ok, reason
        schema = schema_problem(EXPECTED_SCHEMAS)
        return schema is None, schema or ""

    def forward(self, q, k, v, lengths, call, descales=NO_DESCALES, out_dtype=None):
        out, lse, _, _, _, _, philox_seed, philox_offset, _ = _aten._scaled_dot_product_cudnn_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, call.causal, False,
            scale=call.softmax_scale)
        return in_order_of(out.transpose(1, 2), q), lse.squeeze(-1), (philox_seed, philox_offset)

    def backward(self, dout, q, k, v, out, lse, state, lengths, call, descales=NO_DESCALES):
        philox_seed, philox_offset = state
        grads = _aten._scaled_dot_product_cudnn_attention_backward(
            *(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse.unsqueeze(-1), philox_seed, philox_offset,
            None, None, None, q.shape[1], k.shape[1], 0.0, call.causal, scale=call.softmax_scale)
        return tuple(g.transpose(1, 2) for g in grads)
