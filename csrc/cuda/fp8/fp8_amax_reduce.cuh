// Block-wide amax reduction of the FP8 CUDA kernels: warp shuffles, then one
// warp over the per-warp maxima, then one atomic per block into the amax tensor.
#pragma once

#include <stdint.h>

namespace tf_cuda {

__device__ __forceinline__ uint32_t warp_max_bits(uint32_t bits) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const uint32_t other = __shfl_xor_sync(0xFFFFFFFFu, bits, offset);
    bits = other > bits ? other : bits;
  }
  return bits;
}

// *amax <- max(|*amax|, bits) on bit patterns, as the CPU binding does. A stored
// negative amax has its sign cleared first; the sign bit never comes back after
// that (every value folded in is non-negative), so whichever block clears it,
// each block's atomicMax lands on a non-negative value.
__device__ __forceinline__ void fold_amax_bits(float *amax, uint32_t bits) {
  unsigned int *p = reinterpret_cast<unsigned int *>(amax);
  if (*reinterpret_cast<volatile unsigned int *>(p) & 0x80000000u) atomicAnd(p, 0x7FFFFFFFu);
  atomicMax(p, bits);
}

// Every thread of a 1-D block (blockDim.x a multiple of 32) calls this once with
// its own amax bits; the block's maximum is folded into *amax.
__device__ __forceinline__ void block_fold_amax(uint32_t bits, float *amax) {
  __shared__ uint32_t warp_max[32];
  const unsigned int lane = threadIdx.x & 31u;
  const unsigned int warp = threadIdx.x >> 5;
  bits = warp_max_bits(bits);
  if (lane == 0) warp_max[warp] = bits;
  __syncthreads();
  if (warp == 0) {
    bits = lane < (blockDim.x >> 5) ? warp_max[lane] : 0u;
    bits = warp_max_bits(bits);
    if (lane == 0) fold_amax_bits(amax, bits);
  }
}

}  // namespace tf_cuda
