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

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

typedef struct fwd_scratch {
  float *qt, *o, *k, *v, *st, *m, *l, *alpha, *row;
} fwd_scratch;

static fwd_scratch split_scratch(float *base, int64_t dp) {
  fwd_scratch t;
  t.qt = base;
  t.o = t.qt + dp * BQ;
  t.k = t.o + BQ * dp;
  t.v = t.k + BK * dp;
  t.st = t.v + BK * dp;
  t.m = t.st + BK * BQ;
  t.l = t.m + BQ;
  t.alpha = t.l + BQ;
  t.row = t.alpha + BQ;
  return t;
}

/* A key or value tile as a row-major float matrix: its rows and their stride. */
typedef struct kv_tile {
  const float *rows;
  int64_t ld;
} kv_tile;

/*
 * Keys or values [k0, k0 + nk) of kv head hk. float32 operands are used in
 * place when every row the tile kernels read exists (a full tile for keys,
 * whose GEMM runs on whole 8-row blocks; a head dim of whole 16-float vectors
 * for values); otherwise the rows are converted into buf (nk x dp, zero
 * padded to `rows` rows).
 */
TF_ATTN_INLINE kv_tile kv_rows(const tf_attn_operand *x, tf_attn_segment ks, int64_t hk, int64_t k0,
                               int64_t nk, int64_t rows, int64_t D, int64_t dp, int direct,
                               float *buf) {
  kv_tile tile;
  const int64_t first = tf_attn_row_offset(x, ks.batch, ks.start + k0, hk);
  if (direct) {
    tile.rows = (const float *)x->data + first;
    tile.ld = x->stride_s;
    return tile;
  }
  for (int64_t j = 0; j < nk; ++j) tf_attn_load_row(x, first + j * x->stride_s, D, 1.0f, buf + j * dp);
  for (int64_t j = nk; j < rows; ++j) memset(buf + j * dp, 0, (size_t)dp * sizeof(float));
  tile.rows = buf;
  tile.ld = dp;
  return tile;
}

/* Brings the k and v rows of the next key tile towards the cache while this one is computed. */
static void prefetch_kv(const tf_attn_operand *k, const tf_attn_operand *v, tf_attn_segment ks,
                        int64_t hk, int64_t k0, int64_t nk, int64_t D) {
  for (int64_t j = 0; j < nk; ++j) {
    tf_attn_prefetch_row(k, tf_attn_row_offset(k, ks.batch, ks.start + k0 + j, hk), D);
    tf_attn_prefetch_row(v, tf_attn_row_offset(v, ks.batch, ks.start + k0 + j, hk), D);
  }
}

/*
 * Online softmax over the transposed scores st (nk keys x 16 * chunks
 * queries, masked entries -inf), 16 queries per vector, so every reduction
 * runs down the columns. Updates the running max m and sum l, leaves
 * 2^(s - m) in st and the factor the output rows must be rescaled by in alpha.
 */
TF_ATTN_INLINE void softmax_columns(float *restrict st, int64_t nk, int64_t chunks, float *m,
                                    float *l, float *alpha) {
  for (int64_t c = 0; c < chunks; ++c) {
    tf_v16 mx = tf_v16_splat(-__builtin_inff());
    for (int64_t j = 0; j < nk; ++j) mx = tf_v16_max(mx, tf_v16_load(st + j * BQ + 16 * c));
    const tf_v16 m_old = tf_v16_load(m + 16 * c);
    const tf_v16 m_new = tf_v16_max(m_old, mx);
    /* A query that sees no key yet keeps m = -inf; subtracting 0 instead gives it p = 0. */
    const tf_v16 m_use = tf_v16_select(m_new == -__builtin_inff(), tf_v16_splat(0.0f), m_new);
    tf_v16 sum = {0};
    for (int64_t j = 0; j < nk; ++j) {
      const tf_v16 e = tf_v16_exp2(tf_v16_load(st + j * BQ + 16 * c) - m_use);
      tf_v16_store(st + j * BQ + 16 * c, e);
      sum += e;
    }
    const tf_v16 a = tf_v16_exp2(m_old - m_use);
    tf_v16_store(l + 16 * c, tf_v16_load(l + 16 * c) * a + sum);
    tf_v16_store(m + 16 * c, m_new);
    tf_v16_store(alpha + 16 * c, a);
  }
}

/* Drops probabilities of queries [r0, r0 + rows) x keys [k0, k0 + nk) (transposed tile) and scales the kept ones. */
static void dropout_tile(const tf_attn_problem *p, float *st, int64_t rows, int64_t nk,
                         int64_t seg, int64_t h, int64_t r0, int64_t k0) {
  const tf_attn_dropout_key_t key = tf_attn_dropout_key(p->seed, p->offset);
  const uint32_t threshold = tf_attn_dropout_threshold(p->dropout_p);
  const float keep_scale = 1.0f / (1.0f - p->dropout_p);
  for (int64_t j = 0; j < nk; ++j)
    for (int64_t i = 0; i < rows; ++i) {
      const uint32_t bits = tf_attn_dropout_bits(key, (uint32_t)seg, (uint32_t)h,
                                                 (uint32_t)(r0 + i), (uint32_t)(k0 + j));
      st[j * BQ + i] = bits >= threshold ? st[j * BQ + i] * keep_scale : 0.0f;
    }
}

/*
 * One query tile of one head. Scores are computed transposed, s^T = k q^T
 * (keys x queries), so k is read row by row (in place for float32) and the
 * softmax reduces down columns; then o += p v with p read through its transpose.
 */
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
  const int64_t nq = (rows + 15) / 16 * 16; /* query columns of the score tile */
  const int64_t hk = h / (H / p->heads_kv);
  const int v_direct = v->elem == TF_ATTN_F32 && D == dp;
  memset(t.o, 0, (size_t)(mp * dp) * sizeof(float));
  if (!v_direct) memset(t.v, 0, (size_t)(BK * dp) * sizeof(float));
  for (int64_t d = 0; d < D; ++d)
    for (int64_t i = rows; i < nq; ++i) t.qt[d * BQ + i] = 0.0f;
  for (int64_t i = 0; i < rows; ++i) {
    tf_attn_load_row(q, tf_attn_row_offset(q, qs.batch, qs.start + r0 + i, h), D,
                     p->softmax_scale * LOG2E, t.row);
    for (int64_t d = 0; d < D; ++d) t.qt[d * BQ + i] = t.row[d];
  }
  for (int64_t i = 0; i < nq; ++i) {
    t.m[i] = -INFINITY;
    t.l[i] = 0.0f;
  }

  for (int64_t k0 = 0; k0 < kv_end; k0 += BK) {
    const int64_t nk = min64(BK, kv_end - k0);
    const int64_t mk = (nk + TF_ATTN_GEMM_ROWS - 1) / TF_ATTN_GEMM_ROWS * TF_ATTN_GEMM_ROWS;
    if (k0 + BK < kv_end) prefetch_kv(k, v, ks, hk, k0 + BK, min64(BK, kv_end - k0 - BK), D);
    const kv_tile kt = kv_rows(k, ks, hk, k0, nk, mk, D, dp, k->elem == TF_ATTN_F32 && nk == BK, t.k);
    const kv_tile vt = kv_rows(v, ks, hk, k0, nk, nk, D, dp, v_direct, t.v);
    tf_attn_gemm(t.st, BQ, kt.rows, kt.ld, 1, t.qt, BQ, mk, nq, D, 0);
    if (p->causal && k0 + nk - 1 > r0) /* key k0 + j is hidden from queries i < k0 + j - r0 */
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t hidden = min64(k0 + j - r0, nq);
        for (int64_t i = 0; i < hidden; ++i) t.st[j * BQ + i] = -INFINITY;
      }
    softmax_columns(t.st, nk, nq / 16, t.m, t.l, t.alpha);
    for (int64_t i = 0; i < rows; ++i)
      if (t.alpha[i] != 1.0f)
        for (int64_t d = 0; d < dp; ++d) t.o[i * dp + d] *= t.alpha[i];
    if (p->dropout_p > 0.0f) dropout_tile(p, t.st, rows, nk, seg, h, r0, k0);
    tf_attn_gemm(t.o, dp, t.st, 1, BQ, vt.rows, vt.ld, mp, dp, nk, 1);
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
