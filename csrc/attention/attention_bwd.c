/*
 * Attention backward: the entry points, and the vector path's builds with
 * 16-float vectors (its AVX2 build is attention_bwd_avx2.c).
 */
#include "attention_bwd_body.h"

#include "attention_bf16.h"

TF_ATTN_VECTOR_CLONES(bwd_unit, TF_ATTN_BWD_UNIT_PARAMS, TF_ATTN_BWD_UNIT_ARGS)
TF_ATTN_VECTOR_CLONES(dkdv_unit, TF_ATTN_DKDV_UNIT_PARAMS, TF_ATTN_DKDV_UNIT_ARGS)
TF_ATTN_VECTOR_CLONES(dq_unit, TF_ATTN_DQ_UNIT_PARAMS, TF_ATTN_DQ_UNIT_ARGS)

/*
 * Whether the units take the bf16 products' build (attention_bf16.h): where
 * it applies and the AMX path, which the other builds lead to, does not.
 */
static int bf16_units(const tf_attn_problem *p, const tf_attn_operand *dout,
                      const tf_attn_operand *q, const tf_attn_operand *k,
                      const tf_attn_operand *v) {
#if TF_ATTN_BF16_BUILT
  return !amx_backward(p, q, dout) && tf_attn_bf16_bwd_applies(p, q, k, v, dout);
#else
  (void)p, (void)dout, (void)q, (void)k, (void)v;
  return 0;
#endif
}

/* The operand checks every backward entry point shares. */
static tf_status check_bwd_inputs(const tf_attn_problem *p, const tf_attn_operand *dout,
                                  const tf_attn_operand *q, const tf_attn_operand *k,
                                  const tf_attn_operand *v) {
  tf_status st = tf_attn_check(p);
  if (st != TF_OK) return st;
  if ((st = tf_attn_check_operand(p, dout, p->seq_q, p->heads_q, 0)) != TF_OK ||
      (st = tf_attn_check_operand(p, q, p->seq_q, p->heads_q, 0)) != TF_OK ||
      (st = tf_attn_check_operand(p, k, p->seq_kv, p->heads_kv, 0)) != TF_OK ||
      (st = tf_attn_check_operand(p, v, p->seq_kv, p->heads_kv, 0)) != TF_OK)
    return st;
  return TF_OK;
}

int64_t tf_attn_bwd_dkdv_units(const tf_attn_problem *p) {
  return tf_attn_num_segments(p) * p->heads_kv * ((tf_attn_max_kv_span(p) + BK - 1) / BK);
}

tf_status tf_attn_bwd_dkdv(const tf_attn_problem *p, const tf_attn_operand *dout,
                           const tf_attn_operand *q, const tf_attn_operand *k,
                           const tf_attn_operand *v, const float *lse, const float *delta,
                           const tf_attn_operand *dk, const tf_attn_operand *dv,
                           int64_t unit_begin, int64_t unit_end, float *scratch) {
  tf_status st = check_bwd_inputs(p, dout, q, k, v);
  if (st != TF_OK) return st;
  if ((st = tf_attn_check_operand(p, dk, p->seq_kv, p->heads_kv, 1)) != TF_OK ||
      (st = tf_attn_check_operand(p, dv, p->seq_kv, p->heads_kv, 1)) != TF_OK)
    return st;
  if (!tf_range_ok(unit_begin, unit_end, tf_attn_bwd_dkdv_units(p))) return TF_ERR_BAD_SIZE;
  if (unit_end > unit_begin && (!lse || !delta || !scratch)) return TF_ERR_NULL_POINTER;
  const int64_t tiles = (tf_attn_max_kv_span(p) + BK - 1) / BK;
  void (*unit)TF_ATTN_DKDV_UNIT_PARAMS = dkdv_unit;
#if TF_ATTN_BF16_BUILT
  if (bf16_units(p, dout, q, k, v)) unit = tf_attn_bf16_dkdv_unit;
#endif
  for (int64_t u = unit_begin; u < unit_end; ++u)
    unit(p, dout, q, k, v, lse, delta, dk, dv, u, tiles, scratch);
  return TF_OK;
}

tf_status tf_attn_bwd_dq(const tf_attn_problem *p, const tf_attn_operand *dout,
                         const tf_attn_operand *q, const tf_attn_operand *k,
                         const tf_attn_operand *v, const float *lse, const float *delta,
                         const tf_attn_operand *dq, int64_t unit_begin, int64_t unit_end,
                         float *scratch) {
  tf_status st = check_bwd_inputs(p, dout, q, k, v);
  if (st != TF_OK) return st;
  if ((st = tf_attn_check_operand(p, dq, p->seq_q, p->heads_q, 1)) != TF_OK) return st;
  if (!tf_range_ok(unit_begin, unit_end, tf_attn_fwd_units(p))) return TF_ERR_BAD_SIZE;
  if (unit_end > unit_begin && (!lse || !delta || !scratch)) return TF_ERR_NULL_POINTER;
  const int64_t tiles = tf_attn_q_tiles(p);
  void (*unit)TF_ATTN_DQ_UNIT_PARAMS = dq_unit;
#if TF_ATTN_BF16_BUILT
  if (bf16_units(p, dout, q, k, v)) unit = tf_attn_bf16_dq_unit;
#endif
  for (int64_t u = unit_begin; u < unit_end; ++u)
    unit(p, dout, q, k, v, lse, delta, dq, u, tiles, scratch);
  return TF_OK;
}

tf_status tf_attn_bwd(const tf_attn_problem *p, const tf_attn_operand *dout,
                      const tf_attn_operand *q, const tf_attn_operand *k, const tf_attn_operand *v,
                      const float *lse, const float *delta, const tf_attn_operand *dq_accum,
                      const tf_attn_operand *dq, const tf_attn_operand *dk,
                      const tf_attn_operand *dv, int64_t unit_begin, int64_t unit_end,
                      float *scratch) {
  const int64_t sq = p->seq_q, skv = p->seq_kv, hq = p->heads_q, hkv = p->heads_kv;
  tf_status st = check_bwd_inputs(p, dout, q, k, v);
  if (st != TF_OK) return st;
  if ((st = tf_attn_check_operand(p, dq_accum, sq, hq, 1)) != TF_OK ||
      (st = tf_attn_check_operand(p, dq, sq, hq, 1)) != TF_OK ||
      (st = tf_attn_check_operand(p, dk, skv, hkv, 1)) != TF_OK ||
      (st = tf_attn_check_operand(p, dv, skv, hkv, 1)) != TF_OK)
    return st;
  if (dq_accum->elem != TF_ATTN_F32) return TF_ERR_BAD_DTYPE;
  if (dq_accum->data == dq->data &&
      (dq->elem != TF_ATTN_F32 || dq->stride_b != dq_accum->stride_b ||
       dq->stride_s != dq_accum->stride_s || dq->stride_h != dq_accum->stride_h))
    return TF_ERR_BAD_ARGUMENT;
  if (!tf_range_ok(unit_begin, unit_end, tf_attn_bwd_units(p))) return TF_ERR_BAD_SIZE;
  if (unit_end > unit_begin && (!lse || !delta || !scratch)) return TF_ERR_NULL_POINTER;
  void (*unit)TF_ATTN_BWD_UNIT_PARAMS = bwd_unit;
#if TF_ATTN_BF16_BUILT
  if (bf16_units(p, dout, q, k, v)) unit = tf_attn_bf16_bwd_unit;
#endif
  for (int64_t u = unit_begin; u < unit_end; ++u)
    unit(p, dout, q, k, v, lse, delta, dq_accum, dq, dk, dv, u, scratch);
  return TF_OK;
}
