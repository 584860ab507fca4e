/*
 * Attention forward: the entry points, and the vector path's builds with
 * 16-float vectors (its AVX2 build is attention_fwd_avx2.c).
 */
#include "attention_fwd_body.h"

#include "../common/tf_isa_clones.h"
#include "attention_bf16.h"

TF_ATTN_VECTOR_CLONES(fwd_block, TF_ATTN_FWD_BLOCK_PARAMS, TF_ATTN_FWD_BLOCK_ARGS)

tf_status tf_attn_fwd(const tf_attn_problem *p, const tf_attn_operand *q, const tf_attn_operand *k,
                      const tf_attn_operand *v, const tf_attn_operand *out, float *lse,
                      int64_t unit_begin, int64_t unit_end, float *scratch) {
  tf_status st = tf_attn_check(p);
  if (st != TF_OK) return st;
  if ((st = tf_attn_check_operand(p, q, p->seq_q, p->heads_q, 0)) != TF_OK ||
      (st = tf_attn_check_operand(p, k, p->seq_kv, p->heads_kv, 0)) != TF_OK ||
      (st = tf_attn_check_operand(p, v, p->seq_kv, p->heads_kv, 0)) != TF_OK ||
      (st = tf_attn_check_operand(p, out, p->seq_q, p->heads_q, 1)) != TF_OK)
    return st;
  if (!tf_range_ok(unit_begin, unit_end, tf_attn_fwd_units(p))) return TF_ERR_BAD_SIZE;
  if (unit_end > unit_begin && (!lse || !scratch)) return TF_ERR_NULL_POINTER;
  const int64_t tiles = tf_attn_q_tiles(p);
#if TF_ATTN_AMX_BUILT
  if (tf_attn_amx_applies(p, q)) {
    for (int64_t u = unit_begin; u < unit_end; ++u)
      tf_attn_amx_fwd_unit(p, q, k, v, out, lse, u, tiles, scratch);
    return TF_OK;
  }
#endif
  void (*block)TF_ATTN_FWD_BLOCK_PARAMS = fwd_block;
#if TF_ATTN_BF16_BUILT
  if (tf_attn_bf16_applies(p, q, k, v)) block = tf_attn_bf16_fwd_block;
#endif
  for (int64_t u = unit_begin; u < unit_end;) {
    const int64_t count = u + 1 < unit_end && (u + 1) % tiles != 0 ? 2 : 1;
    block(p, q, k, v, out, lse, u, count, tiles, scratch);
    u += count;
  }
  return TF_OK;
}

/*
 * delta of the rows of units [unit_begin, unit_end), built per x86-64 level: each row's sum is
 * TF_ISA_LANES lane-wise partial sums in double, added in order, so every build gives the same bits
 * (as one chain of dependent scalar adds this pass took 7% of the bf16 backward at [8, 256, 8, 64]).
 */
TF_ISA_INLINE void rowdot_body(const tf_attn_problem *p, const tf_attn_operand *dout,
                               const tf_attn_operand *out, float *delta, int64_t unit_begin,
                               int64_t unit_end) {
  const int64_t H = p->heads_q, D = p->head_dim;
  const int64_t tiles = tf_attn_q_tiles(p);
  typedef float vf __attribute__((vector_size(4 * TF_ISA_LANES)));
  typedef double vd __attribute__((vector_size(8 * TF_ISA_LANES)));
  float a[TF_ISA_LANES], b[TF_ISA_LANES];
  /* Every head of a row, then the next row: in the [s, b, h, d] and [b, s, h, d] layouts a row's heads
   * are one run of memory, while one head's rows lie a sequence stride apart, which the hardware
   * prefetchers did not follow (this pass took a sixth of the 16-bit backward). */
  for (int64_t u = unit_begin; u < unit_end; ++u) {
    const int64_t seg = u / tiles, r0 = u % tiles * BQ;
    const tf_attn_segment qs = tf_attn_q_segment(p, seg);
    for (int64_t i = r0; i < min64(r0 + BQ, qs.span); ++i) {
      const int64_t row = qs.start + i;
      for (int64_t h = 0; h < H; ++h) {
        vd acc = {0.0};
        if (i < qs.valid) {
          const int64_t od = tf_attn_row_offset(dout, qs.batch, row, h);
          const int64_t oo = tf_attn_row_offset(out, qs.batch, row, h);
          for (int64_t d0 = 0; d0 < D; d0 += TF_ISA_LANES) {
            const int64_t n = min64(TF_ISA_LANES, D - d0);
            tf_attn_load_row(dout, od + d0, n, 1.0f, a);
            tf_attn_load_row(out, oo + d0, n, 1.0f, b);
            for (int64_t d = n; d < TF_ISA_LANES; ++d) a[d] = b[d] = 0.0f;
            vf va, vb;
            memcpy(&va, a, sizeof va);
            memcpy(&vb, b, sizeof vb);
            acc += __builtin_convertvector(va, vd) * __builtin_convertvector(vb, vd);
          }
        }
        double sum = 0.0;
        for (int d = 0; d < TF_ISA_LANES; ++d) sum += acc[d];
        delta[tf_attn_stat_index(p, qs.batch, h, row)] = (float)sum;
      }
    }
  }
}

#define ROWDOT_PARAMS                                                                          \
  (const tf_attn_problem *p, const tf_attn_operand *dout, const tf_attn_operand *out,         \
   float *delta, int64_t unit_begin, int64_t unit_end)
TF_ISA_CLONES(rowdot, ROWDOT_PARAMS, (p, dout, out, delta, unit_begin, unit_end))

tf_status tf_attn_bwd_rowdot(const tf_attn_problem *p, const tf_attn_operand *dout,
                             const tf_attn_operand *out, float *delta, int64_t unit_begin,
                             int64_t unit_end) {
  tf_status st = tf_attn_check(p);
  if (st != TF_OK) return st;
  if ((st = tf_attn_check_operand(p, dout, p->seq_q, p->heads_q, 0)) != TF_OK ||
      (st = tf_attn_check_operand(p, out, p->seq_q, p->heads_q, 0)) != TF_OK)
    return st;
  if (!tf_range_ok(unit_begin, unit_end, tf_attn_rowdot_units(p))) return TF_ERR_BAD_SIZE;
  if (unit_end > unit_begin && !delta) return TF_ERR_NULL_POINTER;
  rowdot(p, dout, out, delta, unit_begin, unit_end);
  return TF_OK;
}
