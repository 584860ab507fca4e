// Quantize (with amax) and amax-only kernels: grid-stride loops over 16-byte
// vectors of the input, a scalar tail, and a scalar path for misaligned buffers.
#include <type_traits>

#include "fp8_amax_reduce.cuh"
#include "fp8_cuda_traits.cuh"
#include "fp8_launch_config.cuh"

namespace tf_cuda {
namespace {

// Format trait of the amax-only kernel: no output is written.
struct NoOutput {};

// amax of x[i]; with an FP8 format also y[i] = fp8(x[i] * scale), the product
// formed as on the CPU (mul_like_cpu).
template <class Elem, class Fmt, bool kVectorized>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const typename Elem::Storage *__restrict__ x, int64_t n,
                    const float *__restrict__ scale_ptr, uint8_t *__restrict__ y, float *amax) {
  constexpr bool kWrites = !std::is_same<Fmt, NoOutput>::value;
  constexpr int V = kVecElems<Elem>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  float scale = 0.0f;
  if constexpr (kWrites) scale = *scale_ptr;
  uint32_t amax_bits = 0;
  int64_t tail_begin = 0;
  if constexpr (kVectorized) {
    const int64_t vectors = n / V;
    for (int64_t i = tid; i < vectors; i += stride) {
      typename Elem::Storage v[V];
      load_vec<kVecBytes>(x + i * V, v);
      uint8_t q[V];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float f = Elem::to_f32(v[k]);
        const uint32_t a = abs_bits(f);
        amax_bits = a > amax_bits ? a : amax_bits;
        if constexpr (kWrites) q[k] = Fmt::encode(mul_like_cpu(f, scale));
      }
      if constexpr (kWrites) store_vec<V>(y + i * V, q);
    }
    tail_begin = vectors * V;
  }
  for (int64_t i = tail_begin + tid; i < n; i += stride) {
    const float f = Elem::to_f32(x[i]);
    const uint32_t a = abs_bits(f);
    amax_bits = a > amax_bits ? a : amax_bits;
    if constexpr (kWrites) y[i] = Fmt::encode(mul_like_cpu(f, scale));
  }
  block_fold_amax(amax_bits, amax);
}

// Vectorized when x is 16-byte aligned and y aligned to one vector of FP8 bytes.
template <class Elem, class Fmt>
tf_status launch_quantize(const void *x, int64_t n, const float *scale, uint8_t *y, float *amax,
                          cudaStream_t stream) {
  using S = typename Elem::Storage;
  constexpr int V = kVecElems<Elem>;
  const bool vectorized = reinterpret_cast<uintptr_t>(x) % kVecBytes == 0 &&
                          reinterpret_cast<uintptr_t>(y) % V == 0;
  int blocks = 0;
  const tf_status st = grid_blocks(blocks_for_items(vectorized ? n / V + n % V : n), &blocks);
  if (st != TF_OK) return st;
  const S *xs = static_cast<const S *>(x);
  if (vectorized)
    quantize_kernel<Elem, Fmt, true><<<blocks, kThreads, 0, stream>>>(xs, n, scale, y, amax);
  else
    quantize_kernel<Elem, Fmt, false><<<blocks, kThreads, 0, stream>>>(xs, n, scale, y, amax);
  return launch_status();
}

}  // namespace
}  // namespace tf_cuda

extern "C" tf_status tf_fp8_quantize_cuda(const void *x, tf_dtype dtype, int64_t n,
                                          const float *scale, tf_fp8_format format, uint8_t *y,
                                          float *amax, void *stream) {
  if (!scale || !amax) return TF_ERR_NULL_POINTER;
  if (n < 0) return TF_ERR_BAD_SIZE;
  if (n > 0 && (!x || !y)) return TF_ERR_NULL_POINTER;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return tf_cuda::dispatch_dtype(dtype, [&](auto elem) {
    return tf_cuda::dispatch_format(format, [&](auto fmt) {
      return tf_cuda::launch_quantize<decltype(elem), decltype(fmt)>(x, n, scale, y, amax, s);
    });
  });
}

extern "C" tf_status tf_fp8_amax_cuda(const void *x, tf_dtype dtype, int64_t n, float *amax,
                                      void *stream) {
  if (!amax) return TF_ERR_NULL_POINTER;
  if (n < 0) return TF_ERR_BAD_SIZE;
  if (n > 0 && !x) return TF_ERR_NULL_POINTER;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return tf_cuda::dispatch_dtype(dtype, [&](auto elem) {
    return tf_cuda::launch_quantize<decltype(elem), tf_cuda::NoOutput>(x, n, nullptr, nullptr,
                                                                       amax, s);
  });
}
