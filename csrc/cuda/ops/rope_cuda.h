/*
 * extern "C" launchers of rotary position embedding on CUDA (the CUDA twins of csrc/ops/rope.h,
 * same problem description and semantics; freqs, cu_seqlens and start_positions are device pointers).
 *
 * Every size and stride is checked on the host (tf_rope_check_shape, tf_rope_check_view); the device
 * arrays are not read there, so nothing waits for the GPU. A token that cu_seqlens or start_positions
 * misplace (outside its sequence, an odd local length under context parallelism, a position outside
 * freqs) gets NaN in every channel instead of a read out of bounds. Math is the C core's float32
 * (products and sums rounded separately, no FMA contraction; cosf/sinf may differ from the host's by
 * an ulp). Work is enqueued on `stream` (a cudaStream_t); TF_ERR_CUDA means the launch failed.
 */
#ifndef TF_ROPE_CUDA_H
#define TF_ROPE_CUDA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "../../common/tf_dtype.h"
#include "../../common/tf_status.h"
#include "../../ops/rope.h"

tf_status tf_rope_forward_cuda(const tf_rope_problem *p, tf_dtype dtype, const void *x, const int64_t x_strides[4],
                               void *y, const int64_t y_strides[4], void *stream);

tf_status tf_rope_backward_cuda(const tf_rope_problem *p, tf_dtype dtype, const void *dy,
                                const int64_t dy_strides[4], void *dx, const int64_t dx_strides[4], void *stream);

#ifdef __cplusplus
}
#endif

#endif /* TF_ROPE_CUDA_H */
