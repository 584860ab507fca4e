/*
 * Attention backward on AMX tiles (bf16 and E4M3 q/k/v with a bf16 dout; see
 * attention_amx.h). The same units and outputs as attention_bwd.c; per
 * (query tile, key tile) block, with raw (undescaled) bf16 operands:
 *
 *   S  = Q K^T,  dP = dO V^T            tile products, float32 accumulation
 *   P  = 2^(S scale2 - lse log2(e)),    scale2 = softmax_scale log2(e) (x q, k descales)
 *   dS = P (dP v_descale - delta)       float32
 *   dV += P^T dO,  dK += dS^T Q,  dQ += dS K
 *                                       tile products of P and dS rounded to
 *                                       bf16, float32 accumulation; dK and dQ
 *                                       take softmax_scale and the q or k
 *                                       descale in float32 when stored.
 */
#pragma GCC optimize("fp-contract=fast", "no-tree-loop-distribute-patterns")

#include <math.h>

#include "attention_amx.h"

#if TF_ATTN_AMX_BUILT

#include "attention_amx_gemm.h"
#include "attention_amx_pack.h"

#define BQ TF_ATTN_BLOCK_Q
#define BK TF_ATTN_BLOCK_K
#define LOG2E 1.4426950408889634f

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static int64_t qk_width(const tf_attn_problem *p) { return tf_attn_amx_dim(p->head_dim); }
static int64_t vo_width(const tf_attn_problem *p) { return (p->head_dim + 15) / 16 * 16; }

/*
 * Per key tile: kt, vt (K^T, V^T as pairs over the head dim, [wq/2][BK][2]),
 * kp (K as pairs over keys, [BK/2][wv][2]). Per query tile: q, dout (rows,
 * BQ x wq), qp, dop (pairs over queries, [BQ/2][wv][2]), lse (log2 units),
 * delta. Per block: s, dp (16 x BK floats), pt, dst (P^T, dS^T: BK x BQ bf16),
 * ds (dS: BQ x BK bf16). Accumulators: dk, dv (BK x wv), dq (BQ x wv).
 */
typedef struct amx_bwd_scratch {
  float *dk, *dv, *dq, *s, *dp, *lse, *delta;
  uint16_t *kt, *vt, *kp, *q, *dout, *qp, *dop, *pt, *dst, *ds;
} amx_bwd_scratch;

static amx_bwd_scratch split_scratch(float *base, int64_t wq, int64_t wv) {
  amx_bwd_scratch t;
  t.dk = base;
  t.dv = t.dk + BK * wv;
  t.dq = t.dv + BK * wv;
  t.s = t.dq + BQ * wv;
  t.dp = t.s + 16 * BK;
  t.lse = t.dp + 16 * BK;
  t.delta = t.lse + BQ;
  t.kt = (uint16_t *)(t.delta + BQ);
  t.vt = t.kt + wq * BK;
  t.kp = t.vt + wq * BK;
  t.q = t.kp + BK * wv;
  t.dout = t.q + BQ * wq;
  t.qp = t.dout + BQ * wq;
  t.dop = t.qp + BQ * wv;
  t.pt = t.dop + BQ * wv;
  t.dst = t.pt + BK * BQ;
  t.ds = t.dst + BK * BQ;
  return t;
}

int64_t tf_attn_amx_bwd_scratch_floats(const tf_attn_problem *p) {
  const int64_t wq = qk_width(p), wv = vo_width(p);
  return 2 * BK * wv + BQ * wv + 32 * BK + 2 * BQ +
         (2 * wq * BK + BK * wv + 2 * BQ * wq + 2 * BQ * wv + 3 * BK * BQ) / 2;
}

/* Keys [k0, k0 + nk) of kv head hk: kt, vt, and kp when the block computes dQ. */
static void pack_key_tile(const tf_attn_problem *p, const tf_attn_operand *k,
                          const tf_attn_operand *v, tf_attn_segment ks, int64_t hk, int64_t k0,
                          int64_t nk, int with_dq, const amx_bwd_scratch *t) {
  const int64_t D = p->head_dim, wq = qk_width(p), wv = vo_width(p);
  const int64_t ko = tf_attn_row_offset(k, ks.batch, ks.start + k0, hk);
  const int64_t vo = tf_attn_row_offset(v, ks.batch, ks.start + k0, hk);
  tf_amx_pack_transposed(k, ko, k->stride_s, nk, BK, D, wq, t->kt);
  tf_amx_pack_transposed(v, vo, v->stride_s, nk, BK, D, wq, t->vt);
  if (with_dq) tf_amx_pack_pairs(k, ko, k->stride_s, nk, BK, D, wv, t->kp);
}

/*
 * Query rows [r0, r0 + nv) of head h (rows up to nq are zero): q and dout
 * rows, their pairs when the block computes dK and dV, lse and delta.
 */
static void pack_query_tile(const tf_attn_problem *p, const tf_attn_operand *q,
                            const tf_attn_operand *dout, const float *lse, const float *delta,
                            tf_attn_segment qs, int64_t h, int64_t r0, int64_t nv, int64_t nq,
                            int with_kv, const amx_bwd_scratch *t) {
  const int64_t D = p->head_dim, wq = qk_width(p), wv = vo_width(p);
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t row = qs.start + r0 + i;
    if (i < nv) {
      tf_amx_pack_row(q, tf_attn_row_offset(q, qs.batch, row, h), D, wq, t->q + i * wq);
      tf_amx_pack_row(dout, tf_attn_row_offset(dout, qs.batch, row, h), D, wq, t->dout + i * wq);
      const float l = lse[tf_attn_stat_index(p, qs.batch, h, row)];
      t->lse[i] = l == -INFINITY ? INFINITY : l * LOG2E; /* a row without keys has P = 0 */
      t->delta[i] = delta[tf_attn_stat_index(p, qs.batch, h, row)];
    } else {
      memset(t->q + i * wq, 0, (size_t)wq * sizeof(uint16_t));
      memset(t->dout + i * wq, 0, (size_t)wq * sizeof(uint16_t));
      t->lse[i] = INFINITY;
      t->delta[i] = 0.0f;
    }
  }
  if (!with_kv) return;
  const int64_t first = tf_attn_row_offset(q, qs.batch, qs.start + r0, h);
  tf_amx_pack_pairs(q, first, q->stride_s, nv, nq, D, wv, t->qp);
  tf_amx_pack_pairs(dout, tf_attn_row_offset(dout, qs.batch, qs.start + r0, h), dout->stride_s, nv,
                    nq, D, wv, t->dop);
}

/*
 * P and dS of query rows [0, nq) (of the tile starting at sequence row r0,
 * nv of them real) against keys [k0, k0 + nk): dS into ds (rows), and with
 * with_kv P^T and dS^T into pt and dst (columns). Rows and keys hidden from
 * each other get P = dS = 0.
 */
TF_ATTN_INLINE void block_probs(const tf_attn_problem *p, const amx_bwd_scratch *t, int64_t r0,
                                int64_t nv, int64_t nq, int64_t k0, int64_t nk, float scale2,
                                float vscale, int with_kv) {
  const int64_t wq = qk_width(p);
  tf_vfi lane;
  for (int i = 0; i < 16; ++i) lane[i] = i;
  for (int64_t i0 = 0; i0 < nq; i0 += 16) {
    const int64_t seen = i0 >= nv ? 0 : p->causal ? min64(nk, r0 + i0 + 16 - k0) : nk;
    const int64_t blocks = seen <= 0 ? 0 : (seen + 15) / 16;
    if (blocks > 0) {
      tf_amx_times_transposed(t->s, BK, t->q + i0 * wq, wq, t->kt, BK, wq, blocks);
      tf_amx_times_transposed(t->dp, BK, t->dout + i0 * wq, wq, t->vt, BK, wq, blocks);
    }
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t r = i0 + i;
      const int64_t limit = r >= nv ? 0 : p->causal ? min64(nk, r0 + r - k0 + 1) : nk;
      const float lse = t->lse[r], delta = t->delta[r];
      uint16_t *ds = t->ds + r * BK;
      for (int64_t c = 0; c < BK / 16; ++c) {
        tf_vf pr = tf_vf_splat(0.0f), g = tf_vf_splat(0.0f);
        if (c < blocks) {
          const tf_vf x = tf_vf_select(lane < (int32_t)(limit - 16 * c),
                                         tf_vf_load(t->s + i * BK + 16 * c) * scale2,
                                         tf_vf_splat(-__builtin_inff()));
          pr = tf_vf_exp2(x - lse);
          g = pr * (tf_vf_load(t->dp + i * BK + 16 * c) * vscale - delta);
        }
        const tf_v16h gh = tf_amx_to_bf16(g);
        memcpy(ds + 16 * c, &gh, sizeof gh);
        if (!with_kv) continue;
        const tf_v16h ph = tf_amx_to_bf16(pr);
        for (int e = 0; e < 16; ++e) {
          t->pt[(16 * c + e) * BQ + r] = ph[e];
          t->dst[(16 * c + e) * BQ + r] = gh[e];
        }
      }
    }
  }
}

/* dQ rows [0, nq) += dS k (raw k; the caller applies softmax_scale and k's descale). */
TF_ATTN_INLINE void block_dq(const amx_bwd_scratch *t, int64_t nq, int64_t wv) {
  for (int64_t i0 = 0; i0 < nq; i0 += 16)
    tf_amx_times_pairs(t->dq + i0 * wv, wv, t->ds + i0 * BK, BK, t->kp, wv, BK / TF_ATTN_AMX_K);
}

/* dV += P^T dO and dK += dS^T q (raw q) for the tile's keys, over query rows [0, nq) (nq a multiple of 32). */
TF_ATTN_INLINE void block_dkdv(const amx_bwd_scratch *t, int64_t nq, int64_t wv) {
  const int64_t steps = nq / TF_ATTN_AMX_K;
  for (int64_t j0 = 0; j0 < BK; j0 += 16) {
    tf_amx_times_pairs(t->dv + j0 * wv, wv, t->pt + j0 * BQ, BQ, t->dop, wv, steps);
    tf_amx_times_pairs(t->dk + j0 * wv, wv, t->dst + j0 * BQ, BQ, t->qp, wv, steps);
  }
}

static float scale2_of(const tf_attn_problem *p, const tf_attn_operand *q, const tf_attn_operand *k) {
  const int fp8 = q->elem == TF_ATTN_E4M3;
  return p->softmax_scale * LOG2E * (fp8 ? q->descale * k->descale : 1.0f);
}

TF_ATTN_AMX_TARGET
void tf_attn_amx_key_tile_grads(const tf_attn_problem *p, const tf_attn_operand *dout,
                                const tf_attn_operand *q, const tf_attn_operand *k,
                                const tf_attn_operand *v, const float *lse, const float *delta,
                                const tf_attn_operand *acc, const tf_attn_operand *dk,
                                const tf_attn_operand *dv, int64_t seg, int64_t hk, int64_t k0,
                                int64_t nk, float *scratch) {
  const int64_t D = p->head_dim, wq = qk_width(p), wv = vo_width(p);
  const int64_t group = p->heads_q / p->heads_kv;
  const tf_attn_segment qs = tf_attn_q_segment(p, seg), ks = tf_attn_kv_segment(p, seg);
  const amx_bwd_scratch t = split_scratch(scratch, wq, wv);
  const int fp8 = q->elem == TF_ATTN_E4M3;
  const float scale2 = scale2_of(p, q, k), vscale = fp8 ? v->descale : 1.0f;
  const float kscale = fp8 ? k->descale : 1.0f, qscale = fp8 ? q->descale : 1.0f;
  pack_key_tile(p, k, v, ks, hk, k0, nk, acc != NULL, &t);
  memset(t.dk, 0, (size_t)(BK * wv) * sizeof(float));
  memset(t.dv, 0, (size_t)(BK * wv) * sizeof(float));
  AMX_CONFIGURE();
  const int64_t first = p->causal ? k0 / BQ * BQ : 0;
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    for (int64_t r0 = first; r0 < qs.valid; r0 += BQ) {
      const int64_t nv = min64(BQ, qs.valid - r0), nq = (nv + 31) / 32 * 32;
      pack_query_tile(p, q, dout, lse, delta, qs, h, r0, nv, nq, 1, &t);
      block_probs(p, &t, r0, nv, nq, k0, nk, scale2, vscale, 1);
      block_dkdv(&t, nq, wv);
      if (!acc) continue;
      memset(t.dq, 0, (size_t)(nq * wv) * sizeof(float));
      block_dq(&t, nq, wv);
      for (int64_t i = 0; i < nv; ++i) {
        float *restrict a =
            (float *)acc->data + tf_attn_row_offset(acc, qs.batch, qs.start + r0 + i, h);
        const float *restrict g = t.dq + i * wv;
        for (int64_t d = 0; d < D; ++d) a[d] += kscale * g[d];
      }
    }
  }
  AMX_RELEASE();
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t row = ks.start + k0 + j;
    tf_attn_store_row(dk, tf_attn_row_offset(dk, ks.batch, row, hk), D, p->softmax_scale * qscale,
                      t.dk + j * wv);
    tf_attn_store_row(dv, tf_attn_row_offset(dv, ks.batch, row, hk), D, 1.0f, t.dv + j * wv);
  }
}

TF_ATTN_AMX_TARGET
void tf_attn_amx_dq_rows(const tf_attn_problem *p, const tf_attn_operand *dout,
                         const tf_attn_operand *q, const tf_attn_operand *k,
                         const tf_attn_operand *v, const float *lse, const float *delta,
                         const tf_attn_operand *dq, int64_t seg, int64_t h, int64_t r0,
                         int64_t rows, int64_t kv_end, float *scratch) {
  const int64_t D = p->head_dim, wq = qk_width(p), wv = vo_width(p);
  const tf_attn_segment qs = tf_attn_q_segment(p, seg), ks = tf_attn_kv_segment(p, seg);
  const amx_bwd_scratch t = split_scratch(scratch, wq, wv);
  const int64_t hk = h / (p->heads_q / p->heads_kv), nq = (rows + 31) / 32 * 32;
  const int fp8 = q->elem == TF_ATTN_E4M3;
  const float scale2 = scale2_of(p, q, k), vscale = fp8 ? v->descale : 1.0f;
  const float kscale = fp8 ? k->descale : 1.0f;
  pack_query_tile(p, q, dout, lse, delta, qs, h, r0, rows, nq, 0, &t);
  memset(t.dq, 0, (size_t)(nq * wv) * sizeof(float));
  AMX_CONFIGURE();
  for (int64_t k0 = 0; k0 < kv_end; k0 += BK) {
    const int64_t nk = min64(BK, kv_end - k0);
    pack_key_tile(p, k, v, ks, hk, k0, nk, 1, &t);
    block_probs(p, &t, r0, rows, nq, k0, nk, scale2, vscale, 0);
    block_dq(&t, nq, wv);
  }
  AMX_RELEASE();
  for (int64_t i = 0; i < rows; ++i)
    tf_attn_store_row(dq, tf_attn_row_offset(dq, qs.batch, qs.start + r0 + i, h), D,
                      p->softmax_scale * kscale, t.dq + i * wv);
}

#endif /* TF_ATTN_AMX_BUILT */
