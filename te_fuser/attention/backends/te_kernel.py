"""te_fuser's own attention kernels: C on the CPU (every ISA tier), CUDA C on the GPU."""

from ... import _extension
from ...kernels import attention as attn_kernels
from ...kernels.attention_math import CUDA_HEAD_DIMS, CUDA_KERNEL_DTYPES
from .base import NO_DESCALES, Backend, refuse_unless


class TeFuserKernels(Backend):
    """torch.ops.te_fuser.attention_fwd / attention_bwd. Every mask, layout, GQA, dropout (te_fuser's
    Philox, from a given seed) and FP8 q/k/v; on CUDA, 16-bit and E4M3 inputs with the head dims its
    kernels are built for."""

    name = "te_fuser"
    te_switch = "NVTE_FUSED_ATTN"  # fused kernels: TE's FusedAttention on both devices

    def supports(self, problem):
        if problem.device != "cuda":
            return refuse_unless((problem.device in ("cpu", "meta"), f"no kernels for {problem.device} tensors"))
        return refuse_unless(
            (_extension.has_cuda_kernels(), "te_fuser was built without its CUDA kernels"),
            (problem.dtype in CUDA_KERNEL_DTYPES,
             f"its CUDA kernels take bfloat16, float16 and float8_e4m3fn q/k/v, not {problem.dtype}"),
            (problem.head_dim in CUDA_HEAD_DIMS,
             f"its CUDA kernels take head dims {CUDA_HEAD_DIMS}, not {problem.head_dim}"))

    def forward(self, q, k, v, lengths, call, descales=NO_DESCALES, out_dtype=None):
        out, lse = attn_kernels.attention_fwd(
            q, k, v, cu_seqlens_q=lengths.cu_seqlens_q, cu_seqlens_kv=lengths.cu_seqlens_kv,
            seqlens_q=lengths.seqlens_q, seqlens_kv=lengths.seqlens_kv, softmax_scale=call.softmax_scale,
            causal=call.causal, dropout_p=call.dropout_p, seed=call.seed, offset=call.offset, q_descale=descales[0],
            k_descale=descales[1], v_descale=descales[2], out_dtype=out_dtype)
        return out, lse, ()

    def backward(self, dout, q, k, v, out, lse, state, lengths, call, descales=NO_DESCALES):
        return attn_kernels.attention_bwd(
            dout, q, k, v, out, lse, cu_seqlens_q=lengths.cu_seqlens_q, cu_seqlens_kv=lengths.cu_seqlens_kv,
            seqlens_q=lengths.seqlens_q, seqlens_kv=lengths.seqlens_kv, softmax_scale=call.softmax_scale,
            causal=call.causal, dropout_p=call.dropout_p, seed=call.seed, offset=call.offset, q_descale=descales[0],
            k_descale=descales[1], v_descale=descales[2])
