/*
 * Attention forward: one query tile against all visible key tiles with an
 * online softmax, in the log2 domain (q is pre-scaled by softmax_scale *
 * log2(e) so probabilities are 2^(s - m)).
 */
/*
 * ISO C mode turns off a*b+c contraction; the tile kernels rely on FMA. Tile
 * row copies stay inline loops instead of becoming memcpy calls.
 */
#pragma GCC optimize("fp-contract=fast", "no-tree-loop-distribute-patterns")

#include <math.h>

#include "../common/tf_checks.h"
#include "attention_dropout.h"
#include "attention_internal.h"
#include "attention_tile.h"

#define BQ TF_ATTN_BLOCK_Q
#define BK TF_ATTN_BLOCK_K
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
/* Strided k/v rows are prefetched this many rows ahead of their load. */
#define TF_ATTN_PREFETCH_ROWS 8

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

typedef struct fwd_scratch {
  float *q, *o, *kt, *v, *s, *m, *l, *row;
} fwd_scratch;

static fwd_scratch split_scratch(float *base, int64_t dp) {
  fwd_scratch t;
  t.q = base;
  t.o = t.q + BQ * dp;
  t.kt = t.o + BQ * dp;
  t.v = t.kt + dp * BK;
  t.s = t.v + BK * dp;
  t.m = t.s + BQ * BK;
  t.l = t.m + BQ;
  t.row = t.l + BQ;
  return t;
}

/* Loads keys [k0, k0 + nk) of one kv head as k^T (D x BK, zero past nk) and v (nk x dp). */
TF_ATTN_INLINE void load_kv_tile(const tf_attn_operand *k, const tf_attn_operand *v,
                                 tf_attn_segment ks, int64_t hk, int64_t k0, int64_t nk,
                                 int64_t D, int64_t dp, const fwd_scratch *t) {
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t row = ks.start + k0 + j;
    if (j + TF_ATTN_PREFETCH_ROWS < nk) {
      tf_attn_prefetch_row(k, tf_attn_row_offset(k, ks.batch, row + TF_ATTN_PREFETCH_ROWS, hk), D);
      tf_attn_prefetch_row(v, tf_attn_row_offset(v, ks.batch, row + TF_ATTN_PREFETCH_ROWS, hk), D);
    }
    tf_attn_load_row(k, tf_attn_row_offset(k, ks.batch, row, hk), D, 1.0f, t->row);
    for (int64_t d = 0; d < D; ++d) t->kt[d * BK + j] = t->row[d];
    tf_attn_load_row(v, tf_attn_row_offset(v, ks.batch, row, hk), D, 1.0f, t->v + j * dp);
  }
  for (int64_t d = 0; d < D; ++d)
    for (int64_t j = nk; j < BK; ++j) t->kt[d * BK + j] = 0.0f;
}

/*
 * Online softmax of score row s (BK wide, masked entries -inf): updates the
 * running max m and sum l, rescales the output row o, and leaves 2^(s - m) in s.
 */
TF_ATTN_INLINE void softmax_row(float *restrict s, float *restrict o, int64_t dp, float *m,
                                float *l) {
  tf_v16 x[BK / 16];
  tf_v16 mx = tf_v16_splat(-__builtin_inff());
  for (int c = 0; c < BK / 16; ++c) {
    x[c] = tf_v16_load(s + 16 * c);
    mx = tf_v16_max(mx, x[c]);
  }
  const float tile_max = tf_v16_hmax(mx);
  const float m_new = tile_max > *m ? tile_max : *m;
  if (m_new == -__builtin_inff()) { /* nothing visible yet in this row */
    memset(s, 0, BK * sizeof *s);
    return;
  }
  tf_v16 sum = {0};
  for (int c = 0; c < BK / 16; ++c) {
    const tf_v16 e = tf_v16_exp2(x[c] - m_new);
    tf_v16_store(s + 16 * c, e);
    sum += e;
  }
  const float alpha = exp2f(*m - m_new);
  *l = *l * alpha + tf_v16_hsum(sum);
  *m = m_new;
  if (alpha != 1.0f)
    for (int64_t d = 0; d < dp; ++d) o[d] *= alpha;
}

/* Drops probabilities of rows [r0, r0 + rows) x keys [k0, k0 + nk) and scales the kept ones. */
static void dropout_tile(const tf_attn_problem *p, float *s, int64_t rows, int64_t nk,
                         int64_t seg, int64_t h, int64_t r0, int64_t k0) {
  const tf_attn_dropout_key_t key = tf_attn_dropout_key(p->seed, p->offset);
  const uint32_t threshold = tf_attn_dropout_threshold(p->dropout_p);
  const float keep_scale = 1.0f / (1.0f - p->dropout_p);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < nk; ++j) {
      const uint32_t bits = tf_attn_dropout_bits(key, (uint32_t)seg, (uint32_t)h,
                                                 (uint32_t)(r0 + i), (uint32_t)(k0 + j));
      s[i * BK + j] = bits >= threshold ? s[i * BK + j] * keep_scale : 0.0f;
    }
}

TF_ATTN_MULTIVERSION
static void fwd_unit(const tf_attn_problem *p, const tf_attn_operand *q, const tf_attn_operand *k,
                     const tf_attn_operand *v, const tf_attn_operand *out, float *lse,
                     int64_t unit, int64_t tiles, float *scratch) {
  const int64_t H = p->heads_q, D = p->head_dim, dp = tf_attn_padded_dim(p);
  const int64_t seg = unit / (H * tiles), h = unit / tiles % H, r0 = unit % tiles * BQ;
  const tf_attn_segment qs = tf_attn_q_segment(p, seg), ks = tf_attn_kv_segment(p, seg);
  if (r0 >= qs.span) return;
  const int64_t nr = min64(BQ, qs.span - r0);
  const int64_t nv = clamp64(qs.valid - r0, 0, nr);
  const int64_t kv_end = nv == 0 ? 0 : p->causal ? min64(ks.valid, r0 + nv) : ks.valid;
  const int64_t rows = kv_end > 0 ? nv : 0;
  for (int64_t i = rows; i < nr; ++i) { /* padding rows and rows that see no key */
    const int64_t row = qs.start + r0 + i;
    tf_attn_zero_row(out, tf_attn_row_offset(out, qs.batch, row, h), D);
    lse[tf_attn_stat_index(p, qs.batch, h, row)] = -INFINITY;
  }
  if (rows == 0) return;

  const fwd_scratch t = split_scratch(scratch, dp);
  const int64_t mp = (rows + TF_ATTN_GEMM_ROWS - 1) / TF_ATTN_GEMM_ROWS * TF_ATTN_GEMM_ROWS;
  const int64_t hk = h / (H / p->heads_kv);
  memset(t.q, 0, (size_t)(mp * dp) * sizeof(float));
  memset(t.o, 0, (size_t)(mp * dp) * sizeof(float));
  memset(t.v, 0, (size_t)(BK * dp) * sizeof(float));
  for (int64_t i = 0; i < rows; ++i) {
    tf_attn_load_row(q, tf_attn_row_offset(q, qs.batch, qs.start + r0 + i, h), D,
                     p->softmax_scale * LOG2E, t.q + i * dp);
    t.m[i] = -INFINITY;
    t.l[i] = 0.0f;
  }

  for (int64_t k0 = 0; k0 < kv_end; k0 += BK) {
    const int64_t nk = min64(BK, kv_end - k0);
    load_kv_tile(k, v, ks, hk, k0, nk, D, dp, &t);
    tf_attn_gemm(t.s, BK, t.q, dp, 1, t.kt, BK, mp, BK, D, 0);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t limit = p->causal ? min64(nk, r0 + i - k0 + 1) : nk;
      if (limit < BK) tf_attn_mask_tail(t.s + i * BK, limit, BK);
      softmax_row(t.s + i * BK, t.o + i * dp, dp, t.m + i, t.l + i);
    }
    if (p->dropout_p > 0.0f) dropout_tile(p, t.s, rows, nk, seg, h, r0, k0);
    tf_attn_gemm(t.o, dp, t.s, BK, 1, t.v, dp, mp, dp, nk, 1);
  }

  for (int64_t i = 0; i < rows; ++i) {
    const int64_t row = qs.start + r0 + i;
    tf_attn_store_row(out, tf_attn_row_offset(out, qs.batch, row, h), D, 1.0f / t.l[i],
                      t.o + i * dp);
    lse[tf_attn_stat_index(p, qs.batch, h, row)] = (t.m[i] + log2f(t.l[i])) * LN2;
  }
}

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
  const int64_t tiles = (tf_attn_max_q_span(p) + BQ - 1) / BQ;
  for (int64_t u = unit_begin; u < unit_end; ++u) fwd_unit(p, q, k, v, out, lse, u, tiles, scratch);
  return TF_OK;
}

tf_status tf_attn_bwd_rowdot(const tf_attn_problem *p, const tf_attn_operand *dout,
                             const tf_attn_operand *out, float *delta, int64_t unit_begin,
                             int64_t unit_end) {
  tf_status st = tf_attn_check(p);
  if (st != TF_OK) return st;
  if ((st = tf_attn_check_operand(p, dout, p->seq_q, p->heads_q, 0)) != TF_OK ||
      (st = tf_attn_check_operand(p, out, p->seq_q, p->heads_q, 0)) != TF_OK)
    return st;
  if (!tf_range_ok(unit_begin, unit_end, tf_attn_fwd_units(p))) return TF_ERR_BAD_SIZE;
  if (unit_end > unit_begin && !delta) return TF_ERR_NULL_POINTER;
  const int64_t H = p->heads_q, D = p->head_dim;
  const int64_t tiles = (tf_attn_max_q_span(p) + BQ - 1) / BQ;
  float a[16], b[16];
  for (int64_t u = unit_begin; u < unit_end; ++u) {
    const int64_t seg = u / (H * tiles), h = u / tiles % H, r0 = u % tiles * BQ;
    const tf_attn_segment qs = tf_attn_q_segment(p, seg);
    for (int64_t i = r0; i < min64(r0 + BQ, qs.span); ++i) {
      const int64_t row = qs.start + i;
      double acc = 0.0;
      if (i < qs.valid) {
        const int64_t od = tf_attn_row_offset(dout, qs.batch, row, h);
        const int64_t oo = tf_attn_row_offset(out, qs.batch, row, h);
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
          const int64_t n = min64(16, D - d0);
          tf_attn_load_row(dout, od + d0, n, 1.0f, a);
          tf_attn_load_row(out, oo + d0, n, 1.0f, b);
          for (int64_t d = 0; d < n; ++d) acc += (double)a[d] * b[d];
        }
      }
      delta[tf_attn_stat_index(p, qs.batch, h, row)] = (float)acc;
    }
  }
  return TF_OK;
}
