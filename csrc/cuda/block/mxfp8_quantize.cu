// MXFP8 quantizer (tf_mxfp8_quantize_cuda): each CTA stages a 32 x 128 tile of x in shared memory as
// float32, takes the rowwise block amaxes with warp reductions (a warp reads one 32-element block) and
// the columnwise ones a thread per column, then encodes every element under both scales.
#include "block_cuda_traits.cuh"

namespace tf_cuda {
namespace {

template <class Elem, class Fmt>
__global__ void __launch_bounds__(kThreads)
    mxfp8_kernel(const typename Elem::Storage *__restrict__ x, int64_t rows, int64_t cols, int64_t ld_x,
                 tf_fp8_format format, uint8_t *__restrict__ y, uint8_t *__restrict__ scale, int64_t ld_scale,
                 uint8_t *__restrict__ y_col, uint8_t *__restrict__ scale_col, int64_t ld_scale_col) {
  constexpr int R = MxTile::kRows, C = MxTile::kCols, B = MxTile::kBlock, kRowBlocks = C / B;
  __shared__ float tile[R][C];
  __shared__ float row_multiplier[R][kRowBlocks];
  __shared__ float col_multiplier[C];
  const int64_t g = static_cast<int64_t>(blockIdx.x) * R, c0 = static_cast<int64_t>(blockIdx.y) * C;
  const int t = static_cast<int>(threadIdx.x);
  for (int i = t; i < R * C; i += kThreads)
    tile[i / C][i % C] = load_or_zero<Elem>(x, rows, cols, ld_x, g + i / C, c0 + i % C);
  __syncthreads();
  if (y) {
    const int lane = t % 32;
    for (int i = t / 32; i < R * kRowBlocks; i += kThreads / 32) {
      const int r = i / kRowBlocks, b = i % kRowBlocks;
      const uint32_t amax = warp_max_bits(abs_bits_no_nan(tile[r][b * B + lane]));
      const uint8_t code = tf_mxfp8_scale_code(tf_f32_from_bits(amax), format);
      if (lane == 0) row_multiplier[r][b] = tf_e8m0_quant_multiplier(code);
      if (lane == 0 && g + r < rows && c0 + b * B < cols) scale[(g + r) * ld_scale + (c0 + b * B) / B] = code;
    }
  }
  if (y_col && t < C) {
    uint32_t amax = 0;
    for (int r = 0; r < R; ++r) {
      const uint32_t a = abs_bits_no_nan(tile[r][t]);
      amax = a > amax ? a : amax;
    }
    const uint8_t code = tf_mxfp8_scale_code(tf_f32_from_bits(amax), format);
    col_multiplier[t] = tf_e8m0_quant_multiplier(code);
    if (c0 + t < cols) scale_col[g / B * ld_scale_col + c0 + t] = code;
  }
  __syncthreads();
  for (int i = t; i < R * C; i += kThreads) {
    const int r = i / C, c = i % C;
    if (g + r >= rows || c0 + c >= cols) continue;
    const float f = tile[r][c];
    const int64_t at = (g + r) * cols + c0 + c;
    if (y) y[at] = Fmt::encode(mul_like_cpu(f, row_multiplier[r][c / B]));
    if (y_col) y_col[at] = Fmt::encode(mul_like_cpu(f, col_multiplier[c]));
  }
}

}  // namespace
}  // namespace tf_cuda

extern "C" tf_status tf_mxfp8_quantize_cuda(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x,
                                            tf_fp8_format format, uint8_t *y, uint8_t *scale, int64_t ld_scale,
                                            uint8_t *y_col, uint8_t *scale_col, int64_t ld_scale_col, void *stream) {
  using namespace tf_cuda;
  const tf_status s = check_input(x, dtype, rows, cols, ld_x);
  if (s != TF_OK) return s;
  if (format != TF_FP8_E4M3 && format != TF_FP8_E5M2) return TF_ERR_BAD_DTYPE;
  if (!pair_ok(y, scale) || !pair_ok(y_col, scale_col)) return TF_ERR_NULL_POINTER;
  const int64_t row_blocks = rows / MxTile::kBlock + (rows % MxTile::kBlock != 0);
  if (y && ld_scale < (cols + MxTile::kBlock - 1) / MxTile::kBlock) return TF_ERR_BAD_SIZE;
  if (y && !tf_mul_fits(rows, ld_scale)) return TF_ERR_OVERFLOW;
  if (y_col && ld_scale_col < cols) return TF_ERR_BAD_SIZE;
  if (y_col && !tf_mul_fits(row_blocks, ld_scale_col)) return TF_ERR_OVERFLOW;
  if (rows == 0 || cols == 0 || (!y && !y_col)) return TF_OK;
  dim3 grid;
  const tf_status g = tile_grid(rows, cols, MxTile::kRows, MxTile::kCols, &grid);
  if (g != TF_OK) return g;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(dtype, [&](auto elem) {
    return dispatch_format(format, [&](auto fmt) {
      using Elem = decltype(elem);
      mxfp8_kernel<Elem, decltype(fmt)><<<grid, kThreads, 0, st>>>(
          static_cast<const typename Elem::Storage *>(x), rows, cols, ld_x, format, y, scale, ld_scale, y_col,
          scale_col, ld_scale_col);
      return launch_status();
    });
  });
}
