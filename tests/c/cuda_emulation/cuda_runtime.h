// Host stand-in for the CUDA runtime and device built-ins that csrc/cuda/fp8
// uses, so the kernels' indexing, tails, tiling and reductions run (and are
// checked against the C core) on a machine without a GPU. Each CUDA thread of
// a block is a std::thread; blocks run one after another on the same threads.
// It does not model the GPU's arithmetic (NaN canonicalization, FMA): those
// are handled in the kernels by construction and checked on a GPU by
// tests/test_fp8_cuda.py.
#pragma once

#include <barrier>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(threads)
#define __restrict__ __restrict
// One block runs at a time, so a static serves as the block's shared memory.
#define __shared__ static

struct emu_dim3 {
  unsigned int x = 0, y = 1, z = 1;
};
inline thread_local emu_dim3 threadIdx, blockIdx;
inline emu_dim3 blockDim, gridDim;

struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};

typedef struct CUstream_st *cudaStream_t;
enum cudaError_t { cudaSuccess = 0 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };

// Few SMs, so that modest test sizes already make the grid-stride loops go round.
constexpr int kEmuSms = 2;

inline cudaError_t cudaGetDevice(int *device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr, int) {
  *value = kEmuSms;
  return cudaSuccess;
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }

inline std::barrier<> *emu_block_barrier;
inline std::vector<std::barrier<> *> emu_warp_barriers;
inline uint64_t emu_warp_lanes[32][32];

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }

template <class T>
T __shfl_xor_sync(unsigned int, T value, int lane_mask) {
  const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint64_t raw = 0;
  std::memcpy(&raw, &value, sizeof value);
  emu_warp_lanes[warp][lane] = raw;
  emu_warp_barriers[warp]->arrive_and_wait();
  raw = emu_warp_lanes[warp][lane ^ static_cast<unsigned int>(lane_mask)];
  emu_warp_barriers[warp]->arrive_and_wait();
  T out;
  std::memcpy(&out, &raw, sizeof out);
  return out;
}

inline unsigned int atomicMax(unsigned int *p, unsigned int value) {
  unsigned int old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (old < value &&
         !__atomic_compare_exchange_n(p, &old, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline unsigned int atomicAnd(unsigned int *p, unsigned int value) {
  return __atomic_fetch_and(p, value, __ATOMIC_SEQ_CST);
}

// Built with -ffp-contract=off, so these are single IEEE operations as on the GPU.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }

inline long emu_launch_count = 0;

// What `kernel<<<blocks, threads, shared, stream>>>(args)` becomes: body() is the kernel call.
template <class Body>
void emu_launch(int blocks, int threads, int, cudaStream_t, Body body) {
  ++emu_launch_count;
  gridDim.x = static_cast<unsigned int>(blocks);
  blockDim.x = static_cast<unsigned int>(threads);
  std::barrier<> block_barrier(threads);
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  emu_block_barrier = &block_barrier;
  emu_warp_barriers.clear();
  for (int w = 0; w < (threads + 31) / 32; ++w) {
    warps.push_back(std::make_unique<std::barrier<>>(threads - 32 * w < 32 ? threads - 32 * w : 32));
    emu_warp_barriers.push_back(warps.back().get());
  }
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      threadIdx.x = static_cast<unsigned int>(t);
      for (int b = 0; b < blocks; ++b) {
        blockIdx.x = static_cast<unsigned int>(b);
        body();
        block_barrier.arrive_and_wait();  // the next block reuses the "shared" statics
      }
    });
  for (std::thread &t : pool) t.join();
}
