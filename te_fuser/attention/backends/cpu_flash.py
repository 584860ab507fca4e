"""torch's flash-attention kernel for the CPU (aten::_scaled_dot_product_flash_attention_for_cpu, SDPA's CPU
path; oneDNN/AMX for 16-bit on CPUs that have it).

Same math as te_fuser's kernels: float32 scores, softmax and sums, one rounding of the output, a top-left
causal mask, lse the natural-log log-sum-exp [b, h, s]. It takes dense batches only (no seqlens, no
cu_seqlens) and no dropout; its causal path gives NaN for a softmax scale <= 0 (it scales the -inf it masks
with), so such problems are not sent to it.
"""

import torch

from ...kernels.attention import in_order_of
from .base import NO_DESCALES, Backend, refuse_unless
from .schema import schema_problem

_aten = torch.ops.aten

EXPECTED_SCHEMAS = {
    "_scaled_dot_product_flash_attention_for_cpu":
        "aten::_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, Tensor value, "
        "float dropout_p=0., bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) "
        "-> (Tensor output, Tensor logsumexp)",
    "_scaled_dot_product_flash_attention_for_cpu_backward":
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward(Tensor grad_out, Tensor query, Tensor key, "
        "Tensor value, Tensor out, Tensor logsumexp, float dropout_p, bool is_causal, *, Tensor? attn_mask=None, "
        "float? scale=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)",
}

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TorchCpuFlash(Backend):
    name = "cpu_flash"
    te_switch = "NVTE_FLASH_ATTN"

    def supports(self, problem):
        ok, reason = refuse_unless(
            (problem.device == "cpu", f"a CPU kernel, not for {problem.device} tensors"),
            (problem.dtype in _DTYPES, f"it takes float32, bfloat16 and float16 q/k/v, not {problem.dtype} "
                                       "(FP8 attention runs on te_fuser's FP8 kernels)"),
            (problem.layout == "dense", f"it takes dense batches only, not {problem.layout} sequences"),
            (problem.dropout == "none", "it has no dropout"),
            (problem.positive_scale or not problem.causal, "its causal mask gives NaN with a softmax scale <= 0"),
            (not problem.empty, "an empty problem"))
        if not ok:
            return ok, reason
        problem_with_schema = schema_problem(EXPECTED_SCHEMAS)
        return problem_with_schema is None, problem_with_schema or ""

    def forward(self, q, k, v, lengths, call, descales=NO_DESCALES, out_dtype=None):
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, call.causal, scale=call.softmax_scale)
        return in_order_of(out.transpose(1, 2), q), lse.contiguous(), ()

    def backward(self, dout, q, k, v, out, lse, state, lengths, call, descales=NO_DESCALES):
        operands = [t.transpose(1, 2) for t in (dout, q, k, v, out)]
        if q.dtype != torch.float32:
            # torch's 16-bit backward ran 4.5x faster on dense [b, h, s, d] operands than on gpt.py's q, k, v
            # (views of one QKV projection), on AVX2 ([8, 256, 8, 64], bf16); float32 showed no difference.
            operands = [t.contiguous() for t in operands]
        grads = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *operands, lse, 0.0, call.causal, scale=call.softmax_scale)
        return tuple(g.transpose(1, 2) for g in grads)
