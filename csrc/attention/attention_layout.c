/* Problem checks, sequence segments and work-unit counts of the attention kernels. */
#include <math.h>

#include "../common/tf_checks.h"
#include "attention_amx.h"
#include "attention_bf16.h"
#include "attention_internal.h"

static int is_packed(const tf_attn_problem *p) { return p->cu_seqlens_q != NULL; }

/* cu[0] == 0, non-decreasing, cu[n] <= tokens. */
static int cu_seqlens_ok(const int32_t *cu, int64_t n, int64_t tokens) {
  if (cu[0] != 0) return 0;
  for (int64_t i = 0; i < n; ++i)
    if (cu[i + 1] < cu[i]) return 0;
  return cu[n] <= tokens;
}

static int seqlens_ok(const int32_t *lens, int64_t n, int64_t seq) {
  if (!lens) return 1;
  for (int64_t i = 0; i < n; ++i)
    if (lens[i] < 0 || lens[i] > seq) return 0;
  return 1;
}

tf_status tf_attn_check(const tf_attn_problem *p) {
  if (!p) return TF_ERR_NULL_POINTER;
  if (p->batch < 0 || p->seq_q < 0 || p->seq_kv < 0 || p->heads_q <= 0 || p->heads_kv <= 0 ||
      p->head_dim <= 0)
    return TF_ERR_BAD_SIZE;
  if (p->heads_q % p->heads_kv) return TF_ERR_BAD_SIZE;
  /* Keeps the tile scratch sizes (a few tiles of head_dim x 128 floats) far from overflow. */
  if (p->head_dim > TF_ATTN_MAX_HEAD_DIM) return TF_ERR_BAD_SIZE;
  /* lse is [B, Hq, Sq]; keys and rows are indexed as uint32 by the dropout RNG. */
  if (!tf_mul_fits(p->batch, p->heads_q) || !tf_mul_fits(p->batch * p->heads_q, p->seq_q))
    return TF_ERR_OVERFLOW;
  if (p->seq_q > UINT32_MAX || p->seq_kv > UINT32_MAX || p->heads_q > UINT32_MAX ||
      p->batch > UINT32_MAX)
    return TF_ERR_OVERFLOW;
  if ((p->cu_seqlens_q == NULL) != (p->cu_seqlens_kv == NULL)) return TF_ERR_BAD_ARGUMENT;
  if (is_packed(p)) {
    if (p->batch != 1 || p->num_seqs < 0 || p->num_seqs > UINT32_MAX - 1) return TF_ERR_BAD_SIZE;
    if (p->seqlens_q || p->seqlens_kv) return TF_ERR_BAD_ARGUMENT;
    if (!cu_seqlens_ok(p->cu_seqlens_q, p->num_seqs, p->seq_q) ||
        !cu_seqlens_ok(p->cu_seqlens_kv, p->num_seqs, p->seq_kv))
      return TF_ERR_BAD_SIZE;
  } else if (!seqlens_ok(p->seqlens_q, p->batch, p->seq_q) ||
             !seqlens_ok(p->seqlens_kv, p->batch, p->seq_kv)) {
    return TF_ERR_BAD_SIZE;
  }
  /* Work units: segments x query heads x query tiles, segments x kv heads x key tiles. */
  const int64_t segments = is_packed(p) ? p->num_seqs + 1 : p->batch;
  if (!tf_mul_fits(segments, p->heads_q) ||
      !tf_mul_fits(segments * p->heads_q, p->seq_q / TF_ATTN_BLOCK_Q + 1) ||
      !tf_mul_fits(segments * p->heads_kv, p->seq_kv / TF_ATTN_BLOCK_K + 1))
    return TF_ERR_OVERFLOW;
  if (!isfinite(p->softmax_scale)) return TF_ERR_BAD_ARGUMENT;
  if (!(p->dropout_p >= 0.0f && p->dropout_p < 1.0f)) return TF_ERR_BAD_ARGUMENT;
  return TF_OK;
}

tf_status tf_attn_check_operand(const tf_attn_problem *p, const tf_attn_operand *op, int64_t seq,
                                int64_t heads, int is_output) {
  if (!op) return TF_ERR_NULL_POINTER;
  if (op->elem != TF_ATTN_F32 && op->elem != TF_ATTN_BF16 && op->elem != TF_ATTN_F16 &&
      op->elem != TF_ATTN_E4M3)
    return TF_ERR_BAD_DTYPE;
  if (is_output && op->elem == TF_ATTN_E4M3) return TF_ERR_BAD_DTYPE;
  if (op->stride_b < 0 || op->stride_s < 0 || op->stride_h < 0) return TF_ERR_BAD_SIZE;
  const int64_t dims[3] = {p->batch, seq, heads};
  const int64_t strides[3] = {op->stride_b, op->stride_s, op->stride_h};
  int64_t extent = p->head_dim;
  int any_empty = 0;
  for (int i = 0; i < 3; ++i) {
    if (dims[i] == 0) any_empty = 1;
    if (dims[i] > 0 && !tf_mul_fits(dims[i] - 1, strides[i])) return TF_ERR_OVERFLOW;
    const int64_t span = dims[i] > 0 ? (dims[i] - 1) * strides[i] : 0;
    if (span > INT64_MAX - extent) return TF_ERR_OVERFLOW;
    extent += span;
  }
  if (!any_empty && !op->data) return TF_ERR_NULL_POINTER;
  return TF_OK;
}

int64_t tf_attn_num_segments(const tf_attn_problem *p) {
  return is_packed(p) ? p->num_seqs + 1 : p->batch;
}

static tf_attn_segment segment(const tf_attn_problem *p, int64_t seg, const int32_t *cu,
                               const int32_t *lens, int64_t seq) {
  tf_attn_segment s;
  if (cu) {
    s.batch = 0;
    s.start = cu[seg];
    s.span = (seg < p->num_seqs ? cu[seg + 1] : seq) - s.start;
    s.valid = seg < p->num_seqs ? s.span : 0;
  } else {
    s.batch = seg;
    s.start = 0;
    s.span = seq;
    s.valid = lens ? lens[seg] : seq;
  }
  return s;
}

tf_attn_segment tf_attn_q_segment(const tf_attn_problem *p, int64_t seg) {
  return segment(p, seg, p->cu_seqlens_q, p->seqlens_q, p->seq_q);
}

tf_attn_segment tf_attn_kv_segment(const tf_attn_problem *p, int64_t seg) {
  return segment(p, seg, p->cu_seqlens_kv, p->seqlens_kv, p->seq_kv);
}

int64_t tf_attn_max_q_span(const tf_attn_problem *p) {
  if (!is_packed(p)) return p->seq_q;
  int64_t m = 0;
  for (int64_t s = 0; s <= p->num_seqs; ++s) {
    const int64_t span = tf_attn_q_segment(p, s).span;
    m = span > m ? span : m;
  }
  return m;
}

int64_t tf_attn_max_kv_span(const tf_attn_problem *p) {
  if (!is_packed(p)) return p->seq_kv;
  int64_t m = 0;
  for (int64_t s = 0; s <= p->num_seqs; ++s) {
    const int64_t span = tf_attn_kv_segment(p, s).span;
    m = span > m ? span : m;
  }
  return m;
}

int64_t tf_attn_q_tiles(const tf_attn_problem *p) {
  return (tf_attn_max_q_span(p) + TF_ATTN_BLOCK_Q - 1) / TF_ATTN_BLOCK_Q;
}

int64_t tf_attn_fwd_units(const tf_attn_problem *p) {
  return tf_attn_num_segments(p) * p->heads_q * tf_attn_q_tiles(p);
}

int64_t tf_attn_rowdot_units(const tf_attn_problem *p) { return tf_attn_num_segments(p) * tf_attn_q_tiles(p); }

int64_t tf_attn_bwd_units(const tf_attn_problem *p) {
  return tf_attn_num_segments(p) * p->heads_kv;
}

/* Head dim rounded up to the 16-float vectors of the tile kernels. */
int64_t tf_attn_padded_dim(const tf_attn_problem *p) { return (p->head_dim + 15) / 16 * 16; }

int64_t tf_attn_fwd_scratch_floats(const tf_attn_problem *p) {
  const int64_t dp = tf_attn_padded_dim(p);
  /* For a block of query rows: q^T and o, k and v tiles, transposed scores, max, sum and rescale per query. */
  const int64_t rows = TF_ATTN_FWD_ROWS, ld = TF_ATTN_FWD_LD;
  const int64_t f32 = dp * ld + rows * dp + dp * TF_ATTN_BLOCK_K * 2 + TF_ATTN_BLOCK_K * ld + 3 * rows;
  /* The bf16 products' tiles (attention_bf16.h), with P^T in bf16 too. */
  const int64_t bf16 = tf_attn_bf16_fwd_scratch_floats(p);
  const int64_t vector = bf16 > f32 ? bf16 : f32;
#if TF_ATTN_AMX_BUILT
  /* The AMX path's need (attention_amx_fwd.c), for head dims it takes. */
  if (p->head_dim <= TF_ATTN_AMX_MAX_DIM) {
    const int64_t amx = tf_attn_amx_fwd_scratch_floats(p);
    return amx > vector ? amx : vector;
  }
#endif
  return vector;
}

int64_t tf_attn_bwd_scratch_floats(const tf_attn_problem *p) {
  const int64_t dp = tf_attn_padded_dim(p);
  /* k, k^T, v^T, dk, dv of TF_ATTN_BWD_KEY_TILES key tiles; q, dout, dq tiles; p, dp tiles; lse and delta; one staging row. */
  const int64_t f32 = TF_ATTN_BWD_KEY_TILES * TF_ATTN_BLOCK_K * dp * 5 + TF_ATTN_BLOCK_Q * dp * 3 +
                      2 * TF_ATTN_BLOCK_Q * TF_ATTN_BLOCK_K + 2 * TF_ATTN_BLOCK_Q + dp;
  /* The bf16 products' tiles (attention_bf16.h). */
  const int64_t bf16 = tf_attn_bf16_bwd_scratch_floats(p);
  const int64_t vector = bf16 > f32 ? bf16 : f32;
#if TF_ATTN_AMX_BUILT
  /* The AMX path's need (attention_amx_bwd.c), for head dims it takes. */
  if (p->head_dim <= TF_ATTN_AMX_MAX_DIM) {
    const int64_t amx = tf_attn_amx_bwd_scratch_floats(p);
    return amx > vector ? amx : vector;
  }
#endif
  return vector;
}
