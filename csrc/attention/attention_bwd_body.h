/*
 * Attention backward. A unit owns one (sequence, kv head): for each key tile
 * it walks the query tiles of every query head sharing that kv head,
 * recomputes the probabilities from lse, and accumulates dK and dV of the
 * tile locally and dQ in the unit's own rows of dq_accum -- so units never
 * write the same memory.
 *
 *   P = exp(s - lse), dV += P_drop^T dO, dP = dO V^T (through the dropout
 *   mask), dS = P * (dP - delta), dQ += scale dS K, dK += scale dS^T Q,
 * with delta = rowsum(dO * O) from tf_attn_bwd_rowdot.
 *
 * The vector path's unit bodies are one source, built once per vector width
 * (attention_tile.h): included by attention_bwd.c with 16-float vectors (the
 * x86-64-v4 and baseline builds) and by attention_bwd_avx2.c with 8-float
 * vectors (the AVX2 build); and with bf16 products (TF_ATTN_BF16_DOT,
 * attention_bf16.h) by attention_bwd_bf16.c, whose tiles and block products
 * are the bf16 section below.
 */
#ifndef TF_ATTENTION_BWD_BODY_H
#define TF_ATTENTION_BWD_BODY_H

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
#endif

#define BQ TF_ATTN_BLOCK_Q
#define BK TF_ATTN_BLOCK_K
/*
 * Key tiles one walk over the query tiles serves (see key_tile_grads): two in
 * the AVX2 build, where it was measured; four in the bf16 build, whose query
 * tiles take longer to pack; one in the x86-64-v4 and baseline builds, which
 * keep the order of their dQ sums (they could not be measured on the
 * AVX2-only machine this was written on).
 */
#define KT                                   \
  (TF_ATTN_BF16_DOT ? TF_ATTN_BF16_BWD_KEY_TILES \
   : TF_ATTN_VW == 8 ? TF_ATTN_BWD_KEY_TILES     \
                     : 1)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
/*
 * Rows of q, dout and the dQ accumulator are read a few rows after they are
 * asked for: they lie a sequence stride apart, which the hardware prefetchers
 * do not follow, and a prefetch long before the read is evicted first (the
 * three operands' rows map onto the same L2 sets).
 */
#define AHEAD 8

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

#if TF_ATTN_BF16_DOT
/*
 * The bf16 build's tiles (bf16 pairs as in attention_bf16_tile.h), for KT key
 * tiles: kt, vt (k^T and v^T as pairs over the head dim, [dp / 2][BK][2]), kp
 * (k as pairs over the keys, [BK / 2][dp][2]), dkt and dvt (dK^T and dV^T, dp x
 * BK floats, stored transposed at the end). Per query tile: q and dout rows
 * (BQ x dp bf16), qt and doutt (q^T and dout^T, dp x BQ bf16: pairs over the
 * queries), lse and delta, the dQ rows dq (BQ x dp floats). Per block: p and dp
 * (BQ x BK floats), pp and dsp (P and dS as pairs over the queries, [BQ / 2][BK][2])
 * and ds (dS rows, BQ x BK bf16). The scores take scale2 (softmax_scale
 * log2(e) and the q and k descales), dP v's descale (vscale).
 */
typedef struct bwd_scratch {
  float *dk, *dv, *dq, *p, *dp, *lse, *delta;
  uint16_t *kt, *vt, *k, *q, *dout, *qt, *doutt, *pp, *dsp, *ds;
  float scale2, vscale;
} bwd_scratch;

static float descale_of(const tf_attn_operand *x) { return x->elem == TF_ATTN_E4M3 ? x->descale : 1.0f; }

static bwd_scratch split_scratch(float *base, const tf_attn_problem *p, const tf_attn_operand *q,
                                 const tf_attn_operand *k, const tf_attn_operand *v) {
  const int64_t dp = tf_attn_padded_dim(p);
  bwd_scratch t;
  t.dk = base;
  t.dv = t.dk + KT * BK * dp;
  t.dq = t.dv + KT * BK * dp;
  t.p = t.dq + BQ * dp;
  t.dp = t.p + BQ * BK;
  t.lse = t.dp + BQ * BK;
  t.delta = t.lse + BQ;
  t.kt = (uint16_t *)(t.delta + BQ);
  t.vt = t.kt + KT * BK * dp;
  t.k = t.vt + KT * BK * dp;
  t.q = t.k + KT * BK * dp;
  t.dout = t.q + BQ * dp;
  t.qt = t.dout + BQ * dp;
  t.doutt = t.qt + BQ * dp;
  t.pp = t.doutt + BQ * dp;
  t.dsp = t.pp + BQ * BK;
  t.ds = t.dsp + BQ * BK;
  t.scale2 = p->softmax_scale * LOG2E * descale_of(q) * descale_of(k);
  t.vscale = descale_of(v);
  return t;
}

#else
/* k, kt, vt, dk and dv hold KT key tiles, BK * dp floats apart (key_tile(): one of them). */
typedef struct bwd_scratch {
  float *k, *kt, *vt, *dk, *dv, *q, *dout, *dq, *p, *dp, *lse, *delta, *row;
} bwd_scratch;

static bwd_scratch split_scratch(float *base, const tf_attn_problem *p, const tf_attn_operand *q,
                                 const tf_attn_operand *k, const tf_attn_operand *v) {
  (void)q, (void)k, (void)v; /* decoded with their descales */
  const int64_t dp = tf_attn_padded_dim(p);
  bwd_scratch t;
  t.k = base;
  t.kt = t.k + KT * BK * dp;
  t.vt = t.kt + KT * BK * dp;
  t.dk = t.vt + KT * BK * dp;
  t.dv = t.dk + KT * BK * dp;
  t.q = t.dv + KT * BK * dp;
  t.dout = t.q + BQ * dp;
  t.dq = t.dout + BQ * dp;
  t.p = t.dq + BQ * dp;
  t.dp = t.p + BQ * BK;
  t.lse = t.dp + BQ * BK;
  t.delta = t.lse + BQ;
  t.row = t.delta + BQ;
  return t;
}

#endif

/* The scratch with key tile `tile`'s k, kt, vt, dk and dv (the query side is shared): each holds
 * KT key tiles, BK * dp elements apart, in either build. */
static bwd_scratch key_tile(const bwd_scratch *t, int64_t tile, int64_t dp) {
  bwd_scratch s = *t;
  s.k += tile * BK * dp;
  s.kt += tile * BK * dp;
  s.vt += tile * BK * dp;
  s.dk += tile * BK * dp;
  s.dv += tile * BK * dp;
  return s;
}

#if TF_ATTN_BF16_DOT
/* Keys [k0, k0 + nk): kt, vt (zero past nk) and kp (zero past nk, padded to BK). */
TF_ATTN_INLINE void load_kv_tile(const tf_attn_operand *k, const tf_attn_operand *v,
                                 tf_attn_segment ks, int64_t hk, int64_t k0, int64_t nk,
                                 int64_t D, int64_t dp, const bwd_scratch *t) {
  const int64_t ko = tf_attn_row_offset(k, ks.batch, ks.start + k0, hk);
  tf_bf16_pack_transposed(k, ko, k->stride_s, nk, BK, D, dp, t->kt);
  tf_bf16_pack_transposed(v, tf_attn_row_offset(v, ks.batch, ks.start + k0, hk), v->stride_s, nk, BK, D, dp,
                          t->vt);
  tf_bf16_pack_pairs(k, ko, k->stride_s, nk, BK, D, dp, t->k);
}

/*
 * Query rows [r0, r0 + nv) of head h: q and dout rows (raw bf16), with
 * `with_kv` also q^T and dout^T, lse (log2 units) and delta; rows up to mp
 * are zero.
 */
TF_ATTN_INLINE void load_q_tile(const tf_attn_problem *p, const tf_attn_operand *q,
                                const tf_attn_operand *dout, const float *lse, const float *delta,
                                tf_attn_segment qs, int64_t h, int64_t r0, int64_t nv, int64_t mp,
                                int64_t D, int64_t dp, int with_kv, const bwd_scratch *t) {
  for (int64_t i = 0; i < nv; ++i) {
    const int64_t row = qs.start + r0 + i;
    if (i + AHEAD < nv) {
      tf_attn_prefetch_row(q, tf_attn_row_offset(q, qs.batch, row + AHEAD, h), D, 0);
      tf_attn_prefetch_row(dout, tf_attn_row_offset(dout, qs.batch, row + AHEAD, h), D, 0);
    }
    tf_amx_pack_row(q, tf_attn_row_offset(q, qs.batch, row, h), D, dp, t->q + i * dp);
    tf_amx_pack_row(dout, tf_attn_row_offset(dout, qs.batch, row, h), D, dp, t->dout + i * dp);
    const float l = lse[tf_attn_stat_index(p, qs.batch, h, row)];
    t->lse[i] = l == -INFINITY ? INFINITY : l * LOG2E; /* a row without keys has P = 0 */
    t->delta[i] = delta[tf_attn_stat_index(p, qs.batch, h, row)];
  }
  for (int64_t i = nv; i < mp; ++i) {
    memset(t->q + i * dp, 0, (size_t)dp * sizeof(uint16_t));
    memset(t->dout + i * dp, 0, (size_t)dp * sizeof(uint16_t));
    t->lse[i] = INFINITY;
    t->delta[i] = 0.0f;
  }
  if (!with_kv) return;
  /* Blocks of 32 queries (queries past mp come out zero) by 16 dims. */
  _Static_assert(BQ % 32 == 0, "q^T is written in blocks of 32 queries");
  for (int64_t i = 0; i < mp; i += 32)
    for (int64_t d = 0; d < dp; d += 16) {
      tf_bf16_transpose_pairs(t->q + i * dp + d, dp, mp - i, t->qt + d * BQ + i, BQ);
      tf_bf16_transpose_pairs(t->dout + i * dp + d, dp, mp - i, t->doutt + d * BQ + i, BQ);
    }
}

/*
 * One (query tile, key tile) block, rows [i0, mp) of the query tile (i0 a
 * multiple of TF_ATTN_GEMM_ROWS): p <- P, dp <- dS (float32), and dS rounded
 * to bf16 in ds; with `with_kv` P and dS also as pairs over the queries in pp
 * and dsp. Rows [nv, mp) are padding and get p = dS = 0.
 */
TF_ATTN_INLINE void block_grads(const tf_attn_problem *p, const bwd_scratch *t, int64_t i0,
                                int64_t nv, int64_t mp, int64_t nk, int64_t seg, int64_t h,
                                int64_t r0, int64_t k0, int64_t D, int64_t dp, int with_kv) {
  (void)seg, (void)h; /* for dropout, which this build does not take */
  const int64_t pairs = (D + 1) / 2 * 2;
  tf_vfi lane;
  for (int i = 0; i < 16; ++i) lane[i] = i;
  tf_bf16_gemm(t->p + i0 * BK, BK, t->q + i0 * dp, dp, t->kt, BK, mp - i0, BK, pairs, 0);
  tf_bf16_gemm(t->dp + i0 * BK, BK, t->dout + i0 * dp, dp, t->vt, BK, mp - i0, BK, pairs, 0);
  for (int64_t i = i0; i < mp; ++i) {
    float *s = t->p + i * BK, *ds = t->dp + i * BK;
    const int64_t limit = i >= nv ? 0 : p->causal ? min64(nk, r0 + i - k0 + 1) : nk;
    const float lse = t->lse[i], delta = t->delta[i];
    tf_vf g[BK / 16];
    TF_ATTN_UNROLL for (int c = 0; c < BK / 16; ++c) {
      /* Scaled before the mask: the scale may be zero or negative. */
      const tf_vf x = tf_vf_select(lane < (int32_t)(limit - 16 * c), tf_vf_load(s + 16 * c) * t->scale2,
                                   tf_vf_splat(-__builtin_inff()));
      const tf_vf pr = tf_vf_exp2(x - lse);
      g[c] = pr * (tf_vf_load(ds + 16 * c) * t->vscale - delta);
      tf_vf_store(s + 16 * c, pr);
      tf_vf_store(ds + 16 * c, g[c]);
    }
    TF_ATTN_UNROLL for (int c = 0; c < BK / 16; c += 2) tf_bf16_store_row(t->ds + i * BK + 16 * c, g[c], g[c + 1]);
  }
  if (!with_kv) return;
  for (int64_t i = i0; i < mp; i += 2)
    TF_ATTN_UNROLL for (int c = 0; c < BK / 16; ++c) {
      const int64_t at = i * BK + 16 * c;
      tf_bf16_store_pairs(t->pp + 2 * (i / 2 * BK + 16 * c), tf_vf_load(t->p + at), tf_vf_load(t->p + at + BK));
      tf_bf16_store_pairs(t->dsp + 2 * (i / 2 * BK + 16 * c), tf_vf_load(t->dp + at), tf_vf_load(t->dp + at + BK));
    }
}

/* dV^T += dout^T P and dK^T += q^T dS over the block's query rows [i0, mp) (raw q: dK takes the scale when stored). */
TF_ATTN_INLINE void block_dkdv(const bwd_scratch *tj, int64_t i0, int64_t nv, int64_t mp, int64_t dp) {
  (void)nv; /* rows [nv, mp) have P = dS = 0 */
  tf_bf16_gemm(tj->dv, BK, tj->doutt + i0, BQ, tj->pp + i0 * BK, BK, dp, BK, mp - i0, 1);
  tf_bf16_gemm(tj->dk, BK, tj->qt + i0, BQ, tj->dsp + i0 * BK, BK, dp, BK, mp - i0, 1);
}

/* dQ rows [i0, mp) (+)= dS k over the block's nk keys (raw k: k's descale is applied when added). */
TF_ATTN_INLINE void block_dq(const bwd_scratch *t, const bwd_scratch *tj, int64_t i0, int64_t mp,
                             int64_t nk, int64_t dp, int accumulate) {
  tf_bf16_gemm(t->dq + i0 * dp, dp, t->ds + i0 * BK, BK, tj->k, dp, mp - i0, dp, (nk + 1) / 2 * 2,
               accumulate);
}

/* The factors of dS k (dQ before softmax_scale) and of dS^T q (dK): k's descale; softmax_scale and q's descale. */
static float dq_descale(const tf_attn_operand *k) { return descale_of(k); }
static float dk_scale(const tf_attn_problem *p, const tf_attn_operand *q) {
  return p->softmax_scale * descale_of(q);
}

/* dK and dV rows [k0, k0 + nk) of kv head hk from the transposed accumulators of t. */
static void store_key_grads(const tf_attn_problem *p, const tf_attn_operand *q, const tf_attn_operand *dk,
                            const tf_attn_operand *dv, tf_attn_segment ks, int64_t hk, int64_t k0,
                            int64_t nk, const bwd_scratch *t) {
  const int64_t D = p->head_dim, dp = tf_attn_padded_dim(p);
  /* Blocks of 16 keys (BK is a multiple of 16) transposed into rows, dK's then dV's in dq (free after the walk). */
  float *dkr = t->dq, *dvr = t->dq + 16 * dp;
  for (int64_t j0 = 0; j0 < nk; j0 += 16) {
    const int64_t at = j0 / BK * BK * dp + j0 % BK;
    for (int64_t d = 0; d < dp; d += 16) {
      tf_f32_transpose16(t->dk + at + d * BK, BK, dkr + d, dp);
      tf_f32_transpose16(t->dv + at + d * BK, BK, dvr + d, dp);
    }
    for (int64_t j = j0; j < min64(j0 + 16, nk); ++j) {
      const int64_t row = ks.start + k0 + j;
      tf_attn_store_row(dk, tf_attn_row_offset(dk, ks.batch, row, hk), D, dk_scale(p, q),
                        dkr + (j - j0) * dp);
      tf_attn_store_row(dv, tf_attn_row_offset(dv, ks.batch, row, hk), D, 1.0f, dvr + (j - j0) * dp);
    }
  }
}

/* The bf16 packers zero every padding element themselves. */
static void clear_padding(const bwd_scratch *t, int64_t dp) { (void)t, (void)dp; }

#else
/* Keys [k0, k0 + nk): k (nk x dp), k^T and v^T (D x BK, zero past nk). */
TF_ATTN_INLINE void load_kv_tile(const tf_attn_operand *k, const tf_attn_operand *v,
                                 tf_attn_segment ks, int64_t hk, int64_t k0, int64_t nk,
                                 int64_t D, int64_t dp, const bwd_scratch *t) {
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t row = ks.start + k0 + j;
    float *kj = t->k + j * dp;
    tf_attn_load_row(k, tf_attn_row_offset(k, ks.batch, row, hk), D, 1.0f, kj);
    tf_attn_load_row(v, tf_attn_row_offset(v, ks.batch, row, hk), D, 1.0f, t->row);
    for (int64_t d = 0; d < D; ++d) {
      t->kt[d * BK + j] = kj[d];
      t->vt[d * BK + j] = t->row[d];
    }
  }
  for (int64_t d = 0; d < D; ++d)
    for (int64_t j = nk; j < BK; ++j) t->kt[d * BK + j] = t->vt[d * BK + j] = 0.0f;
}

/*
 * One (query tile, key tile) block, rows [i0, mp) of the query tile (i0 a
 * multiple of TF_ATTN_GEMM_ROWS): p <- probabilities (with dropout applied),
 * dp <- dS. Rows [nv, mp) are padding and get p = dS = 0.
 */
TF_ATTN_INLINE void block_grads(const tf_attn_problem *p, const bwd_scratch *t, int64_t i0,
                                int64_t nv, int64_t mp, int64_t nk, int64_t seg, int64_t h,
                                int64_t r0, int64_t k0, int64_t D, int64_t dp, int with_kv) {
  (void)with_kv;
  tf_attn_gemm(t->p + i0 * BK, BK, t->q + i0 * dp, dp, 1, t->kt, BK, mp - i0, BK, D, 0);
  tf_attn_gemm(t->dp + i0 * BK, BK, t->dout + i0 * dp, dp, 1, t->vt, BK, mp - i0, BK, D, 0);
  const int dropout = p->dropout_p > 0.0f;
  const tf_attn_dropout_key_t key = tf_attn_dropout_key(p->seed, p->offset);
  const uint32_t threshold = tf_attn_dropout_threshold(p->dropout_p);
  const float keep_scale = 1.0f / (1.0f - p->dropout_p);
  for (int64_t i = i0; i < mp; ++i) {
    float *s = t->p + i * BK, *ds = t->dp + i * BK;
    const int64_t limit = i >= nv ? 0 : p->causal ? min64(nk, r0 + i - k0 + 1) : nk;
    if (limit < BK) tf_attn_mask_tail(s, limit, BK);
    const float lse = t->lse[i], delta = t->delta[i];
    for (int c = 0; c < BK / TF_ATTN_VW; ++c) {
      const tf_vf pr = tf_vf_exp2(tf_vf_load(s + TF_ATTN_VW * c) - lse);
      tf_vf_store(s + TF_ATTN_VW * c, pr);
      if (!dropout) tf_vf_store(ds + TF_ATTN_VW * c, pr * (tf_vf_load(ds + TF_ATTN_VW * c) - delta));
    }
    if (!dropout) continue;
    /* dS = P * (mask * dP / (1 - p) - delta); dV takes mask * P / (1 - p). */
    for (int64_t j = 0; j < BK; ++j) {
      const int kept = i < nv && j < nk &&
                       tf_attn_dropout_bits(key, (uint32_t)seg, (uint32_t)h, (uint32_t)(r0 + i),
                                            (uint32_t)(k0 + j)) >= threshold;
      const float keep = kept ? keep_scale : 0.0f;
      ds[j] = s[j] * (ds[j] * keep - delta);
      s[j] *= keep;
    }
  }
}

/* Query rows [r0, r0 + nv) of head h: q (scaled), dout, lse (log2 units) and delta; rows up to mp are padding. */
TF_ATTN_INLINE void load_q_tile(const tf_attn_problem *p, const tf_attn_operand *q,
                                const tf_attn_operand *dout, const float *lse, const float *delta,
                                tf_attn_segment qs, int64_t h, int64_t r0, int64_t nv, int64_t mp,
                                int64_t D, int64_t dp, int with_kv, const bwd_scratch *t) {
  (void)with_kv;
  const float qscale = p->softmax_scale * LOG2E;
  for (int64_t i = 0; i < nv; ++i) {
    const int64_t row = qs.start + r0 + i;
    if (i + AHEAD < nv) {
      tf_attn_prefetch_row(q, tf_attn_row_offset(q, qs.batch, row + AHEAD, h), D, 0);
      tf_attn_prefetch_row(dout, tf_attn_row_offset(dout, qs.batch, row + AHEAD, h), D, 0);
    }
    tf_attn_load_row(q, tf_attn_row_offset(q, qs.batch, row, h), D, qscale, t->q + i * dp);
    tf_attn_load_row(dout, tf_attn_row_offset(dout, qs.batch, row, h), D, 1.0f, t->dout + i * dp);
    const float l = lse[tf_attn_stat_index(p, qs.batch, h, row)];
    t->lse[i] = l == -INFINITY ? INFINITY : l * LOG2E; /* a row without keys has P = 0 */
    t->delta[i] = delta[tf_attn_stat_index(p, qs.batch, h, row)];
  }
  for (int64_t i = nv; i < mp; ++i) {
    memset(t->q + i * dp, 0, (size_t)dp * sizeof(float));
    memset(t->dout + i * dp, 0, (size_t)dp * sizeof(float));
    t->lse[i] = INFINITY;
    t->delta[i] = 0.0f;
  }
}

/* Padding columns of the k, q and dout tiles stay zero for a whole unit. */
static void clear_padding(const bwd_scratch *t, int64_t dp) {
  memset(t->k, 0, (size_t)(KT * BK * dp) * sizeof(float));
  memset(t->q, 0, (size_t)(BQ * dp) * sizeof(float));
  memset(t->dout, 0, (size_t)(BQ * dp) * sizeof(float));
}


/* dV += P^T dout and dK += dS^T q over the block's valid query rows [i0, nv). */
TF_ATTN_INLINE void block_dkdv(const bwd_scratch *tj, int64_t i0, int64_t nv, int64_t mp, int64_t dp) {
  (void)mp;
  tf_attn_gemm(tj->dv, dp, tj->p + i0 * BK, 1, BK, tj->dout + i0 * dp, dp, BK, dp, nv - i0, 1);
  tf_attn_gemm(tj->dk, dp, tj->dp + i0 * BK, 1, BK, tj->q + i0 * dp, dp, BK, dp, nv - i0, 1);
}

/* dQ rows [i0, mp) (+)= dS k over the block's nk keys (unscaled). */
TF_ATTN_INLINE void block_dq(const bwd_scratch *t, const bwd_scratch *tj, int64_t i0, int64_t mp,
                             int64_t nk, int64_t dp, int accumulate) {
  tf_attn_gemm(t->dq + i0 * dp, dp, t->dp + i0 * BK, BK, 1, tj->k, dp, mp - i0, dp, nk, accumulate);
}

/* k is decoded with its descale: dS k is dQ before softmax_scale. */
static float dq_descale(const tf_attn_operand *k) {
  (void)k;
  return 1.0f;
}

/* q was scaled by softmax_scale * log2(e): dK = scale dS^T q = ln(2) dS^T (scaled q). */
static float dk_scale(const tf_attn_problem *p, const tf_attn_operand *q) {
  (void)p, (void)q;
  return LN2;
}

/* dK and dV rows [k0, k0 + nk) of kv head hk from the accumulators of t. */
static void store_key_grads(const tf_attn_problem *p, const tf_attn_operand *q, const tf_attn_operand *dk,
                            const tf_attn_operand *dv, tf_attn_segment ks, int64_t hk, int64_t k0,
                            int64_t nk, const bwd_scratch *t) {
  const int64_t D = p->head_dim, dp = tf_attn_padded_dim(p);
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t row = ks.start + k0 + j;
    tf_attn_store_row(dk, tf_attn_row_offset(dk, ks.batch, row, hk), D, dk_scale(p, q), t->dk + j * dp);
    tf_attn_store_row(dv, tf_attn_row_offset(dv, ks.batch, row, hk), D, 1.0f, t->dv + j * dp);
  }
}

#endif

/*
 * dK and dV of keys [k0, k0 + nk) of kv head hk, nk <= KT * BK, summed over
 * the query heads sharing it and the query tiles that see the keys; stores
 * them. When acc is not NULL, also adds dS k of every block into acc's rows
 * (unscaled dQ), or with `direct` (the keys are all the segment's) stores it
 * there as dQ. The keys are taken as up to KT key tiles in one walk over the
 * query tiles, so that each query tile's q and dout rows are loaded, and its
 * acc rows updated, once for all of them.
 */
TF_ATTN_INLINE void key_tile_grads(const tf_attn_problem *p, const tf_attn_operand *dout,
                                   const tf_attn_operand *q, const tf_attn_operand *k,
                                   const tf_attn_operand *v, const float *lse, const float *delta,
                                   const tf_attn_operand *acc, const tf_attn_operand *dk,
                                   const tf_attn_operand *dv, int64_t seg, int64_t hk, int64_t k0,
                                   int64_t nk, int direct, const bwd_scratch *t) {
  const int64_t D = p->head_dim, dp = tf_attn_padded_dim(p);
  const int64_t group = p->heads_q / p->heads_kv;
  const int64_t tiles = (nk + BK - 1) / BK;
  const tf_attn_segment qs = tf_attn_q_segment(p, seg), ks = tf_attn_kv_segment(p, seg);
  for (int64_t j = 0; j < tiles; ++j) {
    const bwd_scratch tj = key_tile(t, j, dp);
    load_kv_tile(k, v, ks, hk, k0 + j * BK, min64(BK, nk - j * BK), D, dp, &tj);
  }
  memset(t->dk, 0, (size_t)(tiles * BK * dp) * sizeof(float));
  memset(t->dv, 0, (size_t)(tiles * BK * dp) * sizeof(float));
  /* With causality the walk starts at query k0, the first that sees a key (tiles of BQ queries from there). */
  const int64_t first = p->causal ? k0 : 0;
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    for (int64_t r0 = first; r0 < qs.valid; r0 += BQ) {
      const int64_t nv = min64(BQ, qs.valid - r0);
      const int64_t mp = (nv + TF_ATTN_GEMM_ROWS - 1) / TF_ATTN_GEMM_ROWS * TF_ATTN_GEMM_ROWS;
      load_q_tile(p, q, dout, lse, delta, qs, h, r0, nv, mp, D, dp, 1, t);
      for (int64_t j = 0; j < tiles; ++j) {
        const bwd_scratch tj = key_tile(t, j, dp);
        const int64_t kj = k0 + j * BK, nkj = min64(BK, nk - j * BK);
        /*
         * With causality, rows of the query tile before query kj see none of
         * these keys: the block starts at the row block of query kj. That is
         * row 0 for the first key tile (the walk starts at query k0).
         */
        int64_t i0 = 0;
        if (p->causal && kj > r0) i0 = (kj - r0) / TF_ATTN_GEMM_ROWS * TF_ATTN_GEMM_ROWS;
        if (i0 >= nv) continue;
        block_grads(p, &tj, i0, nv, mp, nkj, seg, h, r0, kj, D, dp, 1);
        block_dkdv(&tj, i0, nv, mp, dp);
        if (acc) block_dq(t, &tj, i0, mp, nkj, dp, j > 0);
      }
      if (!acc) continue;
      const float kd = dq_descale(k);
      for (int64_t i = 0; i < nv; ++i) {
        if (i + AHEAD < nv)
          tf_attn_prefetch_row(acc, tf_attn_row_offset(acc, qs.batch, qs.start + r0 + i + AHEAD, h), D, 1);
        const int64_t at = tf_attn_row_offset(acc, qs.batch, qs.start + r0 + i, h);
        if (direct) {
          tf_attn_store_row(acc, at, D, p->softmax_scale * kd, t->dq + i * dp);
          continue;
        }
        float *restrict a = (float *)acc->data + at;
        const float *restrict g = t->dq + i * dp;
        for (int64_t d = 0; d < D; ++d) a[d] += kd * g[d];
      }
    }
  }
  store_key_grads(p, q, dk, dv, ks, hk, k0, nk, t);
}

/* Zeroes dk and dv rows [j0, j1) of a kv segment (keys past its valid length). */
static void zero_key_rows(const tf_attn_operand *dk, const tf_attn_operand *dv, tf_attn_segment ks,
                          int64_t hk, int64_t j0, int64_t j1, int64_t D) {
  for (int64_t j = j0; j < j1; ++j) {
    tf_attn_zero_row(dk, tf_attn_row_offset(dk, ks.batch, ks.start + j, hk), D);
    tf_attn_zero_row(dv, tf_attn_row_offset(dv, ks.batch, ks.start + j, hk), D);
  }
}

/*
 * The AMX path (attention_amx_bwd.c) for bf16 and E4M3 q/k/v with a bf16 dout
 * on a CPU with AMX; these wrappers keep the unit functions free of #if.
 */
static int amx_backward(const tf_attn_problem *p, const tf_attn_operand *q,
                        const tf_attn_operand *dout) {
#if TF_ATTN_AMX_BUILT
  return tf_attn_amx_bwd_applies(p, q, dout);
#else
  (void)p, (void)q, (void)dout;
  return 0;
#endif
}

static void amx_key_tile_grads(const tf_attn_problem *p, const tf_attn_operand *dout,
                               const tf_attn_operand *q, const tf_attn_operand *k,
                               const tf_attn_operand *v, const float *lse, const float *delta,
                               const tf_attn_operand *acc, const tf_attn_operand *dk,
                               const tf_attn_operand *dv, int64_t seg, int64_t hk, int64_t k0,
                               int64_t nk, float *scratch) {
#if TF_ATTN_AMX_BUILT
  tf_attn_amx_key_tile_grads(p, dout, q, k, v, lse, delta, acc, dk, dv, seg, hk, k0, nk, scratch);
#else
  (void)p, (void)dout, (void)q, (void)k, (void)v, (void)lse, (void)delta, (void)acc, (void)dk;
  (void)dv, (void)seg, (void)hk, (void)k0, (void)nk, (void)scratch;
#endif
}

static void amx_dq_rows(const tf_attn_problem *p, const tf_attn_operand *dout,
                        const tf_attn_operand *q, const tf_attn_operand *k,
                        const tf_attn_operand *v, const float *lse, const float *delta,
                        const tf_attn_operand *dq, int64_t seg, int64_t h, int64_t r0,
                        int64_t rows, int64_t kv_end, float *scratch) {
#if TF_ATTN_AMX_BUILT
  tf_attn_amx_dq_rows(p, dout, q, k, v, lse, delta, dq, seg, h, r0, rows, kv_end, scratch);
#else
  (void)p, (void)dout, (void)q, (void)k, (void)v, (void)lse, (void)delta, (void)dq, (void)seg;
  (void)h, (void)r0, (void)rows, (void)kv_end, (void)scratch;
#endif
}

/* Fused backward of one (sequence, kv head): dK, dV, and dQ of the query heads sharing it. */
TF_ATTN_INLINE void bwd_unit_body(const tf_attn_problem *p, const tf_attn_operand *dout,
                     const tf_attn_operand *q, const tf_attn_operand *k,
                     const tf_attn_operand *v, const float *lse, const float *delta,
                     const tf_attn_operand *acc, const tf_attn_operand *dq,
                     const tf_attn_operand *dk, const tf_attn_operand *dv, int64_t unit,
                     float *scratch) {
  const int64_t D = p->head_dim, dp = tf_attn_padded_dim(p);
  const int64_t group = p->heads_q / p->heads_kv;
  const int64_t seg = unit / p->heads_kv, hk = unit % p->heads_kv;
  const tf_attn_segment qs = tf_attn_q_segment(p, seg), ks = tf_attn_kv_segment(p, seg);
  const bwd_scratch t = split_scratch(scratch, p, q, k, v);
  const int amx = amx_backward(p, q, dout);
  /* One walk takes every key, and stores each query tile's dQ rows whole: acc is not needed. */
  const int direct = !amx && ks.valid > 0 && ks.valid <= KT * BK;

  for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
    for (int64_t i = direct ? qs.valid : 0; i < qs.span; ++i) {
      const tf_attn_operand *rows = direct ? dq : acc;
      tf_attn_zero_row(rows, tf_attn_row_offset(rows, qs.batch, qs.start + i, h), D);
    }
  zero_key_rows(dk, dv, ks, hk, ks.valid, ks.span, D);
  clear_padding(&t, dp);
  for (int64_t k0 = 0; k0 < ks.valid; k0 += KT * BK) {
    const int64_t nk = min64(KT * BK, ks.valid - k0);
    if (!amx) {
      key_tile_grads(p, dout, q, k, v, lse, delta, direct ? dq : acc, dk, dv, seg, hk, k0, nk, direct, &t);
      continue;
    }
    for (int64_t j0 = k0; j0 < k0 + nk; j0 += BK)
      amx_key_tile_grads(p, dout, q, k, v, lse, delta, acc, dk, dv, seg, hk, j0,
                         min64(BK, k0 + nk - j0), scratch);
  }
  if (direct) return;

  for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
    for (int64_t i = 0; i < qs.span; ++i) {
      const int64_t row = qs.start + i;
      float *a = (float *)acc->data + tf_attn_row_offset(acc, qs.batch, row, h);
      if (acc->data == dq->data) {
        for (int64_t d = 0; d < D; ++d) a[d] *= p->softmax_scale;
      } else {
        tf_attn_store_row(dq, tf_attn_row_offset(dq, qs.batch, row, h), D, p->softmax_scale, a);
      }
    }
}

/* Split backward, first pass: dK and dV of one (sequence, kv head, key tile). */
TF_ATTN_INLINE void dkdv_unit_body(const tf_attn_problem *p, const tf_attn_operand *dout,
                      const tf_attn_operand *q, const tf_attn_operand *k,
                      const tf_attn_operand *v, const float *lse, const float *delta,
                      const tf_attn_operand *dk, const tf_attn_operand *dv, int64_t unit,
                      int64_t tiles, float *scratch) {
  const int64_t D = p->head_dim, dp = tf_attn_padded_dim(p);
  const int64_t seg = unit / (p->heads_kv * tiles), hk = unit / tiles % p->heads_kv;
  const int64_t k0 = unit % tiles * BK;
  const tf_attn_segment ks = tf_attn_kv_segment(p, seg);
  if (k0 >= ks.span) return;
  const int64_t end = min64(k0 + BK, ks.span), nk = min64(end, ks.valid) - k0;
  zero_key_rows(dk, dv, ks, hk, nk > 0 ? k0 + nk : k0, end, D);
  if (nk <= 0) return;
  if (amx_backward(p, q, dout)) {
    amx_key_tile_grads(p, dout, q, k, v, lse, delta, NULL, dk, dv, seg, hk, k0, nk, scratch);
    return;
  }
  const bwd_scratch t = split_scratch(scratch, p, q, k, v);
  clear_padding(&t, dp);
  key_tile_grads(p, dout, q, k, v, lse, delta, NULL, dk, dv, seg, hk, k0, nk, 0, &t);
}

/* Split backward, second pass: dQ of one (sequence, query head, query tile), summed over its key tiles. */
TF_ATTN_INLINE void dq_unit_body(const tf_attn_problem *p, const tf_attn_operand *dout,
                    const tf_attn_operand *q, const tf_attn_operand *k, const tf_attn_operand *v,
                    const float *lse, const float *delta, const tf_attn_operand *dq,
                    int64_t unit, int64_t tiles, float *scratch) {
  const int64_t H = p->heads_q, D = p->head_dim, dp = tf_attn_padded_dim(p);
  const int64_t seg = unit / (H * tiles), h = unit / tiles % H, r0 = unit % tiles * BQ;
  const tf_attn_segment qs = tf_attn_q_segment(p, seg), ks = tf_attn_kv_segment(p, seg);
  if (r0 >= qs.span) return;
  const int64_t nr = min64(BQ, qs.span - r0);
  const int64_t nv = qs.valid - r0 < 0 ? 0 : min64(nr, qs.valid - r0);
  const int64_t kv_end = nv == 0 ? 0 : p->causal ? min64(ks.valid, r0 + nv) : ks.valid;
  const int64_t rows = kv_end > 0 ? nv : 0;
  for (int64_t i = rows; i < nr; ++i)
    tf_attn_zero_row(dq, tf_attn_row_offset(dq, qs.batch, qs.start + r0 + i, h), D);
  if (rows == 0) return;
  if (amx_backward(p, q, dout)) {
    amx_dq_rows(p, dout, q, k, v, lse, delta, dq, seg, h, r0, rows, kv_end, scratch);
    return;
  }
  const bwd_scratch t = split_scratch(scratch, p, q, k, v);
  const int64_t mp = (rows + TF_ATTN_GEMM_ROWS - 1) / TF_ATTN_GEMM_ROWS * TF_ATTN_GEMM_ROWS;
  const int64_t hk = h / (H / p->heads_kv);
  clear_padding(&t, dp);
  load_q_tile(p, q, dout, lse, delta, qs, h, r0, rows, mp, D, dp, 0, &t);
  memset(t.dq, 0, (size_t)(mp * dp) * sizeof(float));
  for (int64_t k0 = 0; k0 < kv_end; k0 += BK) {
    const int64_t nk = min64(BK, kv_end - k0);
    load_kv_tile(k, v, ks, hk, k0, nk, D, dp, &t);
    block_grads(p, &t, 0, rows, mp, nk, seg, h, r0, k0, D, dp, 0);
    block_dq(&t, &t, 0, mp, nk, dp, 1);
  }
  for (int64_t i = 0; i < rows; ++i)
    tf_attn_store_row(dq, tf_attn_row_offset(dq, qs.batch, qs.start + r0 + i, h), D,
                      p->softmax_scale * dq_descale(k), t.dq + i * dp);
}

/* Parameters and arguments of the unit functions, for their builds (TF_ATTN_VECTOR_CLONES, TF_ATTN_AVX2_BUILD). */
#define TF_ATTN_BWD_UNIT_PARAMS                                                               \
  (const tf_attn_problem *p, const tf_attn_operand *dout, const tf_attn_operand *q,           \
   const tf_attn_operand *k, const tf_attn_operand *v, const float *lse, const float *delta,  \
   const tf_attn_operand *acc, const tf_attn_operand *dq, const tf_attn_operand *dk,          \
   const tf_attn_operand *dv, int64_t unit, float *scratch)
#define TF_ATTN_BWD_UNIT_ARGS (p, dout, q, k, v, lse, delta, acc, dq, dk, dv, unit, scratch)
#define TF_ATTN_DKDV_UNIT_PARAMS                                                              \
  (const tf_attn_problem *p, const tf_attn_operand *dout, const tf_attn_operand *q,           \
   const tf_attn_operand *k, const tf_attn_operand *v, const float *lse, const float *delta,  \
   const tf_attn_operand *dk, const tf_attn_operand *dv, int64_t unit, int64_t tiles,         \
   float *scratch)
#define TF_ATTN_DKDV_UNIT_ARGS (p, dout, q, k, v, lse, delta, dk, dv, unit, tiles, scratch)
#define TF_ATTN_DQ_UNIT_PARAMS                                                                \
  (const tf_attn_problem *p, const tf_attn_operand *dout, const tf_attn_operand *q,           \
   const tf_attn_operand *k, const tf_attn_operand *v, const float *lse, const float *delta,  \
   const tf_attn_operand *dq, int64_t unit, int64_t tiles, float *scratch)
#define TF_ATTN_DQ_UNIT_ARGS (p, dout, q, k, v, lse, delta, dq, unit, tiles, scratch)

#endif /* TF_ATTENTION_BWD_BODY_H */
