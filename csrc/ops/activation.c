#include "activation.h"

#include "ops_tile.h"

/* v[i] = act(v[i]); one loop per activation, so each vectorizes. */
TF_ISA_INLINE void act_forward_tile(tf_activation act, int64_t n, float *restrict v) {
  switch (act) {
#define FORWARD_LOOP(code, f, grad)                      \
  case code:                                             \
    for (int64_t i = 0; i < n; ++i) v[i] = f(v[i]);      \
    break;
    TF_OPS_ACTIVATIONS(FORWARD_LOOP)
#undef FORWARD_LOOP
    default:
      break;
  }
}

/* g[i] = g[i] * act'(x[i]). */
TF_ISA_INLINE void act_backward_tile(tf_activation act, int64_t n, const float *restrict x,
                                     float *restrict g) {
  switch (act) {
#define BACKWARD_LOOP(code, f, grad)                         \
  case code:                                                 \
    for (int64_t i = 0; i < n; ++i) g[i] = grad(x[i], g[i]); \
    break;
    TF_OPS_ACTIVATIONS(BACKWARD_LOOP)
#undef BACKWARD_LOOP
    default:
      break;
  }
}

TF_ISA_INLINE void add_bias_tile(const void *bias, tf_dtype bias_dtype, int64_t c0, int64_t n,
                                 float *restrict v) {
  if (!bias) return;
  float b[TF_OPS_TILE];
  tf_ops_load(bias, bias_dtype, c0, n, b);
  for (int64_t i = 0; i < n; ++i) v[i] += b[i];
}

/* Rows [row_begin, row_end) of tf_bias_act_forward. */
TF_ISA_INLINE void bias_act_rows_body(const void *x, tf_dtype dtype, const void *bias, tf_dtype bias_dtype,
                                      int64_t cols, int64_t row_begin, int64_t row_end, tf_activation act,
                                      const tf_ops_output *y, uint32_t *amax_bits) {
  float v[TF_OPS_TILE];
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t c0 = 0; c0 < cols; c0 += TF_OPS_TILE) {
      const int64_t n = cols - c0 < TF_OPS_TILE ? cols - c0 : TF_OPS_TILE;
      tf_ops_load(x, dtype, r * cols + c0, n, v);
      add_bias_tile(bias, bias_dtype, c0, n, v);
      act_forward_tile(act, n, v);
      tf_ops_store(y, r * cols + c0, n, v, amax_bits);
    }
  }
}
TF_ISA_CLONES(bias_act_rows,
              (const void *x, tf_dtype dtype, const void *bias, tf_dtype bias_dtype, int64_t cols,
               int64_t row_begin, int64_t row_end, tf_activation act, const tf_ops_output *y,
               uint32_t *amax_bits),
              (x, dtype, bias, bias_dtype, cols, row_begin, row_end, act, y, amax_bits))

tf_status tf_bias_act_forward(const void *x, tf_dtype dtype, const void *bias, tf_dtype bias_dtype,
                              int64_t rows, int64_t cols, int64_t row_begin, int64_t row_end,
                              tf_activation act, const tf_ops_output *y, uint32_t *amax_bits) {
  if (!amax_bits) return TF_ERR_NULL_POINTER;
  *amax_bits = 0;
  if (!tf_ops_dtype_ok(dtype) || !tf_ops_output_ok(y)) return TF_ERR_BAD_DTYPE;
  if (bias && !tf_ops_dtype_ok(bias_dtype)) return TF_ERR_BAD_DTYPE;
  if (!tf_activation_known(act)) return TF_ERR_BAD_ARGUMENT;
  const tf_status s = tf_ops_check_rows(rows, cols, row_begin, row_end);
  if (s != TF_OK) return s;
  if (row_end > row_begin && cols > 0 && (!x || !y->data)) return TF_ERR_NULL_POINTER;
  bias_act_rows(x, dtype, bias, bias_dtype, cols, row_begin, row_end, act, y, amax_bits);
  return TF_OK;
}

/* Rows [row_begin, row_end) of tf_act_bias_backward. */
TF_ISA_INLINE void act_bias_rows_body(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                                      const void *bias, tf_dtype bias_dtype, int64_t cols,
                                      int64_t row_begin, int64_t row_end, tf_activation act,
                                      const tf_ops_output *dx, float *dbias_partial, uint32_t *amax_bits) {
  if (dbias_partial)
    for (int64_t c = 0; c < cols; ++c) dbias_partial[c] = 0.0f;
  float xv[TF_OPS_TILE];
  float g[TF_OPS_TILE];
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t c0 = 0; c0 < cols; c0 += TF_OPS_TILE) {
      const int64_t n = cols - c0 < TF_OPS_TILE ? cols - c0 : TF_OPS_TILE;
      tf_ops_load(dy, dy_dtype, r * cols + c0, n, g);
      if (act != TF_ACT_NONE) {
        tf_ops_load(x, dtype, r * cols + c0, n, xv);
        add_bias_tile(bias, bias_dtype, c0, n, xv);
        act_backward_tile(act, n, xv, g);
      }
      if (dbias_partial) {
        float *restrict db = dbias_partial + c0;
        for (int64_t i = 0; i < n; ++i) db[i] += g[i];
      }
      tf_ops_store(dx, r * cols + c0, n, g, amax_bits);
    }
  }
}
TF_ISA_CLONES(act_bias_rows,
              (const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype, const void *bias,
               tf_dtype bias_dtype, int64_t cols, int64_t row_begin, int64_t row_end, tf_activation act,
               const tf_ops_output *dx, float *dbias_partial, uint32_t *amax_bits),
              (dy, dy_dtype, x, dtype, bias, bias_dtype, cols, row_begin, row_end, act, dx, dbias_partial,
               amax_bits))

tf_status tf_act_bias_backward(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                               const void *bias, tf_dtype bias_dtype, int64_t rows, int64_t cols,
                               int64_t row_begin, int64_t row_end, tf_activation act,
                               const tf_ops_output *dx, float *dbias_partial, uint32_t *amax_bits) {
  if (!amax_bits) return TF_ERR_NULL_POINTER;
  *amax_bits = 0;
  if (!tf_ops_dtype_ok(dy_dtype) || !tf_ops_dtype_ok(dtype) || !tf_ops_output_ok(dx))
    return TF_ERR_BAD_DTYPE;
  if (bias && !tf_ops_dtype_ok(bias_dtype)) return TF_ERR_BAD_DTYPE;
  if (!tf_activation_known(act)) return TF_ERR_BAD_ARGUMENT;
  const tf_status s = tf_ops_check_rows(rows, cols, row_begin, row_end);
  if (s != TF_OK) return s;
  if (cols > 0 && ((row_end > row_begin && (!dy || !x || !dx->data)))) return TF_ERR_NULL_POINTER;
  act_bias_rows(dy, dy_dtype, x, dtype, bias, bias_dtype, cols, row_begin, row_end, act, dx, dbias_partial,
                amax_bits);
  return TF_OK;
}

/* Rows [row_begin, row_end) of tf_gated_act_forward. */
TF_ISA_INLINE void gated_rows_body(const void *x, tf_dtype dtype, int64_t cols, int64_t row_begin,
                                   int64_t row_end, tf_activation act, const tf_ops_output *y,
                                   uint32_t *amax_bits) {
  float a[TF_OPS_TILE];
  float g[TF_OPS_TILE];
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t c0 = 0; c0 < cols; c0 += TF_OPS_TILE) {
      const int64_t n = cols - c0 < TF_OPS_TILE ? cols - c0 : TF_OPS_TILE;
      tf_ops_load(x, dtype, 2 * r * cols + c0, n, a);
      tf_ops_load(x, dtype, 2 * r * cols + cols + c0, n, g);
      act_forward_tile(act, n, a);
      for (int64_t i = 0; i < n; ++i) a[i] *= g[i];
      tf_ops_store(y, r * cols + c0, n, a, amax_bits);
    }
  }
}
TF_ISA_CLONES(gated_rows,
              (const void *x, tf_dtype dtype, int64_t cols, int64_t row_begin, int64_t row_end,
               tf_activation act, const tf_ops_output *y, uint32_t *amax_bits),
              (x, dtype, cols, row_begin, row_end, act, y, amax_bits))

/* Checks shared by the gated forward and backward: x is rows x (2 * cols). */
static tf_status gated_check(int64_t rows, int64_t cols, int64_t row_begin, int64_t row_end,
                             tf_activation act) {
  if (!tf_activation_known(act) || act == TF_ACT_NONE) return TF_ERR_BAD_ARGUMENT;
  if (!tf_mul_fits(cols, 2)) return TF_ERR_OVERFLOW;
  return tf_ops_check_rows(rows, 2 * cols, row_begin, row_end);
}

tf_status tf_gated_act_forward(const void *x, tf_dtype dtype, int64_t rows, int64_t cols,
                               int64_t row_begin, int64_t row_end, tf_activation act,
                               const tf_ops_output *y, uint32_t *amax_bits) {
  if (!amax_bits) return TF_ERR_NULL_POINTER;
  *amax_bits = 0;
  if (!tf_ops_dtype_ok(dtype) || !tf_ops_output_ok(y)) return TF_ERR_BAD_DTYPE;
  const tf_status s = gated_check(rows, cols, row_begin, row_end, act);
  if (s != TF_OK) return s;
  if (row_end > row_begin && cols > 0 && (!x || !y->data)) return TF_ERR_NULL_POINTER;
  gated_rows(x, dtype, cols, row_begin, row_end, act, y, amax_bits);
  return TF_OK;
}

/*
 * da = act'(a) (d g) and dg = d act(a), in one loop per activation, so the exp that act and act'
 * share is computed once.
 */
TF_ISA_INLINE void gated_grad_tile(tf_activation act, int64_t n, const float *restrict d,
                                   float *restrict a, float *restrict g) {
  switch (act) {
#define GATED_GRAD_LOOP(code, f, grad)     \
  case code:                               \
    for (int64_t i = 0; i < n; ++i) {      \
      const float ai = a[i];               \
      a[i] = grad(ai, d[i] * g[i]);        \
      g[i] = d[i] * f(ai);                 \
    }                                      \
    break;
    TF_OPS_ACTIVATIONS(GATED_GRAD_LOOP)
#undef GATED_GRAD_LOOP
    default:
      break;
  }
}

/* Rows [row_begin, row_end) of tf_gated_act_backward. */
TF_ISA_INLINE void gated_grad_rows_body(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                                        int64_t cols, int64_t row_begin, int64_t row_end, tf_activation act,
                                        const tf_ops_output *dx, uint32_t *amax_bits) {
  float a[TF_OPS_TILE];
  float g[TF_OPS_TILE];
  float d[TF_OPS_TILE];
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t c0 = 0; c0 < cols; c0 += TF_OPS_TILE) {
      const int64_t n = cols - c0 < TF_OPS_TILE ? cols - c0 : TF_OPS_TILE;
      tf_ops_load(dy, dy_dtype, r * cols + c0, n, d);
      tf_ops_load(x, dtype, 2 * r * cols + c0, n, a);
      tf_ops_load(x, dtype, 2 * r * cols + cols + c0, n, g);
      gated_grad_tile(act, n, d, a, g);
      tf_ops_store(dx, 2 * r * cols + c0, n, a, amax_bits);
      tf_ops_store(dx, 2 * r * cols + cols + c0, n, g, amax_bits);
    }
  }
}
TF_ISA_CLONES(gated_grad_rows,
              (const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype, int64_t cols, int64_t row_begin,
               int64_t row_end, tf_activation act, const tf_ops_output *dx, uint32_t *amax_bits),
              (dy, dy_dtype, x, dtype, cols, row_begin, row_end, act, dx, amax_bits))

tf_status tf_gated_act_backward(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                                int64_t rows, int64_t cols, int64_t row_begin, int64_t row_end,
                                tf_activation act, const tf_ops_output *dx, uint32_t *amax_bits) {
  if (!amax_bits) return TF_ERR_NULL_POINTER;
  *amax_bits = 0;
  if (!tf_ops_dtype_ok(dy_dtype) || !tf_ops_dtype_ok(dtype) || !tf_ops_output_ok(dx))
    return TF_ERR_BAD_DTYPE;
  const tf_status s = gated_check(rows, cols, row_begin, row_end, act);
  if (s != TF_OK) return s;
  if (row_end > row_begin && cols > 0 && (!dy || !x || !dx->data)) return TF_ERR_NULL_POINTER;
  gated_grad_rows(dy, dy_dtype, x, dtype, cols, row_begin, row_end, act, dx, amax_bits);
  return TF_OK;
}

tf_status tf_ops_sum_partials(const float *partials, int64_t num_parts, int64_t cols,
                              int64_t col_begin, int64_t col_end, void *out, tf_dtype out_dtype) {
  if (!tf_ops_dtype_ok(out_dtype)) return TF_ERR_BAD_DTYPE;
  if (num_parts < 0 || cols < 0 || !tf_range_ok(col_begin, col_end, cols)) return TF_ERR_BAD_SIZE;
  if (!tf_mul_fits(num_parts, cols)) return TF_ERR_OVERFLOW;
  if (col_end > col_begin && (!out || (num_parts > 0 && !partials))) return TF_ERR_NULL_POINTER;
  float acc[TF_OPS_TILE];
  for (int64_t c0 = col_begin; c0 < col_end; c0 += TF_OPS_TILE) {
    const int64_t n = col_end - c0 < TF_OPS_TILE ? col_end - c0 : TF_OPS_TILE;
    for (int64_t i = 0; i < n; ++i) acc[i] = 0.0f;
    for (int64_t p = 0; p < num_parts; ++p) {
      const float *restrict row = partials + p * cols + c0;
      for (int64_t i = 0; i < n; ++i) acc[i] += row[i];
    }
    tf_ops_store_dtype(out, out_dtype, c0, n, acc);
  }
  return TF_OK;
}
