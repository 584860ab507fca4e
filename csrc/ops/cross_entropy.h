/*
 * Cross-entropy over the last dimension (the vocabulary) on the CPU, forward statistics and backward,
 * for logits split over tensor-parallel ranks by vocabulary range (TransformerEngine's
 * parallel_cross_entropy).
 *
 * x is a row-major rows x cols matrix (float32, bfloat16 or float16): this rank's vocabulary entries
 * [vocab_start, vocab_start + cols) of each row; target holds one int64 class per row, in
 * [0, vocab_size) or equal to ignore_index. Math is float32; no float32 copy of x is made (each row
 * goes through a tile of TF_OPS_TILE floats on the stack).
 *
 * The forward writes four float32 statistics per row, which the caller combines over the ranks:
 *   stats[4 r + 0] = m     = max_j x[r, j]
 *   stats[4 r + 1] = d     = sum_j exp(x[r, j] - m)
 *   stats[4 r + 2] = x_t   = x[r, target[r] - vocab_start] if the target is on this rank, else 0
 *   stats[4 r + 3] = x_sum = sum_j x[r, j]
 * The backward writes
 *   dx[r, j] = scale[r] * (exp(x[r, j] - lse[r]) - smoothing - on_target * (j is the target))
 * with lse the combined log-sum-exp of the row. Each call handles rows [row_begin, row_end).
 */
#ifndef TF_OPS_CROSS_ENTROPY_H
#define TF_OPS_CROSS_ENTROPY_H

#include <stdint.h>

#include "../common/tf_dtype.h"
#include "../common/tf_status.h"

/* TF_ERR_BAD_ARGUMENT when a target is neither in [0, vocab_size) nor ignore_index. */
tf_status tf_cross_entropy_stats(const void *x, tf_dtype dtype, int64_t rows, int64_t cols,
                                 const int64_t *target, int64_t vocab_start, int64_t vocab_size,
                                 int64_t ignore_index, int64_t row_begin, int64_t row_end, float *stats);

tf_status tf_cross_entropy_backward(const void *x, tf_dtype dtype, int64_t rows, int64_t cols,
                                    const int64_t *target, int64_t vocab_start, int64_t vocab_size,
                                    int64_t ignore_index, const float *lse, const float *scale,
                                    float smoothing, float on_target, int64_t row_begin, int64_t row_end,
                                    void *dx, tf_dtype dx_dtype);

#endif /* TF_OPS_CROSS_ENTROPY_H */
