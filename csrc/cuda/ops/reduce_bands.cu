// The last step of the deterministic column reductions (dbias, dgamma, dbeta):
// the per-band partial sums added up in band order, one thread per column.
#include "ops_cuda_common.cuh"

namespace tf_ops_cuda {
namespace {

__global__ void __launch_bounds__(kThreads)
    sum_bands_kernel(const float *__restrict__ partials, int64_t bands, int64_t cols, void *out,
                     tf_dtype out_dtype) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= cols) return;
  float acc = 0.0f;
  for (int64_t b = 0; b < bands; ++b) acc += partials[b * cols + c];
  store(out, out_dtype, c, acc);
}

}  // namespace

// grid_for caps the grid at kMaxBlocks; check_shape keeps cols within kMaxBlocks blocks.
void launch_sum_bands(const float *partials, int64_t bands, int64_t cols, void *out, tf_dtype out_dtype,
                      cudaStream_t stream) {
  sum_bands_kernel<<<grid_for(cols), kThreads, 0, stream>>>(partials, bands, cols, out, out_dtype);
}

}  // namespace tf_ops_cuda
