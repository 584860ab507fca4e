// Launch configuration of the FP8 CUDA kernels: block shapes, tile sizes and
// the grid size of the grid-stride loops.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "fp8_cuda.h"

namespace tf_cuda {

// Threads per block of every kernel here (a multiple of the warp size, at most 1024).
constexpr int kThreads = 256;

// Resident blocks per SM the grid-stride loops aim for: 8 x 256 threads fill an
// SM of sm_80/sm_90, which keeps enough loads in flight for full bandwidth.
// More blocks would only add amax atomics.
constexpr int kBlocksPerSm = 8;

// Cast-transpose: square tiles of kCtTile elements a side (= the warp size, so a
// warp reads one tile row and writes one transposed row), covered by the block
// kThreads / kCtTile rows at a time.
constexpr int kCtTile = 32;
constexpr int kCtRowsPerPass = kThreads / kCtTile;
static_assert(kThreads % kCtTile == 0 && kCtTile == 32, "cast-transpose tile is one warp wide");

// Blocks for a grid-stride loop that wants `wanted_blocks` (>= 0) blocks: capped
// at what the current device keeps resident, and at least 1 so the kernel still
// folds its (empty) amax like the CPU does.
static inline tf_status grid_blocks(int64_t wanted_blocks, int *blocks) {
  int device = 0;
  int sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return TF_ERR_CUDA;
  const int64_t cap = static_cast<int64_t>(sms > 0 ? sms : 1) * kBlocksPerSm;
  *blocks = static_cast<int>(wanted_blocks < 1 ? 1 : wanted_blocks < cap ? wanted_blocks : cap);
  return TF_OK;
}

// Blocks of kThreads for `items` (>= 0) work items of one thread each.
static inline int64_t blocks_for_items(int64_t items) {
  return items / kThreads + (items % kThreads != 0);
}

// Status of the launch just made.
static inline tf_status launch_status() {
  return cudaGetLastError() == cudaSuccess ? TF_OK : TF_ERR_CUDA;
}

}  // namespace tf_cuda
