// RMSNorm / LayerNorm forward and backward on CUDA: one block per row for the
// row statistics and dx, row bands for the deterministic dgamma/dbeta sums.
// See fused_ops_cuda.h.
#include "ops_cuda_common.cuh"

namespace tf_ops_cuda {
namespace {

__device__ __forceinline__ float weight_at(const void *gamma, tf_dtype param_dtype, int zero_centered, int64_t c) {
  const float w = load(gamma, param_dtype, c);
  return zero_centered ? w + 1.0f : w;
}

// mean == nullptr: RMSNorm. Rows are handed out block by block (grid-stride over rows).
__global__ void __launch_bounds__(kThreads)
    norm_forward_kernel(const void *__restrict__ x, tf_dtype dtype, const void *__restrict__ gamma,
                        const void *__restrict__ beta, tf_dtype param_dtype, int zero_centered, float eps,
                        int64_t rows, int64_t cols, Output y, float *__restrict__ mean, float *__restrict__ rstd) {
  const float scale = y.fp8 ? *y.scale : 1.0f;
  uint32_t amax_bits = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t base = r * cols;
    float mu = 0.0f;
    if (mean) {
      float s = 0.0f;
      for (int64_t c = threadIdx.x; c < cols; c += kThreads) s += load(x, dtype, base + c);
      mu = cols > 0 ? block_sum(s) / static_cast<float>(cols) : 0.0f;
    }
    float sq = 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      const float d = load(x, dtype, base + c) - mu;
      sq += d * d;
    }
    const float var = cols > 0 ? block_sum(sq) / static_cast<float>(cols) : 0.0f;
    const float rs = 1.0f / sqrtf(var + eps);
    if (threadIdx.x == 0) {
      rstd[r] = rs;
      if (mean) mean[r] = mu;
    }
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      float v = (load(x, dtype, base + c) - mu) * rs * weight_at(gamma, param_dtype, zero_centered, c);
      if (mean) v += load(beta, param_dtype, c);
      store_out(y, scale, base + c, v, amax_bits);
    }
  }
  if (y.fp8) fold_amax(amax_bits, y.amax);
}

// dx = rstd * (g - mean(g) [LayerNorm only] - xhat * mean(g * xhat)), g = dy * w.
__global__ void __launch_bounds__(kThreads)
    norm_dx_kernel(const void *__restrict__ dy, tf_dtype dy_dtype, const void *__restrict__ x, tf_dtype dtype,
                   const float *__restrict__ mean, const float *__restrict__ rstd, const void *__restrict__ gamma,
                   tf_dtype param_dtype, int zero_centered, int64_t rows, int64_t cols, void *__restrict__ dx) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t base = r * cols;
    const float mu = mean ? mean[r] : 0.0f;
    const float rs = rstd[r];
    float sg = 0.0f, sgx = 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      const float g = load(dy, dy_dtype, base + c) * weight_at(gamma, param_dtype, zero_centered, c);
      sg += g;
      sgx += g * (load(x, dtype, base + c) - mu) * rs;
    }
    const float mean_g = mean ? block_sum(sg) / static_cast<float>(cols) : 0.0f;
    const float mean_gx = block_sum(sgx) / static_cast<float>(cols);
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      const float xhat = (load(x, dtype, base + c) - mu) * rs;
      const float g = load(dy, dy_dtype, base + c) * weight_at(gamma, param_dtype, zero_centered, c);
      store(dx, dy_dtype, base + c, rs * (g - mean_g - xhat * mean_gx));
    }
  }
}

// Per (column, band): sums of dy * xhat (dgamma) and dy (dbeta) over the band's rows, in row order.
__global__ void __launch_bounds__(kThreads)
    norm_dparams_kernel(const void *__restrict__ dy, tf_dtype dy_dtype, const void *__restrict__ x, tf_dtype dtype,
                        const float *__restrict__ mean, const float *__restrict__ rstd, int64_t rows, int64_t cols,
                        float *__restrict__ dgamma_partials, float *__restrict__ dbeta_partials) {
  int64_t c = 0, band = 0;
  band_block(cols, &c, &band);
  if (c >= cols) return;
  const int64_t r0 = band * TF_OPS_CUDA_BAND_ROWS;
  const int64_t r1 = rows - r0 < TF_OPS_CUDA_BAND_ROWS ? rows : r0 + TF_OPS_CUDA_BAND_ROWS;
  float dg = 0.0f, db = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const float d = load(dy, dy_dtype, r * cols + c);
    const float mu = mean ? mean[r] : 0.0f;
    dg += d * (load(x, dtype, r * cols + c) - mu) * rstd[r];
    db += d;
  }
  dgamma_partials[band * cols + c] = dg;
  if (dbeta_partials) dbeta_partials[band * cols + c] = db;
}

unsigned int row_blocks(int64_t rows) {
  return static_cast<unsigned int>(rows < 1 ? 1 : rows > kMaxBlocks ? kMaxBlocks : rows);
}

}  // namespace
}  // namespace tf_ops_cuda

using namespace tf_ops_cuda;

extern "C" tf_status tf_norm_forward_cuda(const void *x, tf_dtype dtype, const void *gamma, const void *beta,
                                          tf_dtype param_dtype, int zero_centered_gamma, float eps, int64_t rows,
                                          int64_t cols, const tf_ops_cuda_output *y, float *mean, float *rstd,
                                          void *stream) {
  if (!dtype_ok(dtype) || !dtype_ok(param_dtype)) return TF_ERR_BAD_DTYPE;
  if (!(eps >= 0.0f)) return TF_ERR_BAD_ARGUMENT;
  const tf_status s = check_shape(rows, cols);
  if (s != TF_OK) return s;
  if (rows == 0) return TF_OK;
  if (!x || !gamma || !rstd || !output_ok(y) || (mean && !beta)) return TF_ERR_NULL_POINTER;
  norm_forward_kernel<<<row_blocks(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      x, dtype, gamma, beta, param_dtype, zero_centered_gamma, eps, rows, cols, make_output(y), mean, rstd);
  return launch_status();
}

extern "C" tf_status tf_norm_backward_cuda(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                                           const float *mean, const float *rstd, const void *gamma,
                                           tf_dtype param_dtype, int zero_centered_gamma, int64_t rows, int64_t cols,
                                           void *dx, float *partials, void *dgamma, void *dbeta, void *stream) {
  if (!dtype_ok(dy_dtype) || !dtype_ok(dtype) || !dtype_ok(param_dtype)) return TF_ERR_BAD_DTYPE;
  const tf_status s = check_shape(rows, cols);
  if (s != TF_OK) return s;
  if (cols == 0) return TF_OK;
  if (!partials || !dgamma || (mean && !dbeta)) return TF_ERR_NULL_POINTER;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int64_t bands = tf_ops_cuda_bands(rows);
  float *dgamma_partials = partials;
  float *dbeta_partials = mean ? partials + bands * cols : nullptr;
  if (rows > 0) {
    if (!dy || !x || !rstd || !gamma || !dx) return TF_ERR_NULL_POINTER;
    norm_dx_kernel<<<row_blocks(rows), kThreads, 0, st>>>(dy, dy_dtype, x, dtype, mean, rstd, gamma, param_dtype,
                                                          zero_centered_gamma, rows, cols, dx);
    norm_dparams_kernel<<<band_grid(rows, cols), kThreads, 0, st>>>(dy, dy_dtype, x, dtype, mean, rstd, rows, cols,
                                                   dgamma_partials, dbeta_partials);
  }
  launch_sum_bands(dgamma_partials, bands, cols, dgamma, param_dtype, st);
  if (mean) launch_sum_bands(dbeta_partials, bands, cols, dbeta, param_dtype, st);
  return launch_status();
}
