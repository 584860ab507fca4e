/*
 * extern "C" launchers of the block-scaled quantizers on CUDA: MXFP8, Float8 block scaling and
 * NVFP4. They take the arguments of the C entry points of csrc/fp8/fp8_block.h and
 * csrc/fp4/nvfp4.h for the whole matrix (no band) and write the same bytes: the kernels call the
 * same TF_HD scale and encode functions (fp8_block_format.h, nvfp4_format.h), and form every
 * product and sum as the C core does, rounded separately (never contracted into an FMA).
 *
 * All tensor pointers are device pointers of the current device; outputs are contiguous, in the
 * layouts of the C entry points. Work is enqueued on `stream` (a cudaStream_t) and not waited for;
 * TF_ERR_CUDA means the launch itself failed. Compile without --use_fast_math (IEEE division and
 * subnormals are relied on).
 */
#ifndef TF_BLOCK_CUDA_H
#define TF_BLOCK_CUDA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "../../common/tf_dtype.h"
#include "../../common/tf_status.h"
#include "../../fp8/fp8_block.h"
#include "../../fp8/fp8_format.h"

/* tf_mxfp8_quantize over all rows: 1x32 (y, scale) and 32x1 (y_col, scale_col) blocks. */
tf_status tf_mxfp8_quantize_cuda(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x,
                                 tf_fp8_format format, uint8_t *y, uint8_t *scale, int64_t ld_scale,
                                 uint8_t *y_col, uint8_t *scale_col, int64_t ld_scale_col, void *stream);

/* tf_fp8_block_quantize over all rows: 1x128 / 128x1 tiles (block_dim 1) or 128x128 blocks (2). */
tf_status tf_fp8_block_quantize_cuda(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x,
                                     tf_fp8_format format, int block_dim, float epsilon, int pow2, uint8_t *y,
                                     float *scale_inv, int64_t ld_scale, uint8_t *y_t, float *scale_inv_t,
                                     int64_t ld_scale_t, void *stream);

/*
 * *amax <- max(*amax, tf_nvfp4_amax of the whole matrix) on the float bit patterns (*amax >= 0;
 * zero it first for a plain amax).
 */
tf_status tf_nvfp4_amax_cuda(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x, int rht,
                             float *amax, void *stream);

/*
 * tf_nvfp4_quantize over all rows, the amaxes read on the device (*amax and *amax_t, finite and
 * >= 0, as tf_nvfp4_amax_cuda leaves them): nothing waits for the GPU.
 */
tf_status tf_nvfp4_quantize_cuda(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x,
                                 int block_2d, int rht_t, int stochastic, uint64_t seed, const float *amax,
                                 const float *amax_t, uint8_t *y, uint8_t *scale, int64_t ld_scale, uint8_t *y_t,
                                 uint8_t *scale_t, int64_t ld_scale_t, void *stream);

/* tf_block_dequantize over all rows: the values of FP8 data under per-block E8M0 or float32 scales. */
tf_status tf_block_dequantize_cuda(const uint8_t *y, tf_fp8_format format, int64_t rows, int64_t cols,
                                   const void *scale, tf_block_scale_kind kind, int64_t scale_rows,
                                   int64_t scale_cols, int64_t block_rows, int64_t block_cols,
                                   int scale_transposed, void *x, tf_dtype dtype, void *stream);

/* tf_nvfp4_dequantize over all rows, the tensor's amax read on the device. */
tf_status tf_nvfp4_dequantize_cuda(const uint8_t *y, int64_t rows, int64_t cols, const uint8_t *scale,
                                   int64_t ld_scale, const float *amax, void *x, tf_dtype dtype, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* TF_BLOCK_CUDA_H */
