/*
 * Fused attention on CUDA (tensor-core FlashAttention-2 style kernels).
 *
 * Launchers take raw device pointers, sizes and element strides and enqueue
 * on `stream` (a cudaStream_t passed as void * so this header needs no CUDA
 * headers). Every size is checked; offsets are computed in int64 on the device.
 *
 * Layout: q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D], the last dim contiguous,
 * the other three with arbitrary non-negative strides (in elements). Packed
 * (thd) problems pass cu_seqlens [N+1] with B == 1 on the tensors and
 * `num_seqs` = N; the token dim then holds all packed tokens. seqlens [N]
 * (optional) are the valid lengths of each sequence (padding; with cu_seqlens
 * they cut each packed segment short). Sequence bounds are clamped into the
 * tensors on the device. Causal masking is top-left aligned: query i sees
 * keys j <= i, positions counted inside the sequence.
 *
 * Supported head dims: TF_ATTN_CUDA_HEAD_DIMS. Inputs bf16/fp16, or
 * float8_e4m3fn with per-tensor descales: the forward uses the FP8
 * tensor cores (wgmma) where the device runs the sm_90a binary (see
 * tf_attention_cuda_fp8_mma_available); elsewhere, and in the backward, FP8
 * tiles are decoded to `dtype` for the 16-bit MMA. Dropout drops exactly the
 * elements the CPU kernels drop (csrc/attention/attention_dropout.h).
 */
#ifndef TF_ATTENTION_CUDA_H
#define TF_ATTENTION_CUDA_H

#include <stdint.h>

#include "../../common/tf_dtype.h"
#include "../../common/tf_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TF_ATTN_CUDA_HEAD_DIMS "32, 64, 96, 128"

/* 1 when the CUDA kernels cover head dim d. */
int tf_attention_cuda_head_dim_supported(int64_t d);

/* 1 when the forward runs FP8 inputs on FP8 tensor cores on the current device. */
int tf_attention_cuda_fp8_mma_available(void);

/* A [B, S, H, D] tensor: element strides of the first three dims. */
typedef struct tf_attn_cuda_tensor {
  const void *data;
  int64_t stride_batch, stride_token, stride_head;
} tf_attn_cuda_tensor;

/* The same for a tensor the kernel writes. */
typedef struct tf_attn_cuda_out_tensor {
  void *data;
  int64_t stride_batch, stride_token, stride_head;
} tf_attn_cuda_out_tensor;

typedef struct tf_attn_cuda_problem {
  int64_t batch;     /* B; 1 when packed */
  int64_t num_seqs;  /* sequences: B, or N when packed */
  int64_t seqlen_q;  /* Sq (padded length, or total packed query tokens) */
  int64_t seqlen_kv; /* Skv */
  int64_t heads_q, heads_kv, head_dim;
  const int32_t *cu_seqlens_q, *cu_seqlens_kv; /* device, [N+1], both or neither */
  const int32_t *seqlens_q, *seqlens_kv;       /* device, [num_seqs] or NULL */
  float softmax_scale;
  int causal;
  float dropout_p; /* probability of dropping an attention weight, [0, 1) */
  uint64_t seed, offset;
  tf_dtype dtype;     /* MMA type, bf16 or fp16: q/k/v's dtype, or what FP8 converts to */
  tf_dtype out_dtype; /* out, dout and the gradients: dtype, or any float dtype with FP8 */
  int fp8_inputs;     /* q, k, v are float8_e4m3fn */
  const float *q_descale, *k_descale, *v_descale; /* device, one float each; FP8 only */
} tf_attn_cuda_problem;

/*
 * out (out_dtype, [B, Sq, Hq, D]) and lse (float32, [B, Hq, Sq] dense, or
 * [Hq, Sq] when packed). Rows past a sequence's valid length get out 0 and
 * lse -inf (the CPU kernels' convention); so do rows that see no key. When
 * packed, tokens outside every
 * sequence are not written: the caller zero-fills out and sets lse to -inf.
 */
tf_status tf_attention_fwd_cuda(const tf_attn_cuda_problem *p, tf_attn_cuda_tensor q,
                                tf_attn_cuda_tensor k, tf_attn_cuda_tensor v,
                                tf_attn_cuda_out_tensor out, float *lse, void *stream);

/*
 * Gradients with respect to q, k, v (for FP8 inputs: with respect to the
 * dequantized q*q_descale, ...), in out_dtype (dout and out have it too). `dq_accum` is float32 scratch
 * laid out [B, Sq, Hq, D] contiguous and `delta` float32 scratch shaped like
 * lse; both are overwritten. Rows past valid lengths get zero gradients; when
 * packed, tokens outside every sequence of dk/dv are not written (the caller
 * zero-fills them), dq is written for every token.
 */
tf_status tf_attention_bwd_cuda(const tf_attn_cuda_problem *p, tf_attn_cuda_tensor dout,
                                tf_attn_cuda_tensor q, tf_attn_cuda_tensor k,
                                tf_attn_cuda_tensor v, tf_attn_cuda_tensor out,
                                const float *lse, tf_attn_cuda_out_tensor dq,
                                tf_attn_cuda_out_tensor dk, tf_attn_cuda_out_tensor dv,
                                float *dq_accum, float *delta, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* TF_ATTENTION_CUDA_H */
