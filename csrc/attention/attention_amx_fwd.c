/*
 * Attention forward on AMX tiles (bf16 and E4M3 q/k/v; see attention_amx.h).
 * One unit is one (sequence, query head, query tile), as in attention_fwd.c,
 * with the same outputs and the same online softmax in the log2 domain:
 *
 *   S = Q K^T   tile product of the raw bf16 values, float32 accumulation,
 *               then scaled in float32 by softmax_scale log2(e) (and the q
 *               and k descales of E4M3 inputs);
 *   P = 2^(S - m) in float32; its row sums (the softmax denominator) are
 *               summed in float32, and P is rounded to bf16 for
 *   O += P V    tile product, float32 accumulation; O is divided by the
 *               float32 sum (times v's descale) at the end.
 *
 * Scores are laid out query-major (rows = queries, 16 per tile), so each
 * query's max and sum are reductions along one row.
 */
#pragma GCC optimize("fp-contract=fast", "no-tree-loop-distribute-patterns")

#include <math.h>

#include "attention_amx.h"

#if TF_ATTN_AMX_BUILT

#include "attention_amx_pack.h"
#include "attention_amx_gemm.h"

#define BQ TF_ATTN_BLOCK_Q
#define BK TF_ATTN_BLOCK_K
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Head dim of q and k rounded to whole A tiles, and of v and o to whole 16-float columns. */
static int64_t qk_width(const tf_attn_problem *p) { return tf_attn_amx_dim(p->head_dim); }
static int64_t vo_width(const tf_attn_problem *p) { return (p->head_dim + 15) / 16 * 16; }

typedef struct amx_fwd_scratch {
  uint16_t *q, *kt, *v, *p;
  float *o, *s, *m, *l;
} amx_fwd_scratch;

/* q: BQ x wq bf16; kt: K^T pairs [wq/2][BK][2]; v: V pairs [BK/2][wv][2]; p: 16 x BK bf16. */
static amx_fwd_scratch split_scratch(float *base, int64_t wq, int64_t wv) {
  amx_fwd_scratch t;
  t.o = base;
  t.s = t.o + BQ * wv;
  t.m = t.s + 16 * BK;
  t.l = t.m + BQ;
  t.q = (uint16_t *)(t.l + BQ);
  t.kt = t.q + BQ * wq;
  t.v = t.kt + wq * BK;
  t.p = t.v + BK * wv;
  return t;
}

int64_t tf_attn_amx_fwd_scratch_floats(const tf_attn_problem *p) {
  const int64_t wq = qk_width(p), wv = vo_width(p);
  return BQ * wv + 16 * BK + 2 * BQ + (BQ * wq + wq * BK + BK * wv + 16 * BK) / 2;
}

TF_ATTN_INLINE float hmax(tf_vf x) {
  float r = x[0];
  for (int i = 1; i < 16; ++i) r = x[i] > r ? x[i] : r;
  return r;
}

TF_ATTN_INLINE float hsum(tf_vf x) {
  float r = 0.0f;
  for (int i = 0; i < 16; ++i) r += x[i];
  return r;
}

/*
 * Online softmax of one query row over the score columns [0, 16 blocks):
 * columns past `limit` are hidden. Updates m and l, writes 2^(s - m) in bf16
 * to pb[0, 32 steps) (zero past the blocks) and scales the row of o by the
 * change of its max.
 */
TF_ATTN_INLINE void softmax_row(float *s, int64_t limit, int64_t blocks, int64_t steps, float scale,
                                float *m, float *l, uint16_t *pb, float *o, int64_t wv) {
  tf_vfi lane;
  for (int i = 0; i < 16; ++i) lane[i] = i;
  tf_vf mx = tf_vf_splat(-__builtin_inff());
  for (int64_t c = 0; c < blocks; ++c) {
    const tf_vf x = tf_vf_select(lane < (int32_t)(limit - 16 * c), tf_vf_load(s + 16 * c) * scale,
                                   tf_vf_splat(-__builtin_inff()));
    tf_vf_store(s + 16 * c, x);
    mx = tf_vf_max(mx, x);
  }
  const float m_old = *m, m_new = fmaxf(m_old, hmax(mx));
  /* A row that sees no key yet keeps m = -inf; subtracting 0 instead gives it p = 0. */
  const float m_use = m_new == -INFINITY ? 0.0f : m_new;
  tf_vf sum = tf_vf_splat(0.0f);
  for (int64_t c = 0; c < blocks; ++c) {
    const tf_vf e = tf_vf_exp2(tf_vf_load(s + 16 * c) - m_use);
    sum += e;
    const tf_v16h h = tf_amx_to_bf16(e);
    memcpy(pb + 16 * c, &h, sizeof h);
  }
  for (int64_t j = 16 * blocks; j < steps * TF_ATTN_AMX_K; ++j) pb[j] = 0;
  const float alpha = tf_vf_exp2(tf_vf_splat(m_old - m_use))[0];
  *l = *l * alpha + hsum(sum);
  *m = m_new;
  if (alpha != 1.0f)
    for (int64_t n = 0; n < wv; n += 16) tf_vf_store(o + n, tf_vf_load(o + n) * alpha);
}

TF_ATTN_AMX_TARGET
void tf_attn_amx_fwd_unit(const tf_attn_problem *p, const tf_attn_operand *q,
                          const tf_attn_operand *k, const tf_attn_operand *v,
                          const tf_attn_operand *out, float *lse, int64_t unit, int64_t tiles,
                          float *scratch) {
  const int64_t H = p->heads_q, D = p->head_dim, wq = qk_width(p), wv = vo_width(p);
  const int64_t seg = unit / (H * tiles), h = unit / tiles % H, r0 = unit % tiles * BQ;
  const tf_attn_segment qs = tf_attn_q_segment(p, seg), ks = tf_attn_kv_segment(p, seg);
  if (r0 >= qs.span) return;
  int64_t kv_end;
  const int64_t rows = tf_attn_fwd_live_rows(p, out, lse, qs, ks, h, r0, min64(BQ, qs.span - r0), &kv_end);
  if (rows == 0) return;

  const amx_fwd_scratch t = split_scratch(scratch, wq, wv);
  const int64_t nq = (rows + 15) / 16 * 16, hk = h / (H / p->heads_kv);
  const int fp8 = q->elem == TF_ATTN_E4M3;
  const float scale = p->softmax_scale * LOG2E * (fp8 ? q->descale * k->descale : 1.0f);
  for (int64_t i = 0; i < nq; ++i) {
    if (i < rows)
      tf_amx_pack_row(q, tf_attn_row_offset(q, qs.batch, qs.start + r0 + i, h), D, wq, t.q + i * wq);
    else
      memset(t.q + i * wq, 0, (size_t)wq * sizeof(uint16_t));
    t.m[i] = -INFINITY;
    t.l[i] = 0.0f;
  }
  memset(t.o, 0, (size_t)(nq * wv) * sizeof(float));

  AMX_CONFIGURE();
  for (int64_t k0 = 0; k0 < kv_end; k0 += BK) {
    const int64_t nk = min64(BK, kv_end - k0);
    tf_amx_pack_transposed(k, tf_attn_row_offset(k, ks.batch, ks.start + k0, hk), k->stride_s, nk,
                           BK, D, wq, t.kt);
    tf_amx_pack_pairs(v, tf_attn_row_offset(v, ks.batch, ks.start + k0, hk), v->stride_s, nk, BK,
                      D, wv, t.v);
    for (int64_t i0 = 0; i0 < nq; i0 += 16) {
      /* Keys [0, seen) of the tile are visible to some row of these 16; the rest are skipped. */
      const int64_t seen = p->causal ? min64(nk, r0 + i0 + 16 - k0) : nk;
      if (seen <= 0) continue;
      const int64_t blocks = (seen + 15) / 16, steps = (blocks * 16 + TF_ATTN_AMX_K - 1) / TF_ATTN_AMX_K;
      tf_amx_times_transposed(t.s, BK, t.q + i0 * wq, wq, t.kt, BK, wq, blocks);
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t r = i0 + i;
        const int64_t limit = r >= rows ? 0 : p->causal ? min64(nk, r0 + r - k0 + 1) : nk;
        softmax_row(t.s + i * BK, limit, blocks, steps, scale, t.m + r, t.l + r, t.p + i * BK,
                    t.o + r * wv, wv);
      }
      tf_amx_times_pairs(t.o + i0 * wv, wv, t.p, BK, t.v, wv, steps);
    }
  }
  AMX_RELEASE();

  const float vscale = fp8 ? v->descale : 1.0f;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t row = qs.start + r0 + i;
    tf_attn_store_row(out, tf_attn_row_offset(out, qs.batch, row, h), D, vscale / t.l[i],
                      t.o + i * wv);
    lse[tf_attn_stat_index(p, qs.batch, h, row)] = (t.m[i] + log2f(t.l[i])) * LN2;
  }
}

#endif /* TF_ATTN_AMX_BUILT */
