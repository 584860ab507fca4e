// Bias + activation forward, activation + bias gradient (one pass, deterministic
// dbias), and SwiGLU forward/backward on CUDA. See fused_ops_cuda.h.
#include "ops_cuda_common.cuh"

namespace tf_ops_cuda {
namespace {

constexpr float kGeluK0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluK1 = 0.044715f;

__device__ __forceinline__ float act_forward(tf_activation act, float x) {
  if (act == TF_ACT_GELU_TANH) return 0.5f * x * (1.0f + tanhf(kGeluK0 * (x + kGeluK1 * x * x * x)));
  if (act == TF_ACT_RELU) return x > 0.0f ? x : 0.0f;
  return x;
}

__device__ __forceinline__ float act_derivative(tf_activation act, float x) {
  if (act == TF_ACT_GELU_TANH) {
    const float t = tanhf(kGeluK0 * (x + kGeluK1 * x * x * x));
    const float du = kGeluK0 * (1.0f + 3.0f * kGeluK1 * x * x);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
  }
  if (act == TF_ACT_RELU) return x > 0.0f ? 1.0f : 0.0f;
  return 1.0f;
}

__global__ void __launch_bounds__(kThreads)
    bias_act_forward_kernel(const void *__restrict__ x, tf_dtype dtype, const void *__restrict__ bias,
                            tf_dtype bias_dtype, int64_t rows, int64_t cols, tf_activation act, Output y) {
  const float scale = y.fp8 ? *y.scale : 1.0f;
  uint32_t amax_bits = 0;
  const int64_t n = rows * cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    float v = load(x, dtype, i);
    if (bias) v += load(bias, bias_dtype, i % cols);
    store_out(y, scale, i, act_forward(act, v), amax_bits);
  }
  if (y.fp8) fold_amax(amax_bits, y.amax);
}

// Block (column block, row band): each thread walks one column down the band's rows,
// so dbias partial sums are formed in row order and warps read whole row segments.
__global__ void __launch_bounds__(kThreads)
    act_bias_backward_kernel(const void *__restrict__ dy, tf_dtype dy_dtype, const void *__restrict__ x,
                             tf_dtype dtype, const void *__restrict__ bias, tf_dtype bias_dtype, int64_t rows,
                             int64_t cols, tf_activation act, Output dx, float *__restrict__ partials) {
  const float scale = dx.fp8 ? *dx.scale : 1.0f;
  uint32_t amax_bits = 0;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t band = blockIdx.y;
  const int64_t r0 = band * TF_OPS_CUDA_BAND_ROWS;
  const int64_t r1 = rows - r0 < TF_OPS_CUDA_BAND_ROWS ? rows : r0 + TF_OPS_CUDA_BAND_ROWS;
  if (c < cols) {
    const float b = bias ? load(bias, bias_dtype, c) : 0.0f;
    float acc = 0.0f;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = r * cols + c;
      float g = load(dy, dy_dtype, i);
      if (act != TF_ACT_NONE) g *= act_derivative(act, load(x, dtype, i) + b);
      store_out(dx, scale, i, g, amax_bits);
      acc += g;
    }
    if (partials) partials[band * cols + c] = acc;
  }
  if (dx.fp8) fold_amax(amax_bits, dx.amax);
}

__device__ __forceinline__ float sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }

__global__ void __launch_bounds__(kThreads)
    swiglu_forward_kernel(const void *__restrict__ x, tf_dtype dtype, int64_t rows, int64_t cols, Output y) {
  const float scale = y.fp8 ? *y.scale : 1.0f;
  uint32_t amax_bits = 0;
  const int64_t n = rows * cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / cols, c = i % cols;
    const float a = load(x, dtype, 2 * r * cols + c);
    const float g = load(x, dtype, 2 * r * cols + cols + c);
    store_out(y, scale, i, a * sigmoid(a) * g, amax_bits);
  }
  if (y.fp8) fold_amax(amax_bits, y.amax);
}

__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const void *__restrict__ dy, tf_dtype dy_dtype, const void *__restrict__ x,
                           tf_dtype dtype, int64_t rows, int64_t cols, void *__restrict__ dx) {
  const int64_t n = rows * cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / cols, c = i % cols;
    const int64_t ia = 2 * r * cols + c, ig = ia + cols;
    const float d = load(dy, dy_dtype, i);
    const float a = load(x, dtype, ia);
    const float g = load(x, dtype, ig);
    const float sig = sigmoid(a);
    store(dx, dy_dtype, ia, d * g * sig * (1.0f + a * (1.0f - sig)));
    store(dx, dy_dtype, ig, d * a * sig);
  }
}

bool act_ok(tf_activation act) { return act == TF_ACT_NONE || act == TF_ACT_GELU_TANH || act == TF_ACT_RELU; }

}  // namespace
}  // namespace tf_ops_cuda

using namespace tf_ops_cuda;

extern "C" tf_status tf_bias_act_forward_cuda(const void *x, tf_dtype dtype, const void *bias, tf_dtype bias_dtype,
                                              int64_t rows, int64_t cols, tf_activation act,
                                              const tf_ops_cuda_output *y, void *stream) {
  if (!dtype_ok(dtype) || (bias && !dtype_ok(bias_dtype))) return TF_ERR_BAD_DTYPE;
  if (!act_ok(act)) return TF_ERR_BAD_ARGUMENT;
  const tf_status s = check_shape(rows, cols);
  if (s != TF_OK) return s;
  if (rows * cols == 0) return TF_OK;
  if (!x || !output_ok(y)) return TF_ERR_NULL_POINTER;
  bias_act_forward_kernel<<<grid_for(rows * cols), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      x, dtype, bias, bias_dtype, rows, cols, act, make_output(y));
  return launch_status();
}

extern "C" tf_status tf_act_bias_backward_cuda(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                                               const void *bias, tf_dtype bias_dtype, int64_t rows, int64_t cols,
                                               tf_activation act, const tf_ops_cuda_output *dx, float *partials,
                                               void *dbias, tf_dtype dbias_dtype, void *stream) {
  if (!dtype_ok(dy_dtype) || !dtype_ok(dtype) || (bias && !dtype_ok(bias_dtype))) return TF_ERR_BAD_DTYPE;
  if (dbias && !dtype_ok(dbias_dtype)) return TF_ERR_BAD_DTYPE;
  if (!act_ok(act)) return TF_ERR_BAD_ARGUMENT;
  const tf_status s = check_shape(rows, cols);
  if (s != TF_OK) return s;
  if (cols == 0) return TF_OK;
  if (dbias && !partials) return TF_ERR_NULL_POINTER;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int64_t bands = tf_ops_cuda_bands(rows);
  if (rows > 0) {
    if (!dy || !x || !output_ok(dx)) return TF_ERR_NULL_POINTER;
    const dim3 grid(grid_for(cols), static_cast<unsigned int>(bands));
    act_bias_backward_kernel<<<grid, kThreads, 0, st>>>(dy, dy_dtype, x, dtype, bias, bias_dtype, rows, cols,
                                                        act, make_output(dx), dbias ? partials : nullptr);
  }
  if (dbias) launch_sum_bands(partials, bands, cols, dbias, dbias_dtype, st);
  return launch_status();
}

extern "C" tf_status tf_swiglu_forward_cuda(const void *x, tf_dtype dtype, int64_t rows, int64_t cols,
                                            const tf_ops_cuda_output *y, void *stream) {
  if (!dtype_ok(dtype)) return TF_ERR_BAD_DTYPE;
  if (cols > INT64_MAX / 2) return TF_ERR_OVERFLOW;
  const tf_status s = check_shape(rows, 2 * cols);
  if (s != TF_OK) return s;
  if (rows * cols == 0) return TF_OK;
  if (!x || !output_ok(y)) return TF_ERR_NULL_POINTER;
  swiglu_forward_kernel<<<grid_for(rows * cols), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      x, dtype, rows, cols, make_output(y));
  return launch_status();
}

extern "C" tf_status tf_swiglu_backward_cuda(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                                             int64_t rows, int64_t cols, void *dx, void *stream) {
  if (!dtype_ok(dy_dtype) || !dtype_ok(dtype)) return TF_ERR_BAD_DTYPE;
  if (cols > INT64_MAX / 2) return TF_ERR_OVERFLOW;
  const tf_status s = check_shape(rows, 2 * cols);
  if (s != TF_OK) return s;
  if (rows * cols == 0) return TF_OK;
  if (!dy || !x || !dx) return TF_ERR_NULL_POINTER;
  swiglu_backward_kernel<<<grid_for(rows * cols), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      dy, dy_dtype, x, dtype, rows, cols, dx);
  return launch_status();
}
