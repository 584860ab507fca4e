// Backward preprocess: delta = rowsum(dO * O), the softmax-gradient term of
// every query row, so that the main backward kernel reads one float per row.
#include "attention_bwd_kernels.h"
#include "attention_device.cuh"

namespace tf_attn {
namespace {

constexpr int kRowsPerBlock = 8;  // one warp per (row, head)

__device__ __forceinline__ float2 pair_at(const __nv_bfloat16* p, int64_t i) {
  return __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(p)[i]);
}
__device__ __forceinline__ float2 pair_at(const __half* p, int64_t i) {
  return __half22float2(reinterpret_cast<const __half2*>(p)[i]);
}
__device__ __forceinline__ float2 pair_at(const float* p, int64_t i) {
  return reinterpret_cast<const float2*>(p)[i];
}

template <class T>
__global__ void __launch_bounds__(kRowsPerBlock * 32)
    attention_bwd_delta_kernel(const tf_attn_cuda_problem p, const tf_attn_cuda_tensor dout,
                               const tf_attn_cuda_tensor out, float* delta) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t h = blockIdx.y;
  const SeqRows qr = seq_rows(p.cu_seqlens_q, p.seqlens_q, blockIdx.z, p.seqlen_q);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + warp;
  if (row >= qr.len) return;
  const int64_t token = qr.begin + row;
  const T* d = static_cast<const T*>(dout.data) + qr.batch * dout.stride_batch +
               token * dout.stride_token + h * dout.stride_head;
  const T* o = static_cast<const T*>(out.data) + qr.batch * out.stride_batch +
               token * out.stride_token + h * out.stride_head;
  float sum = 0.0f;
  for (int64_t i = lane; i < p.head_dim / 2; i += 32) {
    const float2 x = pair_at(d, i), y = pair_at(o, i);
    sum += x.x * y.x + x.y * y.y;
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) delta[lse_index(qr, p.heads_q, h, p.seqlen_q, row)] = sum;
}

}  // namespace

tf_status launch_bwd_preprocess(const tf_attn_cuda_problem& p, const tf_attn_cuda_tensor& dout,
                                const tf_attn_cuda_tensor& out, float* delta,
                                cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.seqlen_q + kRowsPerBlock - 1) / kRowsPerBlock),
                  static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.num_seqs));
  constexpr int kThreads = kRowsPerBlock * 32;
  if (p.out_dtype == TF_FLOAT32)
    attention_bwd_delta_kernel<float><<<grid, kThreads, 0, stream>>>(p, dout, out, delta);
  else if (p.out_dtype == TF_BFLOAT16)
    attention_bwd_delta_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p, dout, out, delta);
  else
    attention_bwd_delta_kernel<__half><<<grid, kThreads, 0, stream>>>(p, dout, out, delta);
  return cudaGetLastError() == cudaSuccess ? TF_OK : TF_ERR_CUDA;
}

}  // namespace tf_attn
