/*
 * Attention forward, the vector path: one query tile against all visible key
 * tiles with an online softmax, in the log2 domain (q is pre-scaled by
 * softmax_scale * log2(e) so probabilities are 2^(s - m)).
 *
 * One source, built once per vector width (attention_tile.h): included by
 * attention_fwd.c with 16-float vectors (the x86-64-v4 and baseline builds)
 * and by attention_fwd_avx2.c with 8-float vectors (the AVX2 build); and with
 * bf16 products (TF_ATTN_BF16_DOT, attention_bf16.h) by attention_fwd_bf16.c,
 * where the q, k and v tiles hold bf16 pairs and q is not pre-scaled: the
 * scores are scaled in float32 (`scale`), and P is rounded to bf16 for P.V.
 */
#ifndef TF_ATTENTION_FWD_BODY_H
#define TF_ATTENTION_FWD_BODY_H

/*
 * ISO C mode turns off a*b+c contraction; the tile kernels rely on FMA. Tile
 * row copies stay inline loops instead of becoming memcpy calls.
 */
#pragma GCC optimize("fp-contract=fast", "no-tree-loop-distribute-patterns")

#include <math.h>

#include "../common/tf_checks.h"
#include "attention_amx.h"
#include "attention_dropout.h"
#include "attention_internal.h"
#include "attention_tile.h"

#ifndef TF_ATTN_BF16_DOT
#define TF_ATTN_BF16_DOT 0
#endif
#if TF_ATTN_BF16_DOT
#include "attention_amx_pack.h"
#include "attention_bf16_tile.h"
/* Tile elements: bf16, the q^T, v and P tiles as pairs over their product's reduction. */
typedef uint16_t tile_elem;
#else
typedef float tile_elem;
#endif

#define BQ TF_ATTN_BLOCK_Q
#define QB TF_ATTN_FWD_ROWS
#define LD TF_ATTN_FWD_LD
#define BK TF_ATTN_BLOCK_K
#define VW TF_ATTN_VW
/* Queries per strip: the width of one register block. */
#define SW (2 * TF_ATTN_VW)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

/*
 * qt: q^T (dp x LD), k: key rows (BK x dp), v: value rows (BK x dp), st:
 * scores^T (BK x LD), then m, l, alpha per query. With bf16 products qt is
 * pairs [dp / 2][LD][2], v pairs [BK / 2][dp][2], and pp holds P^T rounded to
 * bf16 as pairs [BK / 2][LD][2] (tf_attn_bf16_fwd_scratch_floats).
 */
typedef struct fwd_scratch {
  tile_elem *qt, *k, *v, *pp;
  float *o, *st, *m, *l, *alpha;
} fwd_scratch;

static fwd_scratch split_scratch(float *base, int64_t dp) {
  fwd_scratch t;
  t.qt = (tile_elem *)base;
  t.o = (float *)(t.qt + dp * LD);
  t.k = (tile_elem *)(t.o + QB * dp);
  t.v = t.k + BK * dp;
  t.st = (float *)(t.v + BK * dp);
  t.m = t.st + BK * LD;
  t.l = t.m + QB;
  t.alpha = t.l + QB;
  t.pp = TF_ATTN_BF16_DOT ? (tile_elem *)(t.alpha + QB) : NULL;
  return t;
}

/*
 * Keys or values [k0, k0 + nk) of kv head hk, converted to a row-major nk x dp
 * float tile. Copying even float32 rows gives the tile kernels contiguous rows:
 * rows read in place sit one sequence stride apart, which maps them onto a few
 * L1 cache sets, so they evict each other.
 */
TF_ATTN_INLINE void pack_rows(const tf_attn_operand *x, tf_attn_segment ks, int64_t hk, int64_t k0,
                              int64_t nk, int64_t D, int64_t dp, float *restrict buf) {
  const int64_t first = tf_attn_row_offset(x, ks.batch, ks.start + k0, hk);
  for (int64_t j = 0; j < nk; ++j) tf_attn_load_row(x, first + j * x->stride_s, D, 1.0f, buf + j * dp);
}

/*
 * Rows [j0, j1) of head h of a sequence towards L2. The forward asks for
 * them a share at a time, one share per strip, so that no burst of misses
 * stalls the loads the tile kernels are waiting for.
 */
static void prefetch_rows(const tf_attn_operand *x, tf_attn_segment s, int64_t h, int64_t j0,
                          int64_t j1, int64_t D, int write) {
  for (int64_t j = j0; j < j1; ++j)
    tf_attn_prefetch_row(x, tf_attn_row_offset(x, s.batch, s.start + j, h), D, write);
}

/* Share `part` of `parts` of the rows [j0, j1). */
static void prefetch_share(const tf_attn_operand *x, tf_attn_segment s, int64_t h, int64_t j0,
                           int64_t j1, int64_t part, int64_t parts, int64_t D, int write) {
  const int64_t n = j1 - j0;
  prefetch_rows(x, s, h, j0 + n * part / parts, j0 + n * (part + 1) / parts, D, write);
}

/*
 * The part of one key tile that a strip of queries sees. Queries are tile
 * rows [i0, i0 + width), width SW or VW (two vectors or one); the
 * tile holds keys [k0, k0 + nk) of the sequence and the query tile starts at
 * sequence row r0. Scores are only computed for keys [0, rows) of the tile
 * (rows rounded up to whole GEMM row blocks); keys [0, seen) are the ones
 * some query of the strip may see; `masked` says whether any computed score
 * of the strip is hidden (by causality or past nk).
 */
typedef struct strip {
  int64_t i0, cols, seen, rows;
  int masked;
} strip;

static strip make_strip(const tf_attn_problem *p, int64_t i0, int64_t width, int64_t r0, int64_t k0,
                        int64_t nk) {
  strip s;
  s.i0 = i0;
  s.cols = width / VW;
  s.seen = p->causal ? min64(nk, r0 + i0 + width - k0) : nk;
  s.rows = (s.seen + TF_ATTN_GEMM_ROWS - 1) / TF_ATTN_GEMM_ROWS * TF_ATTN_GEMM_ROWS;
  s.masked = s.rows > nk || (p->causal && k0 + s.rows - 1 > r0 + i0);
  return s;
}

#if TF_ATTN_BF16_DOT
/*
 * x[i][c] = scale (k_{r + i} . q_{i0 + VW c + lane}) for the bf16 key rows kp
 * and q^T pairs qt, one pair of the head dim per step (D odd: the padding
 * element is zero in both).
 */
TF_ATTN_INLINE void score_product(tf_vf x[TF_ATTN_GEMM_ROWS][2], const uint16_t *restrict kp,
                                  int64_t ldk, const uint16_t *restrict qt, int64_t D, int64_t r,
                                  int64_t i0, float scale, const int cols) {
  for (int64_t d = 0; d < D; d += 2) {
    tf_vfu b[2];
    TF_ATTN_UNROLL for (int c = 0; c < cols; ++c) b[c] = tf_bf16_load(qt + 2 * (d / 2 * LD + i0 + VW * c));
    TF_ATTN_UNROLL for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i) {
      const uint32_t a = tf_bf16_pair(kp + (r + i) * ldk + d);
      TF_ATTN_UNROLL for (int c = 0; c < cols; ++c) x[i][c] = tf_bf16_dot(x[i][c], a, b[c]);
    }
  }
  TF_ATTN_UNROLL for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i)
    TF_ATTN_UNROLL for (int c = 0; c < cols; ++c) x[i][c] *= scale;
}
#else
/* x[i][c] = k_{r + i} . q_{i0 + VW c + lane} (qt holds q^T, pre-scaled; scale is 1). */
TF_ATTN_INLINE void score_product(tf_vf x[TF_ATTN_GEMM_ROWS][2], const float *restrict kp,
                                  int64_t ldk, const float *restrict qt, int64_t D, int64_t r,
                                  int64_t i0, float scale, const int cols) {
  (void)scale;
  for (int64_t d = 0; d < D; ++d) {
    tf_vf b[2];
    TF_ATTN_UNROLL for (int c = 0; c < cols; ++c) b[c] = tf_vf_load(qt + d * LD + i0 + VW * c);
    TF_ATTN_UNROLL for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i) {
      const float a = kp[(r + i) * ldk + d];
      TF_ATTN_UNROLL for (int c = 0; c < cols; ++c) x[i][c] += a * b[c];
    }
  }
}
#endif

/*
 * Scores of a strip, transposed: st[j][i0 + i] = k_j . q_{i0 + i} (score_product)
 * for keys j < s.rows, with hidden scores set to -inf in the same
 * pass (key k0 + j is hidden from query r0 + i when it is later, or when
 * j >= nk). Returns the max over the keys of each query column in mx. With
 * `lazy`, st gets 2^(score - ref) instead, computed while the block is in
 * registers, and their column sums are added to sum (strip_lazy_softmax).
 */
TF_ATTN_INLINE void strip_scores(float *restrict st, const tile_elem *restrict kp, int64_t ldk,
                                 const tile_elem *restrict qt, int64_t D, float scale, strip s,
                                 int causal, int64_t r0, int64_t k0, int64_t nk,
                                 const int masked, const int cols, const int lazy,
                                 const tf_vf ref[2], tf_vf mx[2], tf_vf sum[2]) {
  tf_vfi lane;
  for (int i = 0; i < VW; ++i) lane[i] = i;
  TF_ATTN_UNROLL for (int c = 0; c < cols; ++c) mx[c] = tf_vf_splat(-__builtin_inff());
  for (int64_t r = 0; r < s.rows; r += TF_ATTN_GEMM_ROWS) {
    tf_vf x[TF_ATTN_GEMM_ROWS][2];
    TF_ATTN_UNROLL for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i)
      TF_ATTN_UNROLL for (int c = 0; c < cols; ++c) x[i][c] = tf_vf_splat(0.0f);
    score_product(x, kp, ldk, qt, D, r, s.i0, scale, cols);
    TF_ATTN_UNROLL for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i)
      TF_ATTN_UNROLL for (int c = 0; c < cols; ++c) {
        if (masked) {
          /* Lanes below `hidden` are queries that do not see this key; VW hides them all. */
          int64_t hidden = r + i >= nk ? VW : causal ? k0 + r + i - (r0 + s.i0 + VW * c) : 0;
          hidden = clamp64(hidden, 0, VW);
          x[i][c] = tf_vf_select(lane < (int32_t)hidden, tf_vf_splat(-__builtin_inff()), x[i][c]);
        }
        mx[c] = tf_vf_max(mx[c], x[i][c]);
      }
    if (lazy) {
      /* The block's exponentials, TF_ATTN_EXP2_MAX_N chains at a time. */
      tf_vf e[TF_ATTN_GEMM_ROWS * 2];
      TF_ATTN_UNROLL for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i)
        TF_ATTN_UNROLL for (int c = 0; c < cols; ++c) e[i * cols + c] = x[i][c] - ref[c];
      TF_ATTN_UNROLL for (int g = 0; g < TF_ATTN_GEMM_ROWS * cols; g += TF_ATTN_EXP2_MAX_N)
        tf_vf_exp2_n(e + g, TF_ATTN_EXP2_MAX_N);
      TF_ATTN_UNROLL for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i)
        TF_ATTN_UNROLL for (int c = 0; c < cols; ++c) {
          x[i][c] = e[i * cols + c];
          sum[c] += x[i][c];
        }
    }
    TF_ATTN_UNROLL for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i)
      TF_ATTN_UNROLL for (int c = 0; c < cols; ++c) tf_vf_store(st + (r + i) * LD + s.i0 + VW * c, x[i][c]);
  }
}

/*
 * Online softmax of a strip whose column maxima are mx: updates the running
 * max m and sum l of its queries, leaves 2^(s - m) in st for keys [0, s.seen)
 * and the factor the output rows must be rescaled by in alpha.
 */
TF_ATTN_INLINE void strip_softmax(float *restrict st, strip s, const tf_vf mx[2], float *m,
                                  float *l, float *alpha) {
  for (int64_t c = 0; c < s.cols; ++c) {
    const int64_t col = s.i0 + VW * c;
    const tf_vf m_old = tf_vf_load(m + col);
    const tf_vf m_new = tf_vf_max(m_old, mx[c]);
    /* A query that sees no key yet keeps m = -inf; subtracting 0 instead gives it p = 0. */
    const tf_vf m_use = tf_vf_select(m_new == -__builtin_inff(), tf_vf_splat(0.0f), m_new);
    tf_vf sum = {0};
    for (int64_t j = 0; j < s.seen; ++j) {
      const tf_vf e = tf_vf_exp2(tf_vf_load(st + j * LD + col) - m_use);
      tf_vf_store(st + j * LD + col, e);
      sum += e;
    }
    const tf_vf a = tf_vf_exp2(m_old - m_use);
    tf_vf_store(l + col, tf_vf_load(l + col) * a + sum);
    tf_vf_store(m + col, m_new);
    tf_vf_store(alpha + col, a);
  }
}

/*
 * The lazy online softmax (strip_scores with `lazy`): st holds 2^(s - m_old)
 * already. While no score of a query exceeds its running max by more than
 * TF_ATTN_LAZY_HEADROOM, the max stays put: the exponentials (at most
 * 2^HEADROOM) and the sums keep full float32 precision relative to it, and
 * the o rows need no rescaling (returns 0). Otherwise (and for NaN scores)
 * the strip's columns move to the new max: st, l and o (through alpha) are
 * rescaled by 2^(m_old - m_new), and it returns 1.
 */
#define TF_ATTN_LAZY_HEADROOM 8.0f

TF_ATTN_INLINE int strip_lazy_softmax(float *restrict st, strip s, const tf_vf mx[2],
                                      const tf_vf sum[2], float *m, float *l, float *alpha) {
  int moved = 0;
  for (int64_t c = 0; c < s.cols; ++c) {
    const int64_t col = s.i0 + VW * c;
    const tf_vf m_old = tf_vf_load(m + col);
    const tf_vfi within = mx[c] <= m_old + TF_ATTN_LAZY_HEADROOM;
    int all_within = 1;
    for (int i = 0; i < VW; ++i) all_within &= within[i] != 0;
    if (all_within) {
      tf_vf_store(l + col, tf_vf_load(l + col) + sum[c]);
      tf_vf_store(alpha + col, tf_vf_splat(1.0f));
      continue;
    }
    moved = 1;
    const tf_vf m_new = tf_vf_max(m_old, mx[c]);
    const tf_vf a = tf_vf_exp2(m_old - m_new);
    for (int64_t j = 0; j < s.seen; ++j) tf_vf_store(st + j * LD + col, tf_vf_load(st + j * LD + col) * a);
    tf_vf_store(l + col, (tf_vf_load(l + col) + sum[c]) * a);
    tf_vf_store(m + col, m_new);
    tf_vf_store(alpha + col, a);
  }
  return moved;
}

/* Every query column of the strip has a finite running max (has seen a key), so it may take the lazy softmax. */
TF_ATTN_INLINE int strip_has_max(strip s, const float *m) {
  for (int64_t i = s.i0; i < s.i0 + VW * s.cols; ++i)
    if (!(m[i] > -__builtin_inff() && m[i] < __builtin_inff())) return 0;
  return 1;
}

/* How pv_block starts its o rows: from zero (the first key tile), as they are, or times alpha. */
enum { TF_ATTN_O_ZERO, TF_ATTN_O_KEEP, TF_ATTN_O_RESCALE };

#if TF_ATTN_BF16_DOT
/* x[i][c] += sum over keys [0, keys) of P_(key, r + i) v_key[n + VW c + lane], a pair of keys per step. */
TF_ATTN_INLINE void pv_product(tf_vf x[TF_ATTN_GEMM_ROWS][2], const uint16_t *restrict pp,
                               const uint16_t *restrict vp, int64_t dp, int64_t r, int64_t n,
                               int64_t keys, const int cols) {
  for (int64_t kk = 0; kk < keys; kk += 2) {
    tf_vfu b[2];
    TF_ATTN_UNROLL for (int c = 0; c < cols; ++c) b[c] = tf_bf16_load(vp + 2 * (kk / 2 * dp + n + VW * c));
    TF_ATTN_UNROLL for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i) {
      const uint32_t a = tf_bf16_pair(pp + 2 * (kk / 2 * LD + r + i));
      TF_ATTN_UNROLL for (int c = 0; c < cols; ++c) x[i][c] = tf_bf16_dot(x[i][c], a, b[c]);
    }
  }
}
#else
/* x[i][c] += sum over keys [0, keys) of P_(key, r + i) v_key[n + VW c + lane] (pp is st, P^T in float32). */
TF_ATTN_INLINE void pv_product(tf_vf x[TF_ATTN_GEMM_ROWS][2], const float *restrict pp,
                               const float *restrict vp, int64_t dp, int64_t r, int64_t n,
                               int64_t keys, const int cols) {
  for (int64_t kk = 0; kk < keys; ++kk) {
    tf_vf b[2];
    TF_ATTN_UNROLL for (int c = 0; c < cols; ++c) b[c] = tf_vf_load(vp + kk * dp + n + VW * c);
    TF_ATTN_UNROLL for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i) {
      const float a = pp[kk * LD + r + i];
      TF_ATTN_UNROLL for (int c = 0; c < cols; ++c) x[i][c] += a * b[c];
    }
  }
}
#endif

/* Columns [n, n + VW cols) of the o rows [r, r + TF_ATTN_GEMM_ROWS) below; `cols` is a constant where it is inlined. */
TF_ATTN_INLINE void pv_block(float *restrict o, const tile_elem *restrict pp,
                             const tile_elem *restrict vp, const float *alpha, int64_t dp,
                             int64_t r, int64_t n, int64_t keys, int start, const int cols) {
  tf_vf x[TF_ATTN_GEMM_ROWS][2];
  TF_ATTN_UNROLL for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i)
    TF_ATTN_UNROLL for (int c = 0; c < cols; ++c) {
      x[i][c] = start == TF_ATTN_O_ZERO ? tf_vf_splat(0.0f) : tf_vf_load(o + (r + i) * dp + n + VW * c);
      if (start == TF_ATTN_O_RESCALE) x[i][c] *= alpha[r + i];
    }
  pv_product(x, pp, vp, dp, r, n, keys, cols);
  TF_ATTN_UNROLL for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i)
    TF_ATTN_UNROLL for (int c = 0; c < cols; ++c) tf_vf_store(o + (r + i) * dp + n + VW * c, x[i][c]);
}

/*
 * o[i] = (0, o[i] or alpha[i] o[i], as `start` says) + sum_j p[j][i] v_j for
 * the strip's queries, TF_ATTN_GEMM_ROWS rows at a time, each over only the
 * keys its rows may see (with bf16 pairs, rounded up to a pair: the extra key
 * is hidden from the rows, p = 0, or past nk, where pp and v are zero). Every
 * query sees a key of the first tile (key 0 with causality), so
 * TF_ATTN_O_ZERO sets every row; a later row block that sees none of the
 * tile's keys has alpha 1 and is left as is.
 */
TF_ATTN_INLINE void strip_pv(float *restrict o, const tile_elem *restrict pp,
                             const tile_elem *restrict vp, const float *alpha, int64_t dp, strip s,
                             int causal, int64_t r0, int64_t k0, int64_t nk, int start) {
  for (int64_t r = s.i0; r < s.i0 + VW * s.cols; r += TF_ATTN_GEMM_ROWS) {
    const int64_t keys = causal ? min64(nk, r0 + r + TF_ATTN_GEMM_ROWS - k0) : nk;
    if (keys <= 0) continue;
    int64_t n = 0;
    for (; n + SW <= dp; n += SW) pv_block(o, pp, vp, alpha, dp, r, n, keys, start, 2);
    if (n < dp) pv_block(o, pp, vp, alpha, dp, r, n, keys, start, 1);
  }
}

#if TF_ATTN_BF16_DOT
/*
 * P^T of the strip's query columns for keys [0, s.seen), rounded to bf16 as
 * pairs of keys into pp; an odd last key pairs with a zero (st holds the
 * masked score there).
 */
TF_ATTN_INLINE void strip_pairs(uint16_t *restrict pp, const float *restrict st, strip s) {
  for (int64_t j = 0; j < s.seen; j += 2)
    for (int64_t c = 0; c < s.cols; ++c) {
      const int64_t col = s.i0 + VW * c;
      const tf_vf hi = j + 1 < s.seen ? tf_vf_load(st + (j + 1) * LD + col) : tf_vf_splat(0.0f);
      tf_bf16_store_pairs(pp + 2 * (j / 2 * LD + col), tf_vf_load(st + j * LD + col), hi);
    }
}
#endif

#if !TF_ATTN_BF16_DOT
/* Drops probabilities of queries [i_begin, i_end) x keys [0, nk) of the tile (transposed) and scales the kept ones. */
static void dropout_strip(const tf_attn_problem *p, float *st, int64_t i_begin, int64_t i_end,
                          int64_t nk, int64_t seg, int64_t h, int64_t r0, int64_t k0) {
  const tf_attn_dropout_key_t key = tf_attn_dropout_key(p->seed, p->offset);
  const uint32_t threshold = tf_attn_dropout_threshold(p->dropout_p);
  const float keep_scale = 1.0f / (1.0f - p->dropout_p);
  for (int64_t j = 0; j < nk; ++j)
    for (int64_t i = i_begin; i < i_end; ++i) {
      const uint32_t bits = tf_attn_dropout_bits(key, (uint32_t)seg, (uint32_t)h,
                                                 (uint32_t)(r0 + i), (uint32_t)(k0 + j));
      st[j * LD + i] = bits >= threshold ? st[j * LD + i] * keep_scale : 0.0f;
    }
}
#endif

/*
 * Scores, softmax, dropout and o update of one strip; `masked` and `cols` are
 * constants where it is inlined. A strip whose queries have all seen keys
 * takes the lazy softmax, with the exponentials computed in the score pass.
 * The bf16 build (which takes no dropout) rounds P to bf16 pairs for P.V.
 */
TF_ATTN_INLINE void strip_step(const tf_attn_problem *p, const fwd_scratch *t, const tile_elem *kp,
                               int64_t ldk, float scale, strip s, int64_t D,
                               int64_t dp, int64_t rows, int64_t seg, int64_t h, int64_t r0,
                               int64_t k0, int64_t nk, int first, const int masked,
                               const int cols) {
  tf_vf mx[2], ref[2] = {{0}}, sum[2] = {{0}};
  int start = first ? TF_ATTN_O_ZERO : TF_ATTN_O_RESCALE;
  if (!first && strip_has_max(s, t->m)) {
    TF_ATTN_UNROLL for (int c = 0; c < cols; ++c) ref[c] = tf_vf_load(t->m + s.i0 + VW * c);
    strip_scores(t->st, kp, ldk, t->qt, D, scale, s, p->causal, r0, k0, nk, masked, cols, 1, ref, mx, sum);
    if (!strip_lazy_softmax(t->st, s, mx, sum, t->m, t->l, t->alpha)) start = TF_ATTN_O_KEEP;
  } else {
    strip_scores(t->st, kp, ldk, t->qt, D, scale, s, p->causal, r0, k0, nk, masked, cols, 0, ref, mx, sum);
    strip_softmax(t->st, s, mx, t->m, t->l, t->alpha);
  }
#if TF_ATTN_BF16_DOT
  (void)rows, (void)seg, (void)h;
  strip_pairs(t->pp, t->st, s);
  strip_pv(t->o, t->pp, t->v, t->alpha, dp, s, p->causal, r0, k0, nk, start);
#else
  if (p->dropout_p > 0.0f)
    dropout_strip(p, t->st, s.i0, min64(s.i0 + VW * s.cols, rows), s.seen, seg, h, r0, k0);
  strip_pv(t->o, t->st, t->v, t->alpha, dp, s, p->causal, r0, k0, nk, start);
#endif
}

#if TF_ATTN_BF16_DOT
/* The score scale: softmax_scale log2(e) and the descales of E4M3 q and k (q^T holds raw values). */
static float score_scale(const tf_attn_problem *p, const tf_attn_operand *q, const tf_attn_operand *k) {
  const float qd = q->elem == TF_ATTN_E4M3 ? q->descale : 1.0f;
  return p->softmax_scale * LOG2E * qd * (k->elem == TF_ATTN_E4M3 ? k->descale : 1.0f);
}

/* The output scale: v's descale when it is E4M3. */
static float v_scale(const tf_attn_operand *v) { return v->elem == TF_ATTN_E4M3 ? v->descale : 1.0f; }

/*
 * The block's query rows [r0, r0 + rows) of head h as q^T pairs over the head
 * dim, zero past `rows`: bf16 q by the vector transpose, E4M3 q decoded by the
 * packer.
 */
TF_ATTN_INLINE void pack_q(const tf_attn_problem *p, const tf_attn_operand *q, tf_attn_segment qs,
                           int64_t h, int64_t r0, int64_t rows, int64_t nq, const fwd_scratch *t) {
  (void)nq;
  const int64_t D = p->head_dim, dp = tf_attn_padded_dim(p);
  const int64_t first = tf_attn_row_offset(q, qs.batch, qs.start + r0, h);
  tf_bf16_pack_transposed(q, first, q->stride_s, rows, LD, D, dp, t->qt);
}

/* tf_amx_pack_pairs zeroes v's padding itself. */
static void clear_v_padding(const fwd_scratch *t, int64_t D, int64_t dp) { (void)t, (void)D, (void)dp; }

/*
 * Keys [k0, k0 + nk) of kv head hk: v as pairs over the keys (an odd last key
 * pairs with a zero row), k as bf16 rows, zero up to a whole GEMM row block.
 * Returns the key rows and their stride in *ldk.
 */
TF_ATTN_INLINE const uint16_t *pack_kv_tile(const tf_attn_operand *k, const tf_attn_operand *v,
                                            tf_attn_segment ks, int64_t hk, int64_t k0, int64_t nk,
                                            int64_t D, int64_t dp, const fwd_scratch *t,
                                            int64_t *ldk) {
  tf_bf16_pack_pairs(v, tf_attn_row_offset(v, ks.batch, ks.start + k0, hk), v->stride_s, nk, (nk + 1) / 2 * 2,
                     D, dp, t->v);
  const int64_t first = tf_attn_row_offset(k, ks.batch, ks.start + k0, hk);
  for (int64_t j = 0; j < nk; ++j) tf_amx_pack_row(k, first + j * k->stride_s, D, dp, t->k + j * dp);
  for (int64_t j = nk; j < (nk + TF_ATTN_GEMM_ROWS - 1) / TF_ATTN_GEMM_ROWS * TF_ATTN_GEMM_ROWS; ++j)
    memset(t->k + j * dp, 0, (size_t)dp * sizeof(uint16_t));
  *ldk = dp;
  return t->k;
}
#else
/* q^T is pre-scaled (scores need no scale), out takes no descale (E4M3 is decoded with it). */
static float score_scale(const tf_attn_problem *p, const tf_attn_operand *q, const tf_attn_operand *k) {
  (void)p, (void)q, (void)k;
  return 1.0f;
}

static float v_scale(const tf_attn_operand *v) {
  (void)v;
  return 1.0f;
}

/*
 * q^T, pre-scaled, zero past `rows`: the rows are first copied into o
 * (free until the first key tile sets it), so the strided loads are all
 * independent, then transposed VW rows at a time.
 */
TF_ATTN_INLINE void pack_q(const tf_attn_problem *p, const tf_attn_operand *q, tf_attn_segment qs,
                           int64_t h, int64_t r0, int64_t rows, int64_t nq, const fwd_scratch *t) {
  const int64_t D = p->head_dim, dp = tf_attn_padded_dim(p);
  for (int64_t i = 0; i < rows; ++i)
    tf_attn_load_row(q, tf_attn_row_offset(q, qs.batch, qs.start + r0 + i, h), D,
                     p->softmax_scale * LOG2E, t->o + i * dp);
  for (int64_t i = rows; i < nq; ++i) memset(t->o + i * dp, 0, (size_t)D * sizeof(float));
  for (int64_t i0 = 0; i0 < nq; i0 += VW)
    for (int64_t d = 0; d < D; ++d)
      for (int64_t i = 0; i < VW; ++i) t->qt[d * LD + i0 + i] = t->o[(i0 + i) * dp + d];
}

/* v's padding columns stay zero (o's padding columns are never stored, but stay finite). */
static void clear_v_padding(const fwd_scratch *t, int64_t D, int64_t dp) {
  if (D < dp)
    for (int64_t j = 0; j < BK; ++j) memset(t->v + j * dp + D, 0, (size_t)(dp - D) * sizeof(float));
}

/*
 * Keys [k0, k0 + nk) of kv head hk: v packed, and k read in place when it is
 * float32 and the score GEMM's whole row blocks stay inside the tile (only
 * TF_ATTN_GEMM_ROWS rows are read at a time, so the L1 set aliasing pack_rows
 * avoids does not matter here); otherwise packed, and keys past nk in the
 * last row block (masked) are zeros. Returns the key rows and their stride
 * in *ldk.
 */
TF_ATTN_INLINE const float *pack_kv_tile(const tf_attn_operand *k, const tf_attn_operand *v,
                                         tf_attn_segment ks, int64_t hk, int64_t k0, int64_t nk,
                                         int64_t D, int64_t dp, const fwd_scratch *t,
                                         int64_t *ldk) {
  pack_rows(v, ks, hk, k0, nk, D, dp, t->v);
  if (k->elem == TF_ATTN_F32 && nk % TF_ATTN_GEMM_ROWS == 0) {
    *ldk = k->stride_s;
    return (const float *)k->data + tf_attn_row_offset(k, ks.batch, ks.start + k0, hk);
  }
  pack_rows(k, ks, hk, k0, nk, D, dp, t->k);
  for (int64_t j = nk; j < (nk + TF_ATTN_GEMM_ROWS - 1) / TF_ATTN_GEMM_ROWS * TF_ATTN_GEMM_ROWS; ++j)
    memset(t->k + j * dp, 0, (size_t)D * sizeof(float));
  *ldk = dp;
  return t->k;
}
#endif

/*
 * Units [unit, unit + count) (count 1 or 2: consecutive query tiles of one
 * head) as one block of query rows. Scores are computed transposed,
 * s^T = k q^T (keys x queries), so the softmax reduces down columns, VW
 * queries per vector; the block is walked in strips of SW queries, each
 * carried from its scores to its o update while it is in L1, and skipping the
 * keys a strip cannot see under causality.
 */
TF_ATTN_INLINE void fwd_block_body(const tf_attn_problem *p, const tf_attn_operand *q, const tf_attn_operand *k,
                      const tf_attn_operand *v, const tf_attn_operand *out, float *lse,
                      int64_t unit, int64_t count, int64_t tiles, float *scratch) {
  const int64_t H = p->heads_q, D = p->head_dim, dp = tf_attn_padded_dim(p);
  const int64_t seg = unit / (H * tiles), h = unit / tiles % H, r0 = unit % tiles * BQ;
  const tf_attn_segment qs = tf_attn_q_segment(p, seg), ks = tf_attn_kv_segment(p, seg);
  if (r0 >= qs.span) return;
  int64_t kv_end;
  const int64_t rows = tf_attn_fwd_live_rows(p, out, lse, qs, ks, h, r0, min64(count * BQ, qs.span - r0), &kv_end);
  if (rows == 0) return;

  const fwd_scratch t = split_scratch(scratch, dp);
  const int64_t nq = (rows + VW - 1) / VW * VW; /* query columns of the score tile */
  const int64_t hk = h / (H / p->heads_kv);
  pack_q(p, q, qs, h, r0, rows, nq, &t);
  const float scale = score_scale(p, q, k), vscale = v_scale(v);
  for (int64_t i = 0; i < nq; ++i) {
    t.m[i] = -INFINITY;
    t.l[i] = 0.0f;
  }
  /* The query rows and first key tile of the next unit, which is usually this thread's next one. */
  const int64_t next = unit + count;
  tf_attn_segment next_qs = qs, next_ks = ks;
  int64_t next_h = 0, next_r0 = 0, next_rows = 0, next_keys = 0;
  if (next < tf_attn_num_segments(p) * H * tiles) {
    next_qs = tf_attn_q_segment(p, next / (H * tiles));
    next_ks = tf_attn_kv_segment(p, next / (H * tiles));
    next_h = next / tiles % H;
    next_r0 = next % tiles * BQ;
    next_rows = clamp64(next_qs.valid - next_r0, 0, BQ);
    next_keys = next_rows > 0 ? min64(BK, next_ks.valid) : 0;
  }
  const int64_t next_hk = next_h / (H / p->heads_kv);
  clear_v_padding(&t, D, dp);

  for (int64_t k0 = 0; k0 < kv_end; k0 += BK) {
    const int64_t nk = min64(BK, kv_end - k0);
    int64_t ldk;
    const tile_elem *kp = pack_kv_tile(k, v, ks, hk, k0, nk, D, dp, &t, &ldk);
    const int first = k0 == 0;
    const int64_t strips = (nq + SW - 1) / SW;
    for (int64_t i0 = 0; i0 < nq; i0 += SW) {
      /*
       * Each strip asks for a share of what comes next: the next key tile, or
       * after the last one, this unit's output rows and the next unit's query
       * rows and first key tile.
       */
      const int64_t part = i0 / SW;
      if (k0 + BK < kv_end) {
        const int64_t end = min64(k0 + 2 * BK, kv_end);
        prefetch_share(k, ks, hk, k0 + BK, end, part, strips, D, 0);
        prefetch_share(v, ks, hk, k0 + BK, end, part, strips, D, 0);
      } else {
        prefetch_share(out, qs, h, r0, r0 + rows, part, strips, D, 1);
        prefetch_share(q, next_qs, next_h, next_r0, next_r0 + next_rows, part, strips, D, 0);
        prefetch_share(k, next_ks, next_hk, 0, next_keys, part, strips, D, 0);
        prefetch_share(v, next_ks, next_hk, 0, next_keys, part, strips, D, 0);
      }
      const int64_t width = min64(SW, nq - i0);
      const strip s = make_strip(p, i0, width, r0, k0, nk);
      if (s.seen <= 0) continue; /* no query of the strip sees these keys */
      if (width == SW) {
        if (s.masked) strip_step(p, &t, kp, ldk, scale, s, D, dp, rows, seg, h, r0, k0, nk, first, 1, 2);
        else strip_step(p, &t, kp, ldk, scale, s, D, dp, rows, seg, h, r0, k0, nk, first, 0, 2);
      } else {
        strip_step(p, &t, kp, ldk, scale, s, D, dp, rows, seg, h, r0, k0, nk, first, 1, 1);
      }
    }
  }

  for (int64_t i = 0; i < rows; ++i) {
    const int64_t row = qs.start + r0 + i;
    tf_attn_store_row(out, tf_attn_row_offset(out, qs.batch, row, h), D, vscale / t.l[i],
                      t.o + i * dp);
    lse[tf_attn_stat_index(p, qs.batch, h, row)] = (t.m[i] + log2f(t.l[i])) * LN2;
  }
}

#define TF_ATTN_FWD_BLOCK_PARAMS                                                        \
  (const tf_attn_problem *p, const tf_attn_operand *q, const tf_attn_operand *k,        \
   const tf_attn_operand *v, const tf_attn_operand *out, float *lse, int64_t unit,      \
   int64_t count, int64_t tiles, float *scratch)
#define TF_ATTN_FWD_BLOCK_ARGS (p, q, k, v, out, lse, unit, count, tiles, scratch)

#endif /* TF_ATTENTION_FWD_BODY_H */
