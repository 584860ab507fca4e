/*
 * The attention forward's vector path with bf16 products (attention_bf16.h):
 * attention_fwd_body.h built with TF_ATTN_BF16_DOT for x86-64-v4 plus
 * AVX512-BF16, and which problems take it.
 */
#include "attention_bf16.h"

#include "../common/cpu_features.h"
#include "attention_internal.h"

#if TF_ATTN_BF16_BUILT
/*
 * Every function of the body is built for the target (its helpers call the
 * bf16 intrinsics), and is called only from tf_attn_bf16_fwd_block.
 */
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4,avx512bf16")
#define TF_ATTN_BF16_DOT 1
#include "attention_fwd_body.h"

void tf_attn_bf16_fwd_block TF_ATTN_FWD_BLOCK_PARAMS { fwd_block_body TF_ATTN_FWD_BLOCK_ARGS; }
#pragma GCC pop_options
#endif

static int bf16_operand(const tf_attn_operand *x) {
  return x->elem == TF_ATTN_BF16 || x->elem == TF_ATTN_E4M3;
}

int tf_attn_bf16_applies(const tf_attn_problem *p, const tf_attn_operand *q,
                         const tf_attn_operand *k, const tf_attn_operand *v) {
  if (!TF_ATTN_BF16_BUILT || !bf16_operand(q) || !bf16_operand(k) || !bf16_operand(v)) return 0;
  return p->dropout_p == 0.0f && tf_cpu_isa() >= TF_ISA_AVX512_BF16;
}

int tf_attn_bf16_bwd_applies(const tf_attn_problem *p, const tf_attn_operand *q,
                             const tf_attn_operand *k, const tf_attn_operand *v,
                             const tf_attn_operand *dout) {
  return dout->elem == TF_ATTN_BF16 && tf_attn_bf16_applies(p, q, k, v);
}

int64_t tf_attn_bf16_fwd_scratch_floats(const tf_attn_problem *p) {
  if (!TF_ATTN_BF16_BUILT) return 0;
  /* As the float32 tiles (tf_attn_fwd_scratch_floats) with q^T, k and v in bf16, and P^T in bf16 pairs. */
  const int64_t dp = tf_attn_padded_dim(p), rows = TF_ATTN_FWD_ROWS, ld = TF_ATTN_FWD_LD;
  const int64_t bk = TF_ATTN_BLOCK_K;
  return dp * ld / 2 + rows * dp + bk * dp + bk * ld + bk * ld / 2 + 3 * rows;
}
