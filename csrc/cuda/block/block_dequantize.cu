// Dequantizers of the block-scaled formats (tf_block_dequantize_cuda for MXFP8 and Float8 block scaling,
// tf_nvfp4_dequantize_cuda): grid-stride loops of one element (NVFP4: one byte, two elements) a thread,
// each value decoded, multiplied by its block's factor as the C core does, and rounded to the output dtype.
#include "block_cuda_traits.cuh"

namespace tf_cuda {
namespace {

struct DequantizeArgs {
  const uint8_t *y;
  int64_t rows, cols;
  const void *scale;
  tf_block_scale_kind kind;
  int64_t scale_cols, block_rows, block_cols;
  bool scale_transposed;
};

template <class Elem, class Fmt>
__global__ void __launch_bounds__(kThreads)
    block_dequantize_kernel(DequantizeArgs a, typename Elem::Storage *__restrict__ x) {
  const int64_t n = a.rows * a.cols, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n; k += stride) {
    const int64_t i = k / a.cols / a.block_rows, j = k % a.cols / a.block_cols;
    const int64_t at = a.scale_transposed ? j * a.scale_cols + i : i * a.scale_cols + j;
    const float s = a.kind == TF_BLOCK_SCALE_E8M0 ? tf_e8m0_decode(static_cast<const uint8_t *>(a.scale)[at])
                                                  : static_cast<const float *>(a.scale)[at];
    x[k] = Elem::from_f32(mul_like_cpu(Fmt::decode(a.y[k]), s));
  }
}

template <class Elem>
__global__ void __launch_bounds__(kThreads)
    nvfp4_dequantize_kernel(const uint8_t *__restrict__ y, int64_t rows, int64_t cols,
                            const uint8_t *__restrict__ scale, int64_t ld_scale, const float *amax_ptr,
                            typename Elem::Storage *__restrict__ x) {
  const int64_t n = rows * cols / 2, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const float amax = *amax_ptr;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n; k += stride) {
    const int64_t r = 2 * k / cols, c = 2 * k % cols;
    const float factor = tf_nvfp4_decode_factor(scale[r * ld_scale + c / Nvfp4Tile::kBlock], amax);
    const uint8_t byte = y[k];
    x[2 * k] = Elem::from_f32(mul_like_cpu(tf_e2m1_decode(byte & 15u), factor));
    x[2 * k + 1] = Elem::from_f32(mul_like_cpu(tf_e2m1_decode(static_cast<uint8_t>(byte >> 4)), factor));
  }
}

}  // namespace
}  // namespace tf_cuda

extern "C" tf_status tf_block_dequantize_cuda(const uint8_t *y, tf_fp8_format format, int64_t rows, int64_t cols,
                                              const void *scale, tf_block_scale_kind kind, int64_t scale_rows,
                                              int64_t scale_cols, int64_t block_rows, int64_t block_cols,
                                              int scale_transposed, void *x, tf_dtype dtype, void *stream) {
  using namespace tf_cuda;
  if (format != TF_FP8_E4M3 && format != TF_FP8_E5M2) return TF_ERR_BAD_DTYPE;
  if (dtype != TF_FLOAT32 && dtype != TF_BFLOAT16 && dtype != TF_FLOAT16) return TF_ERR_BAD_DTYPE;
  if (kind != TF_BLOCK_SCALE_E8M0 && kind != TF_BLOCK_SCALE_F32) return TF_ERR_BAD_ARGUMENT;
  if (rows < 0 || cols < 0 || scale_rows < 0 || scale_cols < 0 || block_rows < 1 || block_cols < 1)
    return TF_ERR_BAD_SIZE;
  if (!tf_mul_fits(rows, cols) || !tf_mul_fits(rows * cols, 4)) return TF_ERR_OVERFLOW;
  if (!tf_mul_fits(scale_rows, scale_cols)) return TF_ERR_OVERFLOW;
  const int64_t row_blocks = rows / block_rows + (rows % block_rows != 0);
  const int64_t col_blocks = cols / block_cols + (cols % block_cols != 0);
  if (scale_rows < (scale_transposed ? col_blocks : row_blocks) ||
      scale_cols < (scale_transposed ? row_blocks : col_blocks))
    return TF_ERR_BAD_SIZE;
  if (rows == 0 || cols == 0) return TF_OK;
  if (!y || !x || !scale) return TF_ERR_NULL_POINTER;
  int blocks = 0;
  const tf_status st = grid_blocks(blocks_for_items(rows * cols), &blocks);
  if (st != TF_OK) return st;
  const DequantizeArgs a = {y, rows, cols, scale, kind, scale_cols, block_rows, block_cols, scale_transposed != 0};
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(dtype, [&](auto elem) {
    return dispatch_format(format, [&](auto fmt) {
      using Elem = decltype(elem);
      block_dequantize_kernel<Elem, decltype(fmt)><<<blocks, kThreads, 0, s>>>(
          a, static_cast<typename Elem::Storage *>(x));
      return launch_status();
    });
  });
}

extern "C" tf_status tf_nvfp4_dequantize_cuda(const uint8_t *y, int64_t rows, int64_t cols, const uint8_t *scale,
                                              int64_t ld_scale, const float *amax, void *x, tf_dtype dtype,
                                              void *stream) {
  using namespace tf_cuda;
  if (dtype != TF_FLOAT32 && dtype != TF_BFLOAT16 && dtype != TF_FLOAT16) return TF_ERR_BAD_DTYPE;
  if (rows < 0 || cols < 0 || cols % Nvfp4Tile::kBlock) return TF_ERR_BAD_SIZE;
  if (!tf_mul_fits(rows, cols) || !tf_mul_fits(rows * cols, 4)) return TF_ERR_OVERFLOW;
  if (ld_scale < cols / Nvfp4Tile::kBlock) return TF_ERR_BAD_SIZE;
  if (!tf_mul_fits(rows, ld_scale)) return TF_ERR_OVERFLOW;
  if (!amax) return TF_ERR_NULL_POINTER;
  if (rows == 0 || cols == 0) return TF_OK;
  if (!y || !x || !scale) return TF_ERR_NULL_POINTER;
  int blocks = 0;
  const tf_status st = grid_blocks(blocks_for_items(rows * cols / 2), &blocks);
  if (st != TF_OK) return st;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(dtype, [&](auto elem) {
    using Elem = decltype(elem);
    nvfp4_dequantize_kernel<Elem><<<blocks, kThreads, 0, s>>>(y, rows, cols, scale, ld_scale, amax,
                                                              static_cast<typename Elem::Storage *>(x));
    return launch_status();
  });
}
