// Cast-transpose kernel: each block walks kCtTile x kCtTile tiles of x (a
// grid-stride loop over tiles). A warp reads one tile row (consecutive columns:
// coalesced), writes its FP8 bytes to y (consecutive bytes) and to a shared
// tile; after a barrier a warp reads one tile column from shared memory and
// writes it as consecutive bytes of a y_t row. amax is folded once per block.
#include "../../common/tf_checks.h"
#include "fp8_amax_reduce.cuh"
#include "fp8_cuda_traits.cuh"
#include "fp8_launch_config.cuh"

namespace tf_cuda {
namespace {

template <class Elem, class Fmt>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_kernel(const typename Elem::Storage *__restrict__ x, int64_t rows,
                          int64_t cols, int64_t ld, const float *__restrict__ scale_ptr,
                          uint8_t *__restrict__ y, uint8_t *__restrict__ y_t, float *amax) {
  // One padding byte per row staggers a column's bytes over the shared-memory banks.
  __shared__ uint8_t tile[kCtTile][kCtTile + 1];
  const int lane = static_cast<int>(threadIdx.x) % kCtTile;
  const int first_row = static_cast<int>(threadIdx.x) / kCtTile;
  const float scale = *scale_ptr;
  const int64_t tiles_c = cols / kCtTile + (cols % kCtTile != 0);
  const int64_t tiles = tiles_c * (rows / kCtTile + (rows % kCtTile != 0));
  uint32_t amax_bits = 0;
  // The loop bounds are the same for every thread of the block, so the barriers are safe.
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = t / tiles_c * kCtTile;
    const int64_t c0 = t % tiles_c * kCtTile;
    const int64_t col = c0 + lane;
    for (int r = first_row; r < kCtTile; r += kCtRowsPerPass) {
      const int64_t row = r0 + r;
      if (row < rows && col < cols) {
        const float f = Elem::to_f32(x[row * ld + col]);
        const uint32_t a = abs_bits(f);
        amax_bits = a > amax_bits ? a : amax_bits;
        const uint8_t q = Fmt::encode(mul_like_cpu(f, scale));
        y[row * cols + col] = q;
        tile[r][lane] = q;
      }
    }
    __syncthreads();
    const int64_t out_col = r0 + lane; /* a row of x is a column of y_t */
    for (int c = first_row; c < kCtTile; c += kCtRowsPerPass) {
      const int64_t out_row = c0 + c;
      if (out_row < cols && out_col < rows) y_t[out_row * rows + out_col] = tile[lane][c];
    }
    __syncthreads();
  }
  block_fold_amax(amax_bits, amax);
}

template <class Elem, class Fmt>
tf_status launch_cast_transpose(const void *x, int64_t rows, int64_t cols, int64_t ld,
                                const float *scale, uint8_t *y, uint8_t *y_t, float *amax,
                                cudaStream_t stream) {
  const int64_t tiles_r = rows / kCtTile + (rows % kCtTile != 0);
  const int64_t tiles_c = cols / kCtTile + (cols % kCtTile != 0);
  int blocks = 0;
  const tf_status st = grid_blocks(tiles_r * tiles_c, &blocks);
  if (st != TF_OK) return st;
  cast_transpose_kernel<Elem, Fmt><<<blocks, kThreads, 0, stream>>>(
      static_cast<const typename Elem::Storage *>(x), rows, cols, ld, scale, y, y_t, amax);
  return launch_status();
}

}  // namespace
}  // namespace tf_cuda

extern "C" tf_status tf_fp8_cast_transpose_cuda(const void *x, tf_dtype dtype, int64_t rows,
                                                int64_t cols, int64_t x_row_stride,
                                                const float *scale, tf_fp8_format format,
                                                uint8_t *y, uint8_t *y_t, float *amax,
                                                void *stream) {
  if (!scale || !amax) return TF_ERR_NULL_POINTER;
  if (rows < 0 || cols < 0 || x_row_stride < cols) return TF_ERR_BAD_SIZE;
  /* The largest index read is (rows - 1) * x_row_stride + cols - 1; written, rows * cols - 1.
     Tile corners run up to kCtTile - 1 past rows and cols before the bounds checks. */
  if (!tf_mul_fits(rows, x_row_stride) || !tf_mul_fits(rows, cols) ||
      rows > INT64_MAX - tf_cuda::kCtTile || cols > INT64_MAX - tf_cuda::kCtTile)
    return TF_ERR_OVERFLOW;
  if (rows > 0 && cols > 0 && (!x || !y || !y_t)) return TF_ERR_NULL_POINTER;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return tf_cuda::dispatch_dtype(dtype, [&](auto elem) {
    return tf_cuda::dispatch_format(format, [&](auto fmt) {
      return tf_cuda::launch_cast_transpose<decltype(elem), decltype(fmt)>(
          x, rows, cols, x_row_stride, scale, y, y_t, amax, s);
    });
  });
}
