/*
 * extern "C" launchers of the fused element-wise and normalization kernels on CUDA
 * (the CUDA twins of csrc/ops/activation.h and csrc/ops/norm.h).
 *
 * Matrices are row-major rows x cols, device pointers on the current device.
 * Math is float32 with the CPU's activation functions (csrc/ops/ops_math.h);
 * results may differ from the CPU's by float32 rounding (FMA contraction,
 * reduction order of the row statistics, sqrt). Reductions over rows (dbias,
 * dgamma, dbeta) are deterministic: fixed bands of TF_OPS_CUDA_BAND_ROWS rows
 * each summed in row order into `partials` (a float32 workspace of
 * tf_ops_cuda_bands(rows) x cols), then the bands summed in order.
 *
 * An FP8 output reads its scale on the device and folds max |value| into
 * *amax in place (bit patterns, NaN wins), like the FP8 quantizer kernels.
 * Work is enqueued on `stream` (a cudaStream_t); TF_ERR_CUDA means the launch
 * failed. No CUDA header is needed to call these.
 */
#ifndef TF_FUSED_OPS_CUDA_H
#define TF_FUSED_OPS_CUDA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "../../common/tf_dtype.h"
#include "../../common/tf_status.h"
#include "../../fp8/fp8_format.h"
#include "../../ops/activation.h"
#include "../../ops/ops_math.h"

#define TF_OPS_CUDA_BAND_ROWS 64

/* Number of row bands (and rows of the partials workspace) for `rows` rows. */
static inline int64_t tf_ops_cuda_bands(int64_t rows) {
  return rows / TF_OPS_CUDA_BAND_ROWS + (rows % TF_OPS_CUDA_BAND_ROWS != 0);
}

/* A kernel's main output: a floating dtype, or FP8 codes of value * (*scale). */
typedef struct tf_ops_cuda_output {
  void *data;
  tf_dtype dtype;        /* when fp8 == 0 */
  int fp8;
  tf_fp8_format format;  /* when fp8 == 1 */
  const float *scale;    /* device pointer, when fp8 == 1 */
  float *amax;           /* device pointer, when fp8 == 1 */
} tf_ops_cuda_output;

tf_status tf_bias_act_forward_cuda(const void *x, tf_dtype dtype, const void *bias, tf_dtype bias_dtype,
                                   int64_t rows, int64_t cols, tf_activation act,
                                   const tf_ops_cuda_output *y, void *stream);

/* dx = dy * act'(x + bias); with dbias != NULL also dbias (cols of dbias_dtype) via partials. */
tf_status tf_act_bias_backward_cuda(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                                    const void *bias, tf_dtype bias_dtype, int64_t rows, int64_t cols,
                                    tf_activation act, const tf_ops_cuda_output *dx, float *partials,
                                    void *dbias, tf_dtype dbias_dtype, void *stream);

/* x: rows x 2 cols; y = act(x[:, :cols]) * x[:, cols:] (see tf_gated_act_forward); act != TF_ACT_NONE. */
tf_status tf_gated_act_forward_cuda(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, tf_activation act,
                                    const tf_ops_cuda_output *y, void *stream);

tf_status tf_gated_act_backward_cuda(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                                     int64_t rows, int64_t cols, tf_activation act, void *dx, void *stream);

/* mean == NULL: RMSNorm (no centering, beta ignored); else LayerNorm writing mean. */
tf_status tf_norm_forward_cuda(const void *x, tf_dtype dtype, const void *gamma, const void *beta,
                               tf_dtype param_dtype, int zero_centered_gamma, float eps, int64_t rows,
                               int64_t cols, const tf_ops_cuda_output *y, float *mean, float *rstd,
                               void *stream);

/* mean == NULL: RMSNorm backward (dbeta ignored). dgamma/dbeta have cols of param_dtype;
   partials holds 2 x tf_ops_cuda_bands(rows) x cols floats. */
tf_status tf_norm_backward_cuda(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                                const float *mean, const float *rstd, const void *gamma,
                                tf_dtype param_dtype, int zero_centered_gamma, int64_t rows, int64_t cols,
                                void *dx, float *partials, void *dgamma, void *dbeta, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* TF_FUSED_OPS_CUDA_H */
