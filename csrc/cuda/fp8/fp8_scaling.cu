// Scaling-factor kernels: the delayed-scaling update (one thread per tensor,
// each touching only its own history column) and current scaling (one thread).
// Both call the TF_HD scaling math of csrc/fp8/fp8_scaling.h, so the scales
// are those of the CPU, and so is 1 / scale (recip_like_cpu).
#include "../../common/tf_checks.h"
#include "fp8_cuda_traits.cuh"
#include "fp8_launch_config.cuh"

namespace tf_cuda {
namespace {

__global__ void __launch_bounds__(kThreads)
    delayed_scaling_update_kernel(float *history, int64_t history_len, int64_t n, float *scale,
                                  float *scale_inv, float fp8_max, int32_t margin,
                                  tf_amax_algo algo) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += stride) {
    const float s =
        tf_fp8_delayed_update_column(history + j, history_len, n, scale[j], fp8_max, margin, algo);
    scale[j] = s;
    scale_inv[j] = recip_like_cpu(s);
  }
}

__global__ void current_scale_kernel(const float *__restrict__ amax, float fp8_max, float epsilon,
                                     int force_pow2, float *__restrict__ scale,
                                     float *__restrict__ scale_inv) {
  const float s = tf_fp8_current_scale(*amax, fp8_max, epsilon, force_pow2);
  *scale = s;
  *scale_inv = recip_like_cpu(s);
}

}  // namespace
}  // namespace tf_cuda

extern "C" tf_status tf_fp8_delayed_scaling_update_cuda(float *amax_history, int64_t history_len,
                                                        int64_t num_scales, float *scale,
                                                        float *scale_inv, float fp8_max,
                                                        int32_t margin, tf_amax_algo algo,
                                                        void *stream) {
  if (history_len < 1 || num_scales < 0) return TF_ERR_BAD_SIZE;
  if (!tf_mul_fits(history_len, num_scales)) return TF_ERR_OVERFLOW;
  if (algo != TF_AMAX_MAX && algo != TF_AMAX_MOST_RECENT) return TF_ERR_BAD_ARGUMENT;
  if (margin < -126 || margin > 126 || !(fp8_max > 0.0f)) return TF_ERR_BAD_ARGUMENT;
  if (num_scales > 0 && (!amax_history || !scale || !scale_inv)) return TF_ERR_NULL_POINTER;
  if (num_scales == 0) return TF_OK;
  int blocks = 0;
  const tf_status st = tf_cuda::grid_blocks(tf_cuda::blocks_for_items(num_scales), &blocks);
  if (st != TF_OK) return st;
  tf_cuda::delayed_scaling_update_kernel<<<blocks, tf_cuda::kThreads, 0,
                                           static_cast<cudaStream_t>(stream)>>>(
      amax_history, history_len, num_scales, scale, scale_inv, fp8_max, margin, algo);
  return tf_cuda::launch_status();
}

extern "C" tf_status tf_fp8_current_scale_cuda(const float *amax, float fp8_max, float epsilon,
                                               int force_pow2, float *scale, float *scale_inv,
                                               void *stream) {
  if (!amax || !scale || !scale_inv) return TF_ERR_NULL_POINTER;
  tf_cuda::current_scale_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(
      amax, fp8_max, epsilon, force_pow2, scale, scale_inv);
  return tf_cuda::launch_status();
}
