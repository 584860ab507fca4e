/*
 * RMSNorm and LayerNorm over the last dimension on the CPU, forward and backward.
 *
 * x is a row-major rows x cols matrix (float32, bfloat16 or float16); gamma
 * and beta have cols elements of param_dtype; math is float32 with the row
 * statistics accumulated in double. The forward saves float32 per-row
 * statistics (rstd, and mean for LayerNorm) that the backward consumes, and
 * may write its output as FP8 (tf_ops_output). With zero_centered_gamma the
 * effective weight is gamma + 1.
 *
 * Each call handles rows [row_begin, row_end). The backward writes, per band,
 * the column sums of the weight gradients into float32 partial rows
 * (overwritten, summed in row order); tf_ops_sum_partials combines bands in a
 * fixed order, so dgamma/dbeta do not depend on the thread count.
 */
#ifndef TF_OPS_NORM_H
#define TF_OPS_NORM_H

#include <stdint.h>

#include "../common/tf_dtype.h"
#include "../common/tf_status.h"
#include "ops_io.h"

/* y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps); rstd[r] saved per row. */
tf_status tf_rmsnorm_forward(const void *x, tf_dtype dtype, const void *gamma, tf_dtype param_dtype,
                             int zero_centered_gamma, float eps, int64_t rows, int64_t cols,
                             int64_t row_begin, int64_t row_end, const tf_ops_output *y,
                             float *rstd, uint32_t *amax_bits);

/* y = (x - mean) * rstd * w + beta with rstd = 1 / sqrt(var + eps) (biased variance). */
tf_status tf_layernorm_forward(const void *x, tf_dtype dtype, const void *gamma, const void *beta,
                               tf_dtype param_dtype, int zero_centered_gamma, float eps,
                               int64_t rows, int64_t cols, int64_t row_begin, int64_t row_end,
                               const tf_ops_output *y, float *mean, float *rstd,
                               uint32_t *amax_bits);

/* dx (dx_dtype) and the band's dgamma column sums (dgamma_partial, cols float32). */
tf_status tf_rmsnorm_backward(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                              const float *rstd, const void *gamma, tf_dtype param_dtype,
                              int zero_centered_gamma, int64_t rows, int64_t cols,
                              int64_t row_begin, int64_t row_end, void *dx, tf_dtype dx_dtype,
                              float *dgamma_partial);

/* dx and the band's dgamma and dbeta column sums. */
tf_status tf_layernorm_backward(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                                const float *mean, const float *rstd, const void *gamma,
                                tf_dtype param_dtype, int zero_centered_gamma, int64_t rows,
                                int64_t cols, int64_t row_begin, int64_t row_end, void *dx,
                                tf_dtype dx_dtype, float *dgamma_partial, float *dbeta_partial);

#endif /* TF_OPS_NORM_H */
