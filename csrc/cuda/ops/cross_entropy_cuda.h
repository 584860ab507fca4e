/*
 * extern "C" launchers of the cross-entropy kernels on CUDA, the twins of csrc/ops/cross_entropy.h (same
 * arguments and results, one launch for all rows). Device pointers on the current device; work is enqueued on
 * `stream` (a cudaStream_t) and nothing waits. The row statistics are summed in a fixed tree order
 * (deterministic; they differ from the CPU's by float32 rounding). A target neither in [0, vocab_size) nor
 * ignore_index cannot be reported without a host sync: its row gets a NaN target logit (so a NaN loss) and
 * a NaN gradient, where the CPU kernels refuse the call.
 */
#ifndef TF_CROSS_ENTROPY_CUDA_H
#define TF_CROSS_ENTROPY_CUDA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "../../common/tf_dtype.h"
#include "../../common/tf_status.h"

tf_status tf_cross_entropy_stats_cuda(const void *x, tf_dtype dtype, int64_t rows, int64_t cols,
                                      const int64_t *target, int64_t vocab_start, int64_t vocab_size,
                                      int64_t ignore_index, float *stats, void *stream);

tf_status tf_cross_entropy_backward_cuda(const void *x, tf_dtype dtype, int64_t rows, int64_t cols,
                                         const int64_t *target, int64_t vocab_start, int64_t vocab_size,
                                         int64_t ignore_index, const float *lse, const float *scale, float smoothing,
                                         float on_target, void *dx, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* TF_CROSS_ENTROPY_CUDA_H */
