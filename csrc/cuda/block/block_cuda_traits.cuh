// Tile shapes and device helpers of the block-scaled quantizer kernels. The element and format
// traits, the vector words, the warp reductions and the launch constants are the FP8 kernels'.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "../../common/tf_checks.h"
#include "../../fp4/nvfp4_format.h"
#include "../../fp8/fp8_block_format.h"
#include "../fp8/fp8_amax_reduce.cuh"
#include "../fp8/fp8_cuda_traits.cuh"
#include "../fp8/fp8_launch_config.cuh"
#include "block_cuda.h"

namespace tf_cuda {

// MXFP8: a CTA of kThreads quantizes 32 rows (one columnwise block) by 128 columns (four rowwise blocks).
struct MxTile {
  static constexpr int kBlock = 32;
  static constexpr int kRows = kBlock;
  static constexpr int kCols = 4 * kBlock;
};

// Float8 block scaling: a CTA of kThreads quantizes one 128 x 128 region (a 2-D block, or 128 rowwise
// and 128 columnwise tiles), encoding it in 32 x 32 sub-tiles staged in shared memory for the transpose.
struct Fp8BlockTile {
  static constexpr int kLen = 128;
  static constexpr int kSub = 32;
};

// NVFP4: a CTA of kThreads quantizes 16 rows (one columnwise block) by 128 columns (eight rowwise blocks):
// a thread per rowwise block and a thread per column.
struct Nvfp4Tile {
  static constexpr int kBlock = 16;
  static constexpr int kRows = kBlock;
  static constexpr int kCols = 128;
  static constexpr int kThreads = kCols;
  static_assert(kRows * kCols / kBlock == kThreads, "one thread per rowwise block");
};

// x[r * ld_x + c] as float32, or 0 (neutral to every amax) outside rows x cols.
template <class Elem>
__device__ __forceinline__ float load_or_zero(const typename Elem::Storage *x, int64_t rows, int64_t cols,
                                              int64_t ld_x, int64_t r, int64_t c) {
  return r < rows && c < cols ? Elem::to_f32(x[r * ld_x + c]) : 0.0f;
}

// |v|'s bits with NaN as 0 (tf_abs_bits_no_nan, unsigned): a max over them is TE's NaN-dropping amax.
__device__ __forceinline__ uint32_t abs_bits_no_nan(float v) { return static_cast<uint32_t>(tf_abs_bits_no_nan(v)); }

// The grid of a kernel over row tiles (x, up to 2^31 - 1) by column tiles (y, up to 65535).
static inline tf_status tile_grid(int64_t rows, int64_t cols, int64_t tile_rows, int64_t tile_cols, dim3 *grid) {
  const int64_t row_tiles = rows / tile_rows + (rows % tile_rows != 0);
  const int64_t col_tiles = cols / tile_cols + (cols % tile_cols != 0);
  if (row_tiles > 0x7FFFFFFF || col_tiles > 65535) return TF_ERR_BAD_SIZE;
  *grid = dim3(static_cast<unsigned int>(row_tiles), static_cast<unsigned int>(col_tiles), 1);
  return TF_OK;
}

// The checks of x every launcher shares (those of the C entry points, for the whole matrix).
static inline tf_status check_input(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x) {
  if (dtype != TF_FLOAT32 && dtype != TF_BFLOAT16 && dtype != TF_FLOAT16) return TF_ERR_BAD_DTYPE;
  if (rows < 0 || cols < 0 || ld_x < cols) return TF_ERR_BAD_SIZE;
  if (!tf_mul_fits(rows, ld_x) || !tf_mul_fits(rows * ld_x, tf_dtype_size(dtype))) return TF_ERR_OVERFLOW;
  if (!tf_mul_fits(rows, cols)) return TF_ERR_OVERFLOW;
  if (rows > 0 && cols > 0 && !x) return TF_ERR_NULL_POINTER;
  return TF_OK;
}

// A usage's data and scale pointers: both or neither.
static inline bool pair_ok(const void *data, const void *scale) { return (data == nullptr) == (scale == nullptr); }

}  // namespace tf_cuda
