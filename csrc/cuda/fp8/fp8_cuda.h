/*
 * extern "C" launchers of the FP8 quantizer kernels on CUDA.
 *
 * They mirror the CPU entry points of csrc/fp8 and produce the same bytes:
 * the kernels call the very same TF_HD encoders, decoders and scaling math.
 * All tensor pointers are device pointers of the current device. The scale
 * (or scale_inv) is read on the device, so nothing waits for the GPU. amax is
 * accumulated in place as amax <- max(|amax|, max |x|) on the float bit
 * patterns (NaN wins), exactly as the CPU binding does.
 *
 * Work is enqueued on `stream` (a cudaStream_t) and not waited for; a
 * TF_ERR_CUDA return means the launch itself failed. No CUDA header is needed
 * to call these. The kernels must be compiled without --use_fast_math: the
 * shared scaling math relies on IEEE division and on denormals being kept.
 */
#ifndef TF_FP8_CUDA_H
#define TF_FP8_CUDA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "../../common/tf_dtype.h"
#include "../../common/tf_status.h"
#include "../../fp8/fp8_format.h"
#include "../../fp8/fp8_scaling.h"

/* y[i] = fp8(float(x[i]) * *scale) for i in [0, n); *amax <- max(|*amax|, max |x[i]|). */
tf_status tf_fp8_quantize_cuda(const void *x, tf_dtype dtype, int64_t n, const float *scale,
                               tf_fp8_format format, uint8_t *y, float *amax, void *stream);

/* *amax <- max(|*amax|, max |x[i]|) for i in [0, n); zero *amax first for a plain amax. */
tf_status tf_fp8_amax_cuda(const void *x, tf_dtype dtype, int64_t n, float *amax, void *stream);

/* x[i] = dtype(decode(y[i]) * *scale_inv) for i in [0, n), rounded to nearest even. */
tf_status tf_fp8_dequantize_cuda(const uint8_t *y, tf_fp8_format format, int64_t n,
                                 const float *scale_inv, void *x, tf_dtype dtype, void *stream);

/*
 * Cast-transpose of a rows x cols matrix x (row stride x_row_stride elements):
 * y (rows x cols) and y_t (cols x rows), both row-major, from one read of x;
 * *amax accumulated as in tf_fp8_quantize_cuda.
 */
tf_status tf_fp8_cast_transpose_cuda(const void *x, tf_dtype dtype, int64_t rows, int64_t cols,
                                     int64_t x_row_stride, const float *scale,
                                     tf_fp8_format format, uint8_t *y, uint8_t *y_t, float *amax,
                                     void *stream);

/* The delayed-scaling update of tf_fp8_delayed_scaling_update, one GPU thread per tensor. */
tf_status tf_fp8_delayed_scaling_update_cuda(float *amax_history, int64_t history_len,
                                             int64_t num_scales, float *scale, float *scale_inv,
                                             float fp8_max, int32_t margin, tf_amax_algo algo,
                                             void *stream);

/* *scale = tf_fp8_current_scale(*amax, ...), *scale_inv = 1 / *scale, computed on the device. */
tf_status tf_fp8_current_scale_cuda(const float *amax, float fp8_max, float epsilon,
                                    int force_pow2, float *scale, float *scale_inv, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* TF_FP8_CUDA_H */
