/*
 * Fused (flash-style) scaled dot-product attention on the CPU.
 *
 * Op schemas served by this core (csrc/binding/attention_ops.cpp; the CUDA
 * binding implements the same ones):
 *   attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_kv,
 *       Tensor? seqlens_q, Tensor? seqlens_kv, float softmax_scale, bool causal, float dropout_p,
 *       int seed, int offset, Tensor? q_descale, Tensor? k_descale, Tensor? v_descale,
 *       ScalarType? out_dtype) -> (Tensor out, Tensor lse)
 *   attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
 *       Tensor? cu_seqlens_q, Tensor? cu_seqlens_kv, Tensor? seqlens_q, Tensor? seqlens_kv,
 *       float softmax_scale, bool causal, float dropout_p, int seed, int offset,
 *       Tensor? q_descale, Tensor? k_descale, Tensor? v_descale) -> (Tensor dq, Tensor dk, Tensor dv)
 *
 * Layout: q is [B, Sq, Hq, D], k and v [B, Skv, Hkv, D] with the last dim
 * contiguous and any other strides. Batched: each batch entry is one sequence,
 * optionally padded (valid lengths seqlens_q/kv[B]; NULL = full). Packed (thd):
 * B == 1 and dim 1 holds the tokens of N sequences at offsets cu_seqlens[N + 1]
 * (cu_seqlens[0] == 0, non-decreasing, cu_seqlens[N] <= tokens); tokens past
 * cu_seqlens[N] belong to no sequence.
 *
 * Semantics per sequence (query i, key j, positions inside the sequence):
 * scores s_ij = softmax_scale * q_i . k_j; with causal, query i sees keys
 * j <= i (top-left aligned, as torch SDPA is_causal); keys past the valid kv
 * length are masked. Query rows past their valid length, and rows that see no
 * key, get output 0, lse -inf and zero gradients. lse is the natural-log
 * logsumexp of the visible scores, float32, [B, Hq, Sq] batched or [Hq, Tq] packed.
 * Dropout (p in [0, 1)) drops probability elements by attention_dropout.h.
 * GQA/MQA: query head h uses kv head h / (Hq / Hkv).
 *
 * Outputs of the ops: out, dq, dk, dv have the shapes of q, q, k, v with dims
 * 0..2 laid out in the order of the matching input's strides (an sbhd view in,
 * an sbhd-dense tensor out; te_fuser/kernels/attention.py's fake kernels say the
 * same). out has q's dtype, or out_dtype (default float32) for float8_e4m3fn
 * inputs, which need the three one-element float32 descales; the gradients
 * have dout's dtype.
 *
 * Work is split into independent units so the caller can spread them over
 * threads without races:
 *   forward and the backward row-dot pre-pass: one unit per (sequence, query head, query tile);
 *   backward: one unit per (sequence, kv head); it owns dK/dV of that kv head
 *   and dQ of the query heads sharing it, and walks key tiles outer, query tiles inner
 *   (or, with few such units, the two-pass split declared at the end).
 * Every unit needs a private float scratch of tf_attn_*_scratch_floats(), of
 * tile size; the backward also takes a float32 dQ accumulator of dq's size,
 * so memory stays O(sequence length).
 */
#ifndef TF_ATTENTION_H
#define TF_ATTENTION_H

#include <stdint.h>

#include "../common/tf_dtype.h"
#include "../common/tf_status.h"

/* Query rows and keys per tile. */
#define TF_ATTN_BLOCK_Q 128
#define TF_ATTN_BLOCK_K 64
/* Largest head dim accepted (any size up to it; 256 and below are the usual ones). */
#define TF_ATTN_MAX_HEAD_DIM 65536

/* Element type of an operand; E4M3 bytes are dequantized with the operand's descale. */
typedef enum tf_attn_elem {
  TF_ATTN_F32 = 0,
  TF_ATTN_BF16 = 1,
  TF_ATTN_F16 = 2,
  TF_ATTN_E4M3 = 3
} tf_attn_elem;

/* A [B, S, H, D] operand: element strides of dims 0..2; dim 3 is contiguous. */
typedef struct tf_attn_operand {
  void *data;
  tf_attn_elem elem;
  int64_t stride_b, stride_s, stride_h;
  float descale; /* multiplies every decoded E4M3 element; ignored otherwise */
} tf_attn_operand;

typedef struct tf_attn_problem {
  int64_t batch, seq_q, seq_kv, heads_q, heads_kv, head_dim;
  /* Packed layout: both non-NULL with num_seqs + 1 entries, batch == 1. */
  const int32_t *cu_seqlens_q, *cu_seqlens_kv;
  int64_t num_seqs;
  /* Batched padding: [batch] valid lengths, each may be NULL (= full length). */
  const int32_t *seqlens_q, *seqlens_kv;
  float softmax_scale;
  int causal;
  float dropout_p;
  uint64_t seed, offset;
} tf_attn_problem;

/*
 * Checks the sizes, the sequence lengths (cu_seqlens monotone and inside the
 * tensor, seqlens in [0, S]) and the scalars. The entry points call it, and
 * also check every operand's strides so that no index can overflow int64.
 */
tf_status tf_attn_check(const tf_attn_problem *p);

/* Units of the forward pass. */
int64_t tf_attn_fwd_units(const tf_attn_problem *p);
/* Units of the backward row-dot pre-pass: (sequence, query tile), every head. */
int64_t tf_attn_rowdot_units(const tf_attn_problem *p);
/* Units of the backward pass. */
int64_t tf_attn_bwd_units(const tf_attn_problem *p);
/* Float scratch one unit needs. */
int64_t tf_attn_fwd_scratch_floats(const tf_attn_problem *p);
int64_t tf_attn_bwd_scratch_floats(const tf_attn_problem *p);

/*
 * Forward for units [unit_begin, unit_end): out (elem F32/BF16/F16, q's shape)
 * and lse (float32, contiguous, shape above).
 */
tf_status tf_attn_fwd(const tf_attn_problem *p, const tf_attn_operand *q, const tf_attn_operand *k,
                      const tf_attn_operand *v, const tf_attn_operand *out, float *lse,
                      int64_t unit_begin, int64_t unit_end, float *scratch);

/* Backward pre-pass for row-dot units [unit_begin, unit_end): delta = rowsum(dout * out), lse-shaped. */
tf_status tf_attn_bwd_rowdot(const tf_attn_problem *p, const tf_attn_operand *dout,
                             const tf_attn_operand *out, float *delta, int64_t unit_begin,
                             int64_t unit_end);

/*
 * Backward for units [unit_begin, unit_end): dq, dk, dv (F32/BF16/F16, shapes of
 * q, k, v). dq_accum is a float32 [B, Sq, Hq, D] buffer the units accumulate dQ
 * in; it may be dq itself when dq is float32.
 */
tf_status tf_attn_bwd(const tf_attn_problem *p, const tf_attn_operand *dout,
                      const tf_attn_operand *q, const tf_attn_operand *k, const tf_attn_operand *v,
                      const float *lse, const float *delta, const tf_attn_operand *dq_accum,
                      const tf_attn_operand *dq, const tf_attn_operand *dk,
                      const tf_attn_operand *dv, int64_t unit_begin, int64_t unit_end,
                      float *scratch);

/*
 * The backward in two passes, for when there are fewer (sequence, kv head)
 * units than threads: dK and dV per (sequence, kv head, key tile) unit, then
 * dQ per forward unit (sequence, query head, query tile), which recomputes the
 * scores once more but needs no dQ accumulator. Both after tf_attn_bwd_rowdot.
 */
int64_t tf_attn_bwd_dkdv_units(const tf_attn_problem *p);
tf_status tf_attn_bwd_dkdv(const tf_attn_problem *p, const tf_attn_operand *dout,
                           const tf_attn_operand *q, const tf_attn_operand *k,
                           const tf_attn_operand *v, const float *lse, const float *delta,
                           const tf_attn_operand *dk, const tf_attn_operand *dv,
                           int64_t unit_begin, int64_t unit_end, float *scratch);
tf_status tf_attn_bwd_dq(const tf_attn_problem *p, const tf_attn_operand *dout,
                         const tf_attn_operand *q, const tf_attn_operand *k,
                         const tf_attn_operand *v, const float *lse, const float *delta,
                         const tf_attn_operand *dq, int64_t unit_begin, int64_t unit_end,
                         float *scratch);

#endif /* TF_ATTENTION_H */
