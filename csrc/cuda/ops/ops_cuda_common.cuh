// Device helpers of the fused-op CUDA kernels: element loads/stores by dtype,
// the FP8 output path, block reductions and launch sizes.
#pragma once

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "fused_ops_cuda.h"

namespace tf_ops_cuda {

constexpr int kThreads = 256;  // threads per block of every kernel here
constexpr int kMaxBlocks = 65535;

__device__ __forceinline__ float load(const void *p, tf_dtype dtype, int64_t i) {
  if (dtype == TF_FLOAT32) return static_cast<const float *>(p)[i];
  const uint16_t h = static_cast<const uint16_t *>(p)[i];
  return dtype == TF_BFLOAT16 ? tf_bf16_to_f32(h) : tf_f16_to_f32(h);
}

__device__ __forceinline__ void store(void *p, tf_dtype dtype, int64_t i, float v) {
  if (dtype == TF_FLOAT32) {
    static_cast<float *>(p)[i] = v;
  } else {
    static_cast<uint16_t *>(p)[i] = dtype == TF_BFLOAT16 ? tf_f32_to_bf16(v) : tf_f32_to_f16(v);
  }
}

// The output descriptor with the FP8 scale already read from the device.
struct Output {
  void *data;
  tf_dtype dtype;
  int fp8;
  tf_fp8_format format;
  const float *scale;
  float *amax;
};

inline Output make_output(const tf_ops_cuda_output *o) {
  return Output{o->data, o->dtype, o->fp8, o->format, o->scale, o->amax};
}

// Stores v at i; for an FP8 output also raises the thread's amax bits. The scale
// product is rounded on its own (no FMA contraction), as on the CPU.
__device__ __forceinline__ void store_out(const Output &o, float scale, int64_t i, float v,
                                          uint32_t &amax_bits) {
  if (o.fp8) {
    const uint32_t a = tf_f32_bits(v) & 0x7FFFFFFFu;
    amax_bits = a > amax_bits ? a : amax_bits;
    const float s = __fmul_rn(v, scale);
    static_cast<uint8_t *>(o.data)[i] = o.format == TF_FP8_E4M3 ? tf_fp8_e4m3_encode(s) : tf_fp8_e5m2_encode(s);
  } else {
    store(o.data, o.dtype, i, v);
  }
}

// Block-wide max of amax bits folded into *amax (an unsigned max on the bits of non-negative floats).
__device__ __forceinline__ void fold_amax(uint32_t bits, float *amax) {
  __shared__ uint32_t warp_max[kThreads / 32];
  for (int mask = 16; mask > 0; mask /= 2) {
    const uint32_t other = __shfl_xor_sync(0xFFFFFFFFu, bits, mask);
    bits = other > bits ? other : bits;
  }
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = bits;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t m = 0;
    for (int w = 0; w < kThreads / 32; ++w) m = warp_max[w] > m ? warp_max[w] : m;
    atomicMax(reinterpret_cast<unsigned int *>(amax), m);
  }
}

// Block-wide sum in a fixed tree order (deterministic); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sum[kThreads / 32];
  __shared__ float total;
  for (int mask = 16; mask > 0; mask /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, mask);
  if (threadIdx.x % 32 == 0) warp_sum[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) t += warp_sum[w];
    total = t;
  }
  __syncthreads();
  const float result = total;
  __syncthreads();  // total and warp_sum are reused by the next call
  return result;
}

// Blocks for a grid-stride loop over n items (at least 1, at most kMaxBlocks).
inline unsigned int grid_for(int64_t n) {
  const int64_t blocks = n / kThreads + (n % kThreads != 0);
  return static_cast<unsigned int>(blocks < 1 ? 1 : blocks > kMaxBlocks ? kMaxBlocks : blocks);
}

inline tf_status launch_status() { return cudaGetLastError() == cudaSuccess ? TF_OK : TF_ERR_CUDA; }

inline bool dtype_ok(tf_dtype d) { return d == TF_FLOAT32 || d == TF_BFLOAT16 || d == TF_FLOAT16; }

inline bool output_ok(const tf_ops_cuda_output *o) {
  if (!o || !o->data) return false;
  if (o->fp8) return (o->format == TF_FP8_E4M3 || o->format == TF_FP8_E5M2) && o->scale && o->amax;
  return dtype_ok(o->dtype);
}

// Blocks of kThreads columns each.
inline int64_t column_blocks(int64_t cols) { return cols / kThreads + (cols % kThreads != 0); }

// rows x cols with every index below 2^62, and the (column block x band) grid of
// the band kernels within a 1-D grid's 2^31 - 1 blocks.
inline tf_status check_shape(int64_t rows, int64_t cols) {
  if (rows < 0 || cols < 0) return TF_ERR_BAD_SIZE;
  if (cols > 0 && rows > (INT64_C(1) << 62) / cols) return TF_ERR_OVERFLOW;
  const int64_t bands = tf_ops_cuda_bands(rows);
  if (bands > 0 && column_blocks(cols) > INT32_MAX / bands) return TF_ERR_OVERFLOW;
  if (column_blocks(cols) > kMaxBlocks) return TF_ERR_OVERFLOW;
  return TF_OK;
}

// Block b of a band kernel covers column block b % column_blocks and band b / column_blocks.
__device__ __forceinline__ void band_block(int64_t cols, int64_t *col, int64_t *band) {
  const int64_t blocks = cols / kThreads + (cols % kThreads != 0);
  *col = (static_cast<int64_t>(blockIdx.x) % blocks) * kThreads + threadIdx.x;
  *band = static_cast<int64_t>(blockIdx.x) / blocks;
}

inline unsigned int band_grid(int64_t rows, int64_t cols) {
  return static_cast<unsigned int>(column_blocks(cols) * tf_ops_cuda_bands(rows));
}

// out[c] = sum over bands b, in order, of partials[b * cols + c] (reduce_bands.cu).
void launch_sum_bands(const float *partials, int64_t bands, int64_t cols, void *out, tf_dtype out_dtype,
                      cudaStream_t stream);

}  // namespace tf_ops_cuda
