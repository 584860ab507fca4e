// Bias + activation forward, activation + bias gradient (one pass, deterministic
// dbias), and the gated activations' forward/backward on CUDA. See fused_ops_cuda.h.
#include "ops_cuda_common.cuh"

namespace tf_ops_cuda {
namespace {

// The activations are the CPU's (csrc/ops/ops_math.h: tf_ops_act, tf_ops_act_grad), compiled for the
// device, so the ReLU family's selects give the CPU's signs of zero and non-finite g.

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
    store_out(y, scale, i, tf_ops_act(act, v), amax_bits);
  }
  if (y.fp8) fold_amax(amax_bits, y.amax);
}

// Block (column block, row band), see band_block: each thread walks one column down the band's rows,
// so dbias partial sums are formed in row order and warps read whole row segments.
__global__ void __launch_bounds__(kThreads)
    act_bias_backward_kernel(const void *__restrict__ dy, tf_dtype dy_dtype, const void *__restrict__ x,
                             tf_dtype dtype, const void *__restrict__ bias, tf_dtype bias_dtype, int64_t rows,
                             int64_t cols, tf_activation act, Output dx, float *__restrict__ partials) {
  const float scale = dx.fp8 ? *dx.scale : 1.0f;
  uint32_t amax_bits = 0;
  int64_t c = 0, band = 0;
  band_block(cols, &c, &band);
  const int64_t r0 = band * TF_OPS_CUDA_BAND_ROWS;
  const int64_t r1 = rows - r0 < TF_OPS_CUDA_BAND_ROWS ? rows : r0 + TF_OPS_CUDA_BAND_ROWS;
  if (c < cols) {
    const float b = bias ? load(bias, bias_dtype, c) : 0.0f;
    float acc = 0.0f;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = r * cols + c;
      float g = load(dy, dy_dtype, i);
      if (act != TF_ACT_NONE) g = tf_ops_act_grad(act, load(x, dtype, i) + b, g);
      store_out(dx, scale, i, g, amax_bits);
      acc += g;
    }
    if (partials) partials[band * cols + c] = acc;
  }
  if (dx.fp8) fold_amax(amax_bits, dx.amax);
}

// y = act(a) * g with a, g the two halves of each row of x (rows x 2 cols).
__global__ void __launch_bounds__(kThreads)
    gated_act_forward_kernel(const void *__restrict__ x, tf_dtype dtype, int64_t rows, int64_t cols,
                             tf_activation act, Output y) {
  const float scale = y.fp8 ? *y.scale : 1.0f;
  uint32_t amax_bits = 0;
  const int64_t n = rows * cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / cols, c = i % cols;
    const float a = load(x, dtype, 2 * r * cols + c);
    const float g = load(x, dtype, 2 * r * cols + cols + c);
    store_out(y, scale, i, tf_ops_act(act, a) * g, amax_bits);
  }
  if (y.fp8) fold_amax(amax_bits, y.amax);
}

__global__ void __launch_bounds__(kThreads)
    gated_act_backward_kernel(const void *__restrict__ dy, tf_dtype dy_dtype, const void *__restrict__ x,
                              tf_dtype dtype, int64_t rows, int64_t cols, tf_activation act, void *__restrict__ dx) {
  const int64_t n = rows * cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / cols, c = i % cols;
    const int64_t ia = 2 * r * cols + c, ig = ia + cols;
    const float d = load(dy, dy_dtype, i);
    const float a = load(x, dtype, ia);
    const float g = load(x, dtype, ig);
    store(dx, dy_dtype, ia, tf_ops_act_grad(act, a, d * g));  // the CPU's operation order
    store(dx, dy_dtype, ig, d * tf_ops_act(act, a));
  }
}

bool gated_act_ok(tf_activation act) { return tf_activation_known(act) && act != TF_ACT_NONE; }

}  // namespace
}  // namespace tf_ops_cuda

using namespace tf_ops_cuda;

extern "C" tf_status tf_bias_act_forward_cuda(const void *x, tf_dtype dtype, const void *bias, tf_dtype bias_dtype,
                                              int64_t rows, int64_t cols, tf_activation act,
                                              const tf_ops_cuda_output *y, void *stream) {
  if (!dtype_ok(dtype) || (bias && !dtype_ok(bias_dtype))) return TF_ERR_BAD_DTYPE;
  if (!tf_activation_known(act)) return TF_ERR_BAD_ARGUMENT;
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
  if (!tf_activation_known(act)) return TF_ERR_BAD_ARGUMENT;
  const tf_status s = check_shape(rows, cols);
  if (s != TF_OK) return s;
  if (cols == 0) return TF_OK;
  if (dbias && !partials) return TF_ERR_NULL_POINTER;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int64_t bands = tf_ops_cuda_bands(rows);
  if (rows > 0) {
    if (!dy || !x || !output_ok(dx)) return TF_ERR_NULL_POINTER;
    act_bias_backward_kernel<<<band_grid(rows, cols), kThreads, 0, st>>>(dy, dy_dtype, x, dtype, bias, bias_dtype, rows, cols,
                                                        act, make_output(dx), dbias ? partials : nullptr);
  }
  if (dbias) launch_sum_bands(partials, bands, cols, dbias, dbias_dtype, st);
  return launch_status();
}

extern "C" tf_status tf_gated_act_forward_cuda(const void *x, tf_dtype dtype, int64_t rows, int64_t cols,
                                               tf_activation act, const tf_ops_cuda_output *y, void *stream) {
  if (!dtype_ok(dtype)) return TF_ERR_BAD_DTYPE;
  if (!gated_act_ok(act)) return TF_ERR_BAD_ARGUMENT;
  if (cols > INT64_MAX / 2) return TF_ERR_OVERFLOW;
  const tf_status s = check_shape(rows, 2 * cols);
  if (s != TF_OK) return s;
  if (rows * cols == 0) return TF_OK;
  if (!x || !output_ok(y)) return TF_ERR_NULL_POINTER;
  gated_act_forward_kernel<<<grid_for(rows * cols), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      x, dtype, rows, cols, act, make_output(y));
  return launch_status();
}

extern "C" tf_status tf_gated_act_backward_cuda(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                                                int64_t rows, int64_t cols, tf_activation act, void *dx,
                                                void *stream) {
  if (!dtype_ok(dy_dtype) || !dtype_ok(dtype)) return TF_ERR_BAD_DTYPE;
  if (!gated_act_ok(act)) return TF_ERR_BAD_ARGUMENT;
  if (cols > INT64_MAX / 2) return TF_ERR_OVERFLOW;
  const tf_status s = check_shape(rows, 2 * cols);
  if (s != TF_OK) return s;
  if (rows * cols == 0) return TF_OK;
  if (!dy || !x || !dx) return TF_ERR_NULL_POINTER;
  gated_act_backward_kernel<<<grid_for(rows * cols), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      dy, dy_dtype, x, dtype, rows, cols, act, dx);
  return launch_status();
}
