// Dequantize kernel: grid-stride loop writing 16-byte vectors of the output from
// one FP8 word each, a scalar tail, and a scalar path for misaligned buffers.
#include "fp8_cuda_traits.cuh"
#include "fp8_launch_config.cuh"

namespace tf_cuda {
namespace {

// x[i] = dtype(decode(y[i]) * scale_inv), the product formed as on the CPU.
template <class Fmt, class Elem, bool kVectorized>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t *__restrict__ y, int64_t n,
                      const float *__restrict__ scale_inv_ptr,
                      typename Elem::Storage *__restrict__ x) {
  constexpr int V = kVecElems<Elem>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const float scale_inv = *scale_inv_ptr;
  int64_t tail_begin = 0;
  if constexpr (kVectorized) {
    const int64_t vectors = n / V;
    for (int64_t i = tid; i < vectors; i += stride) {
      uint8_t q[V];
      load_vec<V>(y + i * V, q);
      typename Elem::Storage v[V];
#pragma unroll
      for (int k = 0; k < V; ++k)
        v[k] = Elem::from_f32(mul_like_cpu(Fmt::decode(q[k]), scale_inv));
      store_vec<kVecBytes>(x + i * V, v);
    }
    tail_begin = vectors * V;
  }
  for (int64_t i = tail_begin + tid; i < n; i += stride)
    x[i] = Elem::from_f32(mul_like_cpu(Fmt::decode(y[i]), scale_inv));
}

// Vectorized when x is 16-byte aligned and y aligned to one vector of FP8 bytes.
template <class Fmt, class Elem>
tf_status launch_dequantize(const uint8_t *y, int64_t n, const float *scale_inv, void *x,
                            cudaStream_t stream) {
  using S = typename Elem::Storage;
  constexpr int V = kVecElems<Elem>;
  const bool vectorized = reinterpret_cast<uintptr_t>(x) % kVecBytes == 0 &&
                          reinterpret_cast<uintptr_t>(y) % V == 0;
  int blocks = 0;
  const tf_status st = grid_blocks(blocks_for_items(vectorized ? n / V + n % V : n), &blocks);
  if (st != TF_OK) return st;
  S *xs = static_cast<S *>(x);
  if (vectorized)
    dequantize_kernel<Fmt, Elem, true><<<blocks, kThreads, 0, stream>>>(y, n, scale_inv, xs);
  else
    dequantize_kernel<Fmt, Elem, false><<<blocks, kThreads, 0, stream>>>(y, n, scale_inv, xs);
  return launch_status();
}

}  // namespace
}  // namespace tf_cuda

extern "C" tf_status tf_fp8_dequantize_cuda(const uint8_t *y, tf_fp8_format format, int64_t n,
                                            const float *scale_inv, void *x, tf_dtype dtype,
                                            void *stream) {
  if (!scale_inv) return TF_ERR_NULL_POINTER;
  if (n < 0) return TF_ERR_BAD_SIZE;
  if (n > 0 && (!x || !y)) return TF_ERR_NULL_POINTER;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return tf_cuda::dispatch_format(format, [&](auto fmt) {
    return tf_cuda::dispatch_dtype(dtype, [&](auto elem) {
      return tf_cuda::launch_dequantize<decltype(fmt), decltype(elem)>(y, n, scale_inv, x, s);
    });
  });
}
