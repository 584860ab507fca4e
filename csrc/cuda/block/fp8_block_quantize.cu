// Float8 block scaling quantizer (tf_fp8_block_quantize_cuda): each CTA owns one 128 x 128 region of
// x. It first reads the region for its amaxes (a warp per row, a thread per column), turns them into
// scales (tf_fp8_block_scale), then reads it again in 32 x 32 sub-tiles staged in shared memory, writing
// y along rows and the transposed y_t along x's columns, both coalesced.
#include "block_cuda_traits.cuh"

namespace tf_cuda {
namespace {

struct BlockArgs {
  int64_t rows, cols, ld_x;
  int block_dim;
  float epsilon;
  int pow2;
  uint8_t *y;
  float *scale_inv;
  int64_t ld_scale;
  uint8_t *y_t;
  float *scale_inv_t;
  int64_t ld_scale_t;
};

template <class Elem, class Fmt>
__global__ void __launch_bounds__(kThreads)
    fp8_block_kernel(const typename Elem::Storage *__restrict__ x, BlockArgs a, float fp8_max, float input_max) {
  constexpr int L = Fp8BlockTile::kLen, S = Fp8BlockTile::kSub;
  __shared__ uint32_t row_amax[L];
  __shared__ uint32_t col_amax[kThreads / L][L];
  __shared__ float row_scale[L], col_scale[L], block_scale;
  __shared__ float sub[S][S + 1];
  const int64_t mb = blockIdx.x, kb = blockIdx.y, g = mb * L, c0 = kb * L;
  const int t = static_cast<int>(threadIdx.x), lane = t % 32;
  const bool two_d = a.block_dim == 2;
  for (int r = t / 32; r < L; r += kThreads / 32) {
    uint32_t m = 0;
    for (int c = lane; c < L; c += 32) {
      const uint32_t v = abs_bits_no_nan(load_or_zero<Elem>(x, a.rows, a.cols, a.ld_x, g + r, c0 + c));
      m = v > m ? v : m;
    }
    m = warp_max_bits(m);
    if (lane == 0) row_amax[r] = m;
  }
  {
    const int c = t % L, part = t / L;
    uint32_t m = 0;
    for (int r = part; r < L; r += kThreads / L) {
      const uint32_t v = abs_bits_no_nan(load_or_zero<Elem>(x, a.rows, a.cols, a.ld_x, g + r, c0 + c));
      m = v > m ? v : m;
    }
    col_amax[part][c] = m;
  }
  __syncthreads();
  if (two_d) {
    if (t == 0) {
      uint32_t m = 0;
      for (int r = 0; r < L; ++r) m = row_amax[r] > m ? row_amax[r] : m;
      const float s = tf_fp8_block_scale(tf_f32_from_bits(m), fp8_max, a.epsilon, a.pow2, input_max);
      const float inv = recip_like_cpu(s);
      block_scale = s;
      if (a.y) a.scale_inv[mb * a.ld_scale + kb] = inv;
      if (a.y_t) a.scale_inv_t[kb * a.ld_scale_t + mb] = inv;
    }
  } else if (t < L) {
    const float rs = tf_fp8_block_scale(tf_f32_from_bits(row_amax[t]), fp8_max, a.epsilon, a.pow2, input_max);
    uint32_t m = 0;
    for (int part = 0; part < kThreads / L; ++part) m = col_amax[part][t] > m ? col_amax[part][t] : m;
    const float cs = tf_fp8_block_scale(tf_f32_from_bits(m), fp8_max, a.epsilon, a.pow2, input_max);
    row_scale[t] = rs;
    col_scale[t] = cs;
    if (a.y && g + t < a.rows) a.scale_inv[kb * a.ld_scale + g + t] = recip_like_cpu(rs);
    if (a.y_t && c0 + t < a.cols) a.scale_inv_t[mb * a.ld_scale_t + c0 + t] = recip_like_cpu(cs);
  }
  __syncthreads();
  for (int sr = 0; sr < L; sr += S) {
    for (int sc = 0; sc < L; sc += S) {
      for (int i = t; i < S * S; i += kThreads) {
        const int r = i / S, c = i % S;
        const int64_t xr = g + sr + r, xc = c0 + sc + c;
        const float f = load_or_zero<Elem>(x, a.rows, a.cols, a.ld_x, xr, xc);
        sub[r][c] = f;
        if (a.y && xr < a.rows && xc < a.cols)
          a.y[xr * a.cols + xc] = Fmt::encode(mul_like_cpu(f, two_d ? block_scale : row_scale[sr + r]));
      }
      __syncthreads();
      if (a.y_t) {
        for (int i = t; i < S * S; i += kThreads) {
          const int c = i / S, r = i % S;  // consecutive threads: consecutive rows of x, one row of y_t
          const int64_t xr = g + sr + r, xc = c0 + sc + c;
          if (xr < a.rows && xc < a.cols)
            a.y_t[xc * a.rows + xr] = Fmt::encode(mul_like_cpu(sub[r][c], two_d ? block_scale : col_scale[sc + c]));
        }
      }
      __syncthreads();
    }
  }
}

}  // namespace
}  // namespace tf_cuda

extern "C" tf_status tf_fp8_block_quantize_cuda(const void *x, tf_dtype dtype, int64_t rows, int64_t cols,
                                                int64_t ld_x, tf_fp8_format format, int block_dim, float epsilon,
                                                int pow2, uint8_t *y, float *scale_inv, int64_t ld_scale,
                                                uint8_t *y_t, float *scale_inv_t, int64_t ld_scale_t, void *stream) {
  using namespace tf_cuda;
  constexpr int64_t L = Fp8BlockTile::kLen;
  const tf_status s = check_input(x, dtype, rows, cols, ld_x);
  if (s != TF_OK) return s;
  if (format != TF_FP8_E4M3 && format != TF_FP8_E5M2) return TF_ERR_BAD_DTYPE;
  if (block_dim != 1 && block_dim != 2) return TF_ERR_BAD_ARGUMENT;
  if (!(epsilon >= 0.0f && epsilon <= 3.40282347e38f)) return TF_ERR_BAD_ARGUMENT;
  if (!pair_ok(y, scale_inv) || !pair_ok(y_t, scale_inv_t)) return TF_ERR_NULL_POINTER;
  const int64_t row_blocks = rows / L + (rows % L != 0), col_blocks = cols / L + (cols % L != 0);
  if (y && ld_scale < (block_dim == 1 ? rows : col_blocks)) return TF_ERR_BAD_SIZE;
  if (y && !tf_mul_fits(block_dim == 1 ? col_blocks : row_blocks, ld_scale)) return TF_ERR_OVERFLOW;
  if (y_t && ld_scale_t < (block_dim == 1 ? cols : row_blocks)) return TF_ERR_BAD_SIZE;
  if (y_t && !tf_mul_fits(block_dim == 1 ? row_blocks : col_blocks, ld_scale_t)) return TF_ERR_OVERFLOW;
  if (rows == 0 || cols == 0 || (!y && !y_t)) return TF_OK;
  dim3 grid;
  const tf_status g = tile_grid(rows, cols, L, L, &grid);
  if (g != TF_OK) return g;
  const BlockArgs a = {rows, cols, ld_x, block_dim, epsilon, pow2 ? 1 : 0, y, scale_inv, ld_scale, y_t,
                       scale_inv_t, ld_scale_t};
  const float fp8_max = tf_fp8_max(format), input_max = tf_block_input_max(dtype);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(dtype, [&](auto elem) {
    return dispatch_format(format, [&](auto fmt) {
      using Elem = decltype(elem);
      fp8_block_kernel<Elem, decltype(fmt)><<<grid, kThreads, 0, st>>>(
          static_cast<const typename Elem::Storage *>(x), a, fp8_max, input_max);
      return launch_status();
    });
  });
}
