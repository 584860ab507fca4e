/*
 * The attention backward's vector path with bf16 products (attention_bf16.h):
 * the unit bodies of attention_bwd_body.h built with TF_ATTN_BF16_DOT for
 * x86-64-v4 plus AVX512-BF16.
 */
#include "attention_bf16.h"

#include "attention_internal.h"

#if TF_ATTN_BF16_BUILT
/* Every function of the body is built for the target (its helpers call the bf16 intrinsics). */
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4,avx512bf16")
#define TF_ATTN_BF16_DOT 1
#include "attention_bwd_body.h"

void tf_attn_bf16_bwd_unit TF_ATTN_BWD_UNIT_PARAMS { bwd_unit_body TF_ATTN_BWD_UNIT_ARGS; }
void tf_attn_bf16_dkdv_unit TF_ATTN_DKDV_UNIT_PARAMS { dkdv_unit_body TF_ATTN_DKDV_UNIT_ARGS; }
void tf_attn_bf16_dq_unit TF_ATTN_DQ_UNIT_PARAMS { dq_unit_body TF_ATTN_DQ_UNIT_ARGS; }
#pragma GCC pop_options
#endif

int64_t tf_attn_bf16_bwd_scratch_floats(const tf_attn_problem *p) {
  if (!TF_ATTN_BF16_BUILT) return 0;
  /*
   * In floats: kt, vt, kp (bf16) and dK^T, dV^T of TF_ATTN_BF16_BWD_KEY_TILES key
   * tiles; q, dout, q^T, dout^T (bf16) and dQ rows; P, dS (float32) and
   * P, dS pairs and dS rows (bf16); lse and delta.
   */
  const int64_t dp = tf_attn_padded_dim(p), bq = TF_ATTN_BLOCK_Q, bk = TF_ATTN_BLOCK_K;
  const int64_t kt = TF_ATTN_BF16_BWD_KEY_TILES;
  return kt * bk * dp * 3 / 2 + kt * bk * dp * 2 + bq * dp * 2 + bq * dp + bq * bk * 2 +
         bq * bk * 3 / 2 + 2 * bq;
}
