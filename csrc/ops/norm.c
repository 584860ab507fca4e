#include "norm.h"

#include "ops_tile.h"

#include <math.h>

/* w[i] = gamma[c0 + i] (+ 1 when zero-centered). */
TF_ISA_INLINE void load_weight(const void *gamma, tf_dtype param_dtype, int zero_centered,
                               int64_t c0, int64_t n, float *restrict w) {
  tf_ops_load(gamma, param_dtype, c0, n, w);
  if (zero_centered)
    for (int64_t i = 0; i < n; ++i) w[i] += 1.0f;
}

static tf_status check_common(const void *x, tf_dtype dtype, const void *gamma,
                              tf_dtype param_dtype, int64_t rows, int64_t cols, int64_t row_begin,
                              int64_t row_end) {
  if (!tf_ops_dtype_ok(dtype) || !tf_ops_dtype_ok(param_dtype)) return TF_ERR_BAD_DTYPE;
  const tf_status s = tf_ops_check_rows(rows, cols, row_begin, row_end);
  if (s != TF_OK) return s;
  if (row_end > row_begin && cols > 0 && (!x || !gamma)) return TF_ERR_NULL_POINTER;
  return TF_OK;
}

/*
 * Sums of a tile in TF_ISA_LANES partial sums (lane l takes elements l, l + TF_ISA_LANES, ...),
 * added in lane order at the end: the same order, so the same bits, at every vector width.
 */
TF_ISA_INLINE float lanes_total(const float lane[TF_ISA_LANES]) {
  float total = 0.0f;
  for (int l = 0; l < TF_ISA_LANES; ++l) total += lane[l];
  return total;
}

/*
 * lane[l] += v[i] (squared, after subtracting center, when `squared`) for i = l, l + TF_ISA_LANES, ...
 * in [0, n). Whole groups of TF_ISA_LANES first, in a loop of fixed trip count so the partial sums
 * stay in registers, then the tail: the same additions in the same order as one loop over i.
 */
TF_ISA_INLINE void lane_sums(const float *restrict v, int64_t n, float center, int squared,
                             float lane[TF_ISA_LANES]) {
  int64_t i = 0;
  for (; i + TF_ISA_LANES <= n; i += TF_ISA_LANES) {
    for (int l = 0; l < TF_ISA_LANES; ++l) {
      const float d = v[i + l] - center;
      lane[l] += squared ? d * d : v[i + l];
    }
  }
  for (int l = 0; i + l < n; ++l) {
    const float d = v[i + l] - center;
    lane[l] += squared ? d * d : v[i + l];
  }
}

/* The sum of lane_sums over [0, n). */
TF_ISA_INLINE float tile_sum(const float *restrict v, int64_t n, float center, int squared) {
  float lane[TF_ISA_LANES] = {0};
  lane_sums(v, n, center, squared, lane);
  return lanes_total(lane);
}

/* Sum of x (or of (x - center)^2) over one row: per tile in float32, tiles in double. */
TF_ISA_INLINE double row_sum(const void *x, tf_dtype dtype, int64_t offset, int64_t cols, float center,
                             int squared) {
  float v[TF_OPS_TILE];
  double sum = 0.0;
  for (int64_t c0 = 0; c0 < cols; c0 += TF_OPS_TILE) {
    const int64_t n = cols - c0 < TF_OPS_TILE ? cols - c0 : TF_OPS_TILE;
    tf_ops_load(x, dtype, offset + c0, n, v);
    sum += squared ? tile_sum(v, n, center, 1) : tile_sum(v, n, 0.0f, 0);
  }
  return sum;
}

/* v[i] = (v[i] - center) * rstd * w[i] (+ b[i] when b is not NULL) over [0, n). */
TF_ISA_INLINE void normalize_tile(float *restrict v, int64_t n, float center, float rstd, const float *restrict w,
                                  const float *restrict b) {
  for (int64_t i = 0; i < n; ++i) v[i] = (v[i] - center) * rstd * w[i];
  if (b)
    for (int64_t i = 0; i < n; ++i) v[i] += b[i];
}

/* 1 / sqrt(var + eps), rounded once to float32. */
static inline float rstd_of(double var, float eps) { return (float)(1.0 / sqrt(var + (double)eps)); }

/* y = (x - center) * rstd * w (+ beta) for one row. */
TF_ISA_INLINE void normalize_row(const void *x, tf_dtype dtype, const void *gamma, const void *beta,
                                 tf_dtype param_dtype, int zero_centered, int64_t offset, int64_t cols,
                                 float center, float rstd, const tf_ops_output *y, uint32_t *amax_bits) {
  float v[TF_OPS_TILE];
  float w[TF_OPS_TILE];
  float b[TF_OPS_TILE];
  for (int64_t c0 = 0; c0 < cols; c0 += TF_OPS_TILE) {
    const int64_t n = cols - c0 < TF_OPS_TILE ? cols - c0 : TF_OPS_TILE;
    tf_ops_load(x, dtype, offset + c0, n, v);
    load_weight(gamma, param_dtype, zero_centered, c0, n, w);
    if (beta) tf_ops_load(beta, param_dtype, c0, n, b);
    normalize_tile(v, n, center, rstd, w, beta ? b : NULL);
    tf_ops_store(y, offset + c0, n, v, amax_bits);
  }
}

/*
 * Rows of one tile are handled TF_NORM_GROUP at a time so that their reductions overlap: each row's
 * lane partial sums are still added in lane order (lanes_total's order), one chain per row, and the
 * chains of a group run side by side. On a short row that in-order sum is the row's latency.
 */
#define TF_NORM_GROUP 8

/* totals[j] = tile_sum(v[j], n, centers[j], squared) for rows j < g: the same additions in the same order. */
TF_ISA_INLINE void group_sums(float v[TF_NORM_GROUP][TF_OPS_TILE], int g, int64_t n, const float *centers,
                              int squared, float totals[TF_NORM_GROUP]) {
  float lane[TF_NORM_GROUP][TF_ISA_LANES] = {{0}};
  for (int j = 0; j < g; ++j) lane_sums(v[j], n, squared ? centers[j] : 0.0f, squared, lane[j]);
  for (int j = 0; j < TF_NORM_GROUP; ++j) totals[j] = 0.0f;
  for (int l = 0; l < TF_ISA_LANES; ++l)
    for (int j = 0; j < TF_NORM_GROUP; ++j) totals[j] += lane[j][l];
}

/*
 * norm_rows_body for rows of one tile (the common hidden sizes up to TF_OPS_TILE): each row is
 * converted once rather than three times, and gamma and beta once per band. The same operations
 * in the same order as the general loop, so the same bits.
 */
TF_ISA_INLINE void norm_short_rows(const void *x, tf_dtype dtype, const void *gamma, const void *beta,
                                   tf_dtype param_dtype, int zero_centered, float eps, int64_t cols,
                                   int64_t row_begin, int64_t row_end, const tf_ops_output *y, float *mean,
                                   float *rstd, uint32_t *amax_bits) {
  float v[TF_NORM_GROUP][TF_OPS_TILE];
  float w[TF_OPS_TILE];
  float b[TF_OPS_TILE];
  load_weight(gamma, param_dtype, zero_centered, 0, cols, w);
  if (beta) tf_ops_load(beta, param_dtype, 0, cols, b);
  for (int64_t r0 = row_begin; r0 < row_end; r0 += TF_NORM_GROUP) {
    const int g = row_end - r0 < TF_NORM_GROUP ? (int)(row_end - r0) : TF_NORM_GROUP;
    float mu[TF_NORM_GROUP] = {0}, sums[TF_NORM_GROUP], rs[TF_NORM_GROUP];
    for (int j = 0; j < g; ++j) tf_ops_load(x, dtype, (r0 + j) * cols, cols, v[j]);
    if (mean) {
      group_sums(v, g, cols, NULL, 0, sums);
      for (int j = 0; j < g; ++j) mu[j] = (float)((double)sums[j] / (double)cols);
    }
    group_sums(v, g, cols, mu, 1, sums);
    for (int j = 0; j < g; ++j) rs[j] = rstd_of((double)sums[j] / (double)cols, eps);
    for (int j = 0; j < g; ++j) {
      if (mean) mean[r0 + j] = mu[j];
      rstd[r0 + j] = rs[j];
      normalize_tile(v[j], cols, mu[j], rs[j], w, beta ? b : NULL);
      tf_ops_store(y, (r0 + j) * cols, cols, v[j], amax_bits);
    }
  }
}

/* Rows [row_begin, row_end) of either norm: LayerNorm where mean is given, else RMSNorm. */
TF_ISA_INLINE void norm_rows_body(const void *x, tf_dtype dtype, const void *gamma, const void *beta,
                                  tf_dtype param_dtype, int zero_centered, float eps, int64_t cols,
                                  int64_t row_begin, int64_t row_end, const tf_ops_output *y, float *mean,
                                  float *rstd, uint32_t *amax_bits) {
  if (cols > 0 && cols <= TF_OPS_TILE) {
    norm_short_rows(x, dtype, gamma, beta, param_dtype, zero_centered, eps, cols, row_begin, row_end, y, mean,
                    rstd, amax_bits);
    return;
  }
  for (int64_t r = row_begin; r < row_end; ++r) {
    float mu = 0.0f;
    if (mean && cols > 0) mu = (float)(row_sum(x, dtype, r * cols, cols, 0.0f, 0) / (double)cols);
    const double var = cols > 0 ? row_sum(x, dtype, r * cols, cols, mu, 1) / (double)cols : 0.0;
    const float rs = rstd_of(var, eps);
    if (mean) mean[r] = mu;
    rstd[r] = rs;
    normalize_row(x, dtype, gamma, beta, param_dtype, zero_centered, r * cols, cols, mu, rs, y, amax_bits);
  }
}
TF_ISA_CLONES(norm_rows,
              (const void *x, tf_dtype dtype, const void *gamma, const void *beta, tf_dtype param_dtype,
               int zero_centered, float eps, int64_t cols, int64_t row_begin, int64_t row_end,
               const tf_ops_output *y, float *mean, float *rstd, uint32_t *amax_bits),
              (x, dtype, gamma, beta, param_dtype, zero_centered, eps, cols, row_begin, row_end, y, mean, rstd,
               amax_bits))

tf_status tf_rmsnorm_forward(const void *x, tf_dtype dtype, const void *gamma, tf_dtype param_dtype,
                             int zero_centered_gamma, float eps, int64_t rows, int64_t cols,
                             int64_t row_begin, int64_t row_end, const tf_ops_output *y,
                             float *rstd, uint32_t *amax_bits) {
  if (!amax_bits) return TF_ERR_NULL_POINTER;
  *amax_bits = 0;
  if (!tf_ops_output_ok(y)) return TF_ERR_BAD_DTYPE;
  const tf_status s = check_common(x, dtype, gamma, param_dtype, rows, cols, row_begin, row_end);
  if (s != TF_OK) return s;
  if (!(eps >= 0.0f)) return TF_ERR_BAD_ARGUMENT;
  if (row_end > row_begin && (!rstd || (cols > 0 && !y->data))) return TF_ERR_NULL_POINTER;
  norm_rows(x, dtype, gamma, NULL, param_dtype, zero_centered_gamma, eps, cols, row_begin, row_end, y, NULL,
            rstd, amax_bits);
  return TF_OK;
}

tf_status tf_layernorm_forward(const void *x, tf_dtype dtype, const void *gamma, const void *beta,
                               tf_dtype param_dtype, int zero_centered_gamma, float eps,
                               int64_t rows, int64_t cols, int64_t row_begin, int64_t row_end,
                               const tf_ops_output *y, float *mean, float *rstd,
                               uint32_t *amax_bits) {
  if (!amax_bits) return TF_ERR_NULL_POINTER;
  *amax_bits = 0;
  if (!tf_ops_output_ok(y)) return TF_ERR_BAD_DTYPE;
  const tf_status s = check_common(x, dtype, gamma, param_dtype, rows, cols, row_begin, row_end);
  if (s != TF_OK) return s;
  if (!(eps >= 0.0f)) return TF_ERR_BAD_ARGUMENT;
  if (row_end > row_begin && (!mean || !rstd || (cols > 0 && (!y->data || !beta))))
    return TF_ERR_NULL_POINTER;
  norm_rows(x, dtype, gamma, beta, param_dtype, zero_centered_gamma, eps, cols, row_begin, row_end, y, mean,
            rstd, amax_bits);
  return TF_OK;
}

/*
 * The backward of both norms: with xhat = (x - mu) * rstd and g = dy * w,
 * dx = rstd * (g - mean(g) * has_mean - xhat * mean(g * xhat)).
 *
 * Its reductions over one tile of a row: with g = dy * w and xhat = (x - mu) * rs,
 * lane_g[l] += g and lane_gx[l] += g * xhat over i = l, l + TF_ISA_LANES, ... in [0, n).
 */
TF_ISA_INLINE void backward_lane_sums(const float *restrict d, const float *restrict v, const float *restrict w,
                                      int64_t n, float mu, float rs, float lane_g[TF_ISA_LANES],
                                      float lane_gx[TF_ISA_LANES]) {
  for (int64_t i = 0; i < n; i += TF_ISA_LANES) {
    const int64_t m = n - i < TF_ISA_LANES ? n - i : TF_ISA_LANES;
    for (int64_t l = 0; l < m; ++l) {
      const float g = d[i + l] * w[i + l];
      lane_g[l] += g;
      lane_gx[l] += g * (v[i + l] - mu) * rs;
    }
  }
}

/*
 * The backward's second pass over one tile of a row: dgamma and dbeta partials, and
 * dx = rs * (g - mean_g - xhat * mean_gx) left in v.
 */
TF_ISA_INLINE void backward_tile(const float *restrict d, float *restrict v, const float *restrict w, int64_t n,
                                 float mu, float rs, float mean_g, float mean_gx, float *restrict dg,
                                 float *restrict db) {
  for (int64_t i = 0; i < n; ++i) {
    const float xhat = (v[i] - mu) * rs;
    dg[i] += d[i] * xhat;
    v[i] = rs * (d[i] * w[i] - mean_g - xhat * mean_gx);
  }
  if (db)
    for (int64_t i = 0; i < n; ++i) db[i] += d[i];
}

/*
 * The backward for rows of one tile, TF_NORM_GROUP at a time (see group_sums), gamma converted once
 * per band: the rows' two in-order lane totals run side by side, then each row's second pass follows
 * in row order, so the dgamma and dbeta partials are summed in the same order as one row at a time.
 */
TF_ISA_INLINE void norm_backward_short_body(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                                            const float *mean, const float *rstd, const void *gamma,
                                            tf_dtype param_dtype, int zero_centered, int64_t cols,
                                            int64_t row_begin, int64_t row_end, void *dx, tf_dtype dx_dtype,
                                            float *restrict dgamma_partial, float *restrict dbeta_partial) {
  float d[TF_NORM_GROUP][TF_OPS_TILE];
  float v[TF_NORM_GROUP][TF_OPS_TILE];
  float w[TF_OPS_TILE];
  load_weight(gamma, param_dtype, zero_centered, 0, cols, w);
  for (int64_t r0 = row_begin; r0 < row_end; r0 += TF_NORM_GROUP) {
    const int g = row_end - r0 < TF_NORM_GROUP ? (int)(row_end - r0) : TF_NORM_GROUP;
    float lane_g[TF_NORM_GROUP][TF_ISA_LANES] = {{0}}, lane_gx[TF_NORM_GROUP][TF_ISA_LANES] = {{0}};
    float mu[TF_NORM_GROUP] = {0}, rs[TF_NORM_GROUP] = {0};
    for (int j = 0; j < g; ++j) {
      tf_ops_load(dy, dy_dtype, (r0 + j) * cols, cols, d[j]);
      tf_ops_load(x, dtype, (r0 + j) * cols, cols, v[j]);
      mu[j] = mean ? mean[r0 + j] : 0.0f;
      rs[j] = rstd[r0 + j];
      backward_lane_sums(d[j], v[j], w, cols, mu[j], rs[j], lane_g[j], lane_gx[j]);
    }
    float sum_g[TF_NORM_GROUP] = {0}, sum_gx[TF_NORM_GROUP] = {0};
    for (int l = 0; l < TF_ISA_LANES; ++l)
      for (int j = 0; j < TF_NORM_GROUP; ++j) {
        sum_g[j] += lane_g[j][l];
        sum_gx[j] += lane_gx[j][l];
      }
    for (int j = 0; j < g; ++j) {
      const float mean_g = mean ? (float)((double)sum_g[j] / (double)cols) : 0.0f;
      const float mean_gx = (float)((double)sum_gx[j] / (double)cols);
      backward_tile(d[j], v[j], w, cols, mu[j], rs[j], mean_g, mean_gx, dgamma_partial, dbeta_partial);
      tf_ops_store_dtype(dx, dx_dtype, (r0 + j) * cols, cols, v[j]);
    }
  }
}

/* The backward for one band of rows longer than a tile, one tile at a time. */
TF_ISA_INLINE void norm_backward_band_body(const void *dy, tf_dtype dy_dtype, const void *x,
                                           tf_dtype dtype, const float *mean, const float *rstd,
                                           const void *gamma, tf_dtype param_dtype, int zero_centered,
                                           int64_t cols, int64_t row_begin, int64_t row_end, void *dx,
                                           tf_dtype dx_dtype, float *restrict dgamma_partial,
                                           float *restrict dbeta_partial) {
  float d[TF_OPS_TILE];
  float v[TF_OPS_TILE];
  float w[TF_OPS_TILE];
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int64_t offset = r * cols;
    const float mu = mean ? mean[r] : 0.0f;
    const float rs = rstd[r];
    double sum_g = 0.0, sum_gx = 0.0;
    for (int64_t c0 = 0; c0 < cols; c0 += TF_OPS_TILE) {
      const int64_t n = cols - c0 < TF_OPS_TILE ? cols - c0 : TF_OPS_TILE;
      tf_ops_load(dy, dy_dtype, offset + c0, n, d);
      tf_ops_load(x, dtype, offset + c0, n, v);
      load_weight(gamma, param_dtype, zero_centered, c0, n, w);
      float lane_g[TF_ISA_LANES] = {0}, lane_gx[TF_ISA_LANES] = {0};
      backward_lane_sums(d, v, w, n, mu, rs, lane_g, lane_gx);
      sum_g += lanes_total(lane_g);
      sum_gx += lanes_total(lane_gx);
    }
    const float mean_g = mean ? (float)(sum_g / (double)cols) : 0.0f;
    const float mean_gx = (float)(sum_gx / (double)cols);
    for (int64_t c0 = 0; c0 < cols; c0 += TF_OPS_TILE) {
      const int64_t n = cols - c0 < TF_OPS_TILE ? cols - c0 : TF_OPS_TILE;
      tf_ops_load(dy, dy_dtype, offset + c0, n, d);
      tf_ops_load(x, dtype, offset + c0, n, v);
      load_weight(gamma, param_dtype, zero_centered, c0, n, w);
      backward_tile(d, v, w, n, mu, rs, mean_g, mean_gx, dgamma_partial + c0,
                    dbeta_partial ? dbeta_partial + c0 : NULL);
      tf_ops_store_dtype(dx, dx_dtype, offset + c0, n, v);
    }
  }
}

#define NORM_BACKWARD_PARAMS                                                                                 \
  (const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype, const float *mean, const float *rstd,   \
   const void *gamma, tf_dtype param_dtype, int zero_centered, int64_t cols, int64_t row_begin,              \
   int64_t row_end, void *dx, tf_dtype dx_dtype, float *restrict dgamma_partial, float *restrict dbeta_partial)
#define NORM_BACKWARD_ARGS                                                                                   \
  (dy, dy_dtype, x, dtype, mean, rstd, gamma, param_dtype, zero_centered, cols, row_begin, row_end, dx,      \
   dx_dtype, dgamma_partial, dbeta_partial)
TF_ISA_CLONES(norm_backward_short, NORM_BACKWARD_PARAMS, NORM_BACKWARD_ARGS)
TF_ISA_CLONES(norm_backward_band, NORM_BACKWARD_PARAMS, NORM_BACKWARD_ARGS)

/* The backward of either norm for one band: zeroed partials, then rows of one tile or longer rows (two
 * functions, so that the short rows' group buffers do not enlarge the long rows' stack frame). */
static void norm_backward NORM_BACKWARD_PARAMS {
  for (int64_t c = 0; c < cols; ++c) dgamma_partial[c] = 0.0f;
  if (dbeta_partial)
    for (int64_t c = 0; c < cols; ++c) dbeta_partial[c] = 0.0f;
  if (cols <= TF_OPS_TILE)
    norm_backward_short NORM_BACKWARD_ARGS;
  else
    norm_backward_band NORM_BACKWARD_ARGS;
}

static tf_status check_backward(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                                const float *rstd, const void *gamma, tf_dtype param_dtype,
                                int64_t rows, int64_t cols, int64_t row_begin, int64_t row_end,
                                const void *dx, tf_dtype dx_dtype, const float *dgamma_partial) {
  if (!tf_ops_dtype_ok(dy_dtype) || !tf_ops_dtype_ok(dx_dtype)) return TF_ERR_BAD_DTYPE;
  const tf_status s = check_common(x, dtype, gamma, param_dtype, rows, cols, row_begin, row_end);
  if (s != TF_OK) return s;
  if (cols > 0 && !dgamma_partial) return TF_ERR_NULL_POINTER;
  if (row_end > row_begin && (!rstd || (cols > 0 && (!dy || !dx)))) return TF_ERR_NULL_POINTER;
  return TF_OK;
}

tf_status tf_rmsnorm_backward(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                              const float *rstd, const void *gamma, tf_dtype param_dtype,
                              int zero_centered_gamma, int64_t rows, int64_t cols,
                              int64_t row_begin, int64_t row_end, void *dx, tf_dtype dx_dtype,
                              float *dgamma_partial) {
  const tf_status s = check_backward(dy, dy_dtype, x, dtype, rstd, gamma, param_dtype, rows, cols,
                                     row_begin, row_end, dx, dx_dtype, dgamma_partial);
  if (s != TF_OK || cols == 0) return s;
  norm_backward(dy, dy_dtype, x, dtype, NULL, rstd, gamma, param_dtype, zero_centered_gamma,
                     cols, row_begin, row_end, dx, dx_dtype, dgamma_partial, NULL);
  return TF_OK;
}

tf_status tf_layernorm_backward(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                                const float *mean, const float *rstd, const void *gamma,
                                tf_dtype param_dtype, int zero_centered_gamma, int64_t rows,
                                int64_t cols, int64_t row_begin, int64_t row_end, void *dx,
                                tf_dtype dx_dtype, float *dgamma_partial, float *dbeta_partial) {
  const tf_status s = check_backward(dy, dy_dtype, x, dtype, rstd, gamma, param_dtype, rows, cols,
                                     row_begin, row_end, dx, dx_dtype, dgamma_partial);
  if (s != TF_OK || cols == 0) return s;
  if (!dbeta_partial || (row_end > row_begin && !mean)) return TF_ERR_NULL_POINTER;
  norm_backward(dy, dy_dtype, x, dtype, mean, rstd, gamma, param_dtype, zero_centered_gamma,
                     cols, row_begin, row_end, dx, dx_dtype, dgamma_partial, dbeta_partial);
  return TF_OK;
}
