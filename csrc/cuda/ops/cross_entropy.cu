// Cross-entropy over a vocabulary shard on CUDA: one block per row (grid-stride over rows) for the row
// statistics and for the gradient. See cross_entropy_cuda.h and csrc/ops/cross_entropy.h.
#include "ops_cuda_common.cuh"

#include "cross_entropy_cuda.h"

namespace tf_ops_cuda {
namespace {

// exp(v) for v = x - m <= 0, 0 past tf_ops_expf's clamp (as the CPU kernel).
__device__ __forceinline__ float exp_nonpositive(float v) {
  const float e = tf_ops_expf(v);
  return v < -TF_OPS_EXP_LIMIT ? 0.0f : e;
}

// Block-wide max (a NaN-free input: the per-thread maxima skip NaN as the CPU loop does); every thread gets it.
__device__ __forceinline__ float block_max(float v) {
  __shared__ float warp_max[kThreads / 32];
  __shared__ float total;
  for (int mask = 16; mask > 0; mask /= 2) {
    const float other = __shfl_xor_sync(0xFFFFFFFFu, v, mask);
    v = other > v ? other : v;
  }
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = warp_max[0];
    for (int w = 1; w < kThreads / 32; ++w) t = warp_max[w] > t ? warp_max[w] : t;
    total = t;
  }
  __syncthreads();
  const float result = total;
  __syncthreads();
  return result;
}

__device__ __forceinline__ bool target_ok(int64_t t, int64_t vocab_size, int64_t ignore_index) {
  return t == ignore_index || (t >= 0 && t < vocab_size);
}

__global__ void __launch_bounds__(kThreads)
    stats_kernel(const void *__restrict__ x, tf_dtype dtype, int64_t rows, int64_t cols,
                 const int64_t *__restrict__ target, int64_t vocab_start, int64_t vocab_size, int64_t ignore_index,
                 float *__restrict__ stats) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t base = r * cols;
    float m = -INFINITY, s = 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      const float v = load(x, dtype, base + c);
      m = v > m ? v : m;
      s += v;
    }
    m = block_max(m);
    const float sum = block_sum(s);
    float d = 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) d += exp_nonpositive(load(x, dtype, base + c) - m);
    d = block_sum(d);
    if (threadIdx.x == 0) {
      const int64_t t = target[r];
      const int64_t col = t - vocab_start;  // no overflow: vocab_start is in [0, vocab_size)
      float xt = 0.0f;
      if (!target_ok(t, vocab_size, ignore_index))
        xt = NAN;
      else if (t != ignore_index && col >= 0 && col < cols)
        xt = load(x, dtype, base + col);
      stats[4 * r] = m;
      stats[4 * r + 1] = d;
      stats[4 * r + 2] = xt;
      stats[4 * r + 3] = sum;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    backward_kernel(const void *__restrict__ x, tf_dtype dtype, int64_t rows, int64_t cols,
                    const int64_t *__restrict__ target, int64_t vocab_start, int64_t vocab_size, int64_t ignore_index,
                    const float *__restrict__ lse, const float *__restrict__ scale, float smoothing, float on_target,
                    void *__restrict__ dx) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t base = r * cols;
    const int64_t t = target[r];
    if (t == ignore_index) {
      for (int64_t c = threadIdx.x; c < cols; c += kThreads) store(dx, dtype, base + c, 0.0f);
      continue;
    }
    const bool ok = target_ok(t, vocab_size, ignore_index);
    const int64_t col = t - vocab_start;
    const int64_t local = ok && col >= 0 && col < cols ? col : -1;
    const float l = lse[r], sc = ok ? scale[r] : NAN;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      const float e = exp_nonpositive(load(x, dtype, base + c) - l);
      store(dx, dtype, base + c, c == local ? sc * (e - smoothing - on_target) : sc * (e - smoothing));
    }
  }
}

inline unsigned int row_grid(int64_t rows) {
  return static_cast<unsigned int>(rows < 1 ? 1 : rows > kMaxBlocks ? kMaxBlocks : rows);
}

tf_status check(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, const int64_t *target,
                int64_t vocab_start, int64_t vocab_size) {
  if (!dtype_ok(dtype)) return TF_ERR_BAD_DTYPE;
  if (rows < 0 || cols < 0) return TF_ERR_BAD_SIZE;
  if (cols > 0 && rows > (INT64_C(1) << 62) / cols) return TF_ERR_OVERFLOW;
  if (vocab_start < 0 || vocab_size < 1 || cols > vocab_size || vocab_start > vocab_size - cols)
    return TF_ERR_BAD_SIZE;
  if (rows > 0 && (!target || (cols > 0 && !x))) return TF_ERR_NULL_POINTER;
  return TF_OK;
}

}  // namespace
}  // namespace tf_ops_cuda

using namespace tf_ops_cuda;

extern "C" tf_status tf_cross_entropy_stats_cuda(const void *x, tf_dtype dtype, int64_t rows, int64_t cols,
                                                 const int64_t *target, int64_t vocab_start, int64_t vocab_size,
                                                 int64_t ignore_index, float *stats, void *stream) {
  const tf_status s = check(x, dtype, rows, cols, target, vocab_start, vocab_size);
  if (s != TF_OK) return s;
  if (rows == 0) return TF_OK;
  if (!stats) return TF_ERR_NULL_POINTER;
  stats_kernel<<<row_grid(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      x, dtype, rows, cols, target, vocab_start, vocab_size, ignore_index, stats);
  return launch_status();
}

extern "C" tf_status tf_cross_entropy_backward_cuda(const void *x, tf_dtype dtype, int64_t rows, int64_t cols,
                                                    const int64_t *target, int64_t vocab_start, int64_t vocab_size,
                                                    int64_t ignore_index, const float *lse, const float *scale,
                                                    float smoothing, float on_target, void *dx, void *stream) {
  const tf_status s = check(x, dtype, rows, cols, target, vocab_start, vocab_size);
  if (s != TF_OK) return s;
  if (rows == 0 || cols == 0) return TF_OK;
  if (!lse || !scale || !dx) return TF_ERR_NULL_POINTER;
  backward_kernel<<<row_grid(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      x, dtype, rows, cols, target, vocab_start, vocab_size, ignore_index, lse, scale, smoothing, on_target, dx);
  return launch_status();
}
