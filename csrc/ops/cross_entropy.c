#include "cross_entropy.h"

#include "ops_tile.h"

#include <math.h>

/* exp(v) for v = x - m <= 0; 0 past tf_ops_expf's clamp (and for v = -inf), so that softmax entries far
   below the maximum are 0 as in torch rather than exp(-87). */
TF_ISA_INLINE float exp_nonpositive(float v) {
  const float e = tf_ops_expf(v);
  return v < -TF_OPS_EXP_LIMIT ? 0.0f : e;
}

/* The target's column on this rank, or -1 when it lies on another rank or the row is ignored. */
static inline int64_t local_column(int64_t t, int64_t vocab_start, int64_t cols, int64_t ignore_index) {
  if (t == ignore_index) return -1;
  const int64_t c = t - vocab_start; /* no overflow: both lie in [0, vocab_size) by the checks */
  return c >= 0 && c < cols ? c : -1;
}

static tf_status check_args(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, const int64_t *target,
                            int64_t vocab_start, int64_t vocab_size, int64_t row_begin, int64_t row_end) {
  if (!tf_ops_dtype_ok(dtype)) return TF_ERR_BAD_DTYPE;
  const tf_status s = tf_ops_check_rows(rows, cols, row_begin, row_end);
  if (s != TF_OK) return s;
  if (vocab_start < 0 || vocab_size < 1 || cols > vocab_size || vocab_start > vocab_size - cols)
    return TF_ERR_BAD_SIZE;
  if (row_end > row_begin && (!target || (cols > 0 && !x))) return TF_ERR_NULL_POINTER;
  return TF_OK;
}

static int target_ok(int64_t t, int64_t vocab_size, int64_t ignore_index) {
  return t == ignore_index || (t >= 0 && t < vocab_size);
}

/* m, d, x_sum of one row of n elements. */
TF_ISA_INLINE void row_stats_body(const void *x, tf_dtype dtype, int64_t offset, int64_t n, float *m_out,
                                  float *d_out, float *sum_out) {
  float tile[TF_OPS_TILE];
  float m = -INFINITY, sum = 0.0f;
  for (int64_t c0 = 0; c0 < n; c0 += TF_OPS_TILE) {
    const int64_t w = n - c0 < TF_OPS_TILE ? n - c0 : TF_OPS_TILE;
    tf_ops_load(x, dtype, offset + c0, w, tile);
    for (int64_t i = 0; i < w; ++i) {
      m = tile[i] > m ? tile[i] : m;
      sum += tile[i];
    }
  }
  float d = 0.0f;
  for (int64_t c0 = 0; c0 < n; c0 += TF_OPS_TILE) {
    const int64_t w = n - c0 < TF_OPS_TILE ? n - c0 : TF_OPS_TILE;
    tf_ops_load(x, dtype, offset + c0, w, tile);
    for (int64_t i = 0; i < w; ++i) d += exp_nonpositive(tile[i] - m);
  }
  *m_out = m;
  *d_out = d;
  *sum_out = sum;
}

TF_ISA_CLONES(row_stats,
              (const void *x, tf_dtype dtype, int64_t offset, int64_t n, float *m_out, float *d_out,
               float *sum_out),
              (x, dtype, offset, n, m_out, d_out, sum_out))

tf_status tf_cross_entropy_stats(const void *x, tf_dtype dtype, int64_t rows, int64_t cols,
                                 const int64_t *target, int64_t vocab_start, int64_t vocab_size,
                                 int64_t ignore_index, int64_t row_begin, int64_t row_end, float *stats) {
  tf_status s = check_args(x, dtype, rows, cols, target, vocab_start, vocab_size, row_begin, row_end);
  if (s != TF_OK) return s;
  if (row_end > row_begin && !stats) return TF_ERR_NULL_POINTER;
  if (!tf_mul_fits(rows, 4)) return TF_ERR_OVERFLOW;
  for (int64_t r = row_begin; r < row_end; ++r)
    if (!target_ok(target[r], vocab_size, ignore_index)) return TF_ERR_BAD_ARGUMENT;
  for (int64_t r = row_begin; r < row_end; ++r) {
    float *st = stats + 4 * r;
    row_stats(x, dtype, r * cols, cols, &st[0], &st[1], &st[3]);
    const int64_t c = local_column(target[r], vocab_start, cols, ignore_index);
    float xt = 0.0f;
    if (c >= 0) tf_ops_load(x, dtype, r * cols + c, 1, &xt);
    st[2] = xt;
  }
  return TF_OK;
}

/* dx of one row: scale * (exp(x - lse) - smoothing), the target column then lowered by scale * on_target. */
TF_ISA_INLINE void row_grad_body(const void *x, tf_dtype dtype, int64_t offset, int64_t n, float lse,
                                 float scale, float smoothing, void *dx, tf_dtype dx_dtype) {
  float tile[TF_OPS_TILE];
  for (int64_t c0 = 0; c0 < n; c0 += TF_OPS_TILE) {
    const int64_t w = n - c0 < TF_OPS_TILE ? n - c0 : TF_OPS_TILE;
    tf_ops_load(x, dtype, offset + c0, w, tile);
    for (int64_t i = 0; i < w; ++i) tile[i] = scale * (exp_nonpositive(tile[i] - lse) - smoothing);
    tf_ops_store_dtype(dx, dx_dtype, offset + c0, w, tile);
  }
}

TF_ISA_CLONES(row_grad,
              (const void *x, tf_dtype dtype, int64_t offset, int64_t n, float lse, float scale, float smoothing,
               void *dx, tf_dtype dx_dtype),
              (x, dtype, offset, n, lse, scale, smoothing, dx, dx_dtype))

tf_status tf_cross_entropy_backward(const void *x, tf_dtype dtype, int64_t rows, int64_t cols,
                                    const int64_t *target, int64_t vocab_start, int64_t vocab_size,
                                    int64_t ignore_index, const float *lse, const float *scale,
                                    float smoothing, float on_target, int64_t row_begin, int64_t row_end,
                                    void *dx, tf_dtype dx_dtype) {
  tf_status s = check_args(x, dtype, rows, cols, target, vocab_start, vocab_size, row_begin, row_end);
  if (s != TF_OK) return s;
  if (!tf_ops_dtype_ok(dx_dtype)) return TF_ERR_BAD_DTYPE;
  if (row_end > row_begin && (!lse || !scale || (cols > 0 && !dx))) return TF_ERR_NULL_POINTER;
  for (int64_t r = row_begin; r < row_end; ++r)
    if (!target_ok(target[r], vocab_size, ignore_index)) return TF_ERR_BAD_ARGUMENT;
  for (int64_t r = row_begin; r < row_end; ++r) {
    if (target[r] == ignore_index) { /* no loss, so zeros (even where x is not finite) */
      const float zeros[TF_OPS_TILE] = {0};
      for (int64_t c0 = 0; c0 < cols; c0 += TF_OPS_TILE)
        tf_ops_store_dtype(dx, dx_dtype, r * cols + c0, cols - c0 < TF_OPS_TILE ? cols - c0 : TF_OPS_TILE, zeros);
      continue;
    }
    row_grad(x, dtype, r * cols, cols, lse[r], scale[r], smoothing, dx, dx_dtype);
    const int64_t c = local_column(target[r], vocab_start, cols, ignore_index);
    if (c >= 0) {
      float v = 0.0f;
      tf_ops_load(x, dtype, r * cols + c, 1, &v);
      v = scale[r] * (exp_nonpositive(v - lse[r]) - smoothing - on_target);
      tf_ops_store_dtype(dx, dx_dtype, r * cols + c, 1, &v);
    }
  }
  return TF_OK;
}
