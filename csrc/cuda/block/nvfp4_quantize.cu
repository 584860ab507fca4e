// NVFP4 amax and quantizer (tf_nvfp4_amax_cuda, tf_nvfp4_quantize_cuda): each CTA stages a 16 x 128
// tile of x in shared memory as float32; a thread quantizes one rowwise 1x16 block, and a thread one
// column's 16 values (Hadamard-transformed when asked) into the transposed data. The transform adds
// its products in the C core's order, each product and sum rounded on its own (__fmul_rn, __fadd_rn).
// Sizes that are not multiples of 16 quantize the zero-padded matrix, as the C core does (csrc/fp4/nvfp4.h):
// the tile reads zeros beyond x, the packed rows hold cols_p (rowwise) or rows_p (columnwise) values, and the
// stochastic-rounding counters run over the padded sizes.
#include "block_cuda_traits.cuh"

namespace tf_cuda {
namespace {

constexpr int kB = Nvfp4Tile::kBlock, kR = Nvfp4Tile::kRows, kC = Nvfp4Tile::kCols, kT = Nvfp4Tile::kThreads;

template <class Elem>
__device__ __forceinline__ void load_tile(const typename Elem::Storage *x, int64_t rows, int64_t cols, int64_t ld_x,
                                          int64_t g, int64_t c0, float (*tile)[kC]) {
  for (int r = 0; r < kR; ++r)
    tile[r][threadIdx.x] = load_or_zero<Elem>(x, rows, cols, ld_x, g + r, c0 + threadIdx.x);
}

// The transform's matrix (tf_nvfp4_rht_entry), built by the block's threads.
__device__ __forceinline__ void load_rht_matrix(float (*m)[kB]) {
  for (int i = threadIdx.x; i < kB * kB; i += kT) m[i / kB][i % kB] = tf_nvfp4_rht_entry(i / kB, i % kB);
}

// col[k] = tile[k][c], or w = v M of those 16 values (w[i] = sum over j in order of v[j] * M[j][i]).
__device__ __forceinline__ void column16(const float (*tile)[kC], int c, bool rht, const float (*m)[kB],
                                         float *col) {
  float v[kB];
#pragma unroll
  for (int k = 0; k < kB; ++k) v[k] = tile[k][c];
#pragma unroll
  for (int i = 0; i < kB; ++i) {
    float w = 0.0f;
    for (int j = 0; j < kB; ++j) w = __fadd_rn(w, __fmul_rn(v[j], m[j][i]));
    col[i] = rht ? w : v[i];
  }
}

// max |v[i]|'s bits over i in [0, 16), m included (NaN above Inf, as the C core orders them).
__device__ __forceinline__ uint32_t abs_max16(const float *v, uint32_t m) {
#pragma unroll
  for (int i = 0; i < kB; ++i) m = abs_bits(v[i]) > m ? abs_bits(v[i]) : m;
  return m;
}

// out[k] = E2M1(v[2k] * multiplier) | E2M1(v[2k + 1] * multiplier) << 4; element i draws counter + i.
__device__ __forceinline__ void encode16(const float *v, float multiplier, bool stochastic, uint64_t seed,
                                         uint64_t counter, uint8_t *out) {
  uint8_t codes[kB];
#pragma unroll
  for (int i = 0; i < kB; ++i) {
    const float p = __fmul_rn(v[i], multiplier);
    codes[i] = stochastic ? tf_e2m1_encode_sr(p, tf_nvfp4_random24(seed, counter + static_cast<uint64_t>(i)))
                          : tf_e2m1_encode_rn(p);
  }
#pragma unroll
  for (int k = 0; k < kB / 2; ++k) out[k] = static_cast<uint8_t>(codes[2 * k] | (codes[2 * k + 1] << 4));
}

template <class Elem>
__global__ void __launch_bounds__(kT) nvfp4_amax_kernel(const typename Elem::Storage *__restrict__ x, int64_t rows,
                                                        int64_t cols, int64_t ld_x, bool rht, float *amax) {
  __shared__ float tile[kR][kC];
  __shared__ float m[kB][kB];
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kR, c0 = static_cast<int64_t>(blockIdx.y) * kC;
  load_tile<Elem>(x, rows, cols, ld_x, g, c0, tile);
  load_rht_matrix(m);
  __syncthreads();
  float col[kB];
  column16(tile, threadIdx.x, rht, m, col);
  block_fold_amax(abs_max16(col, 0u), amax);
}

struct Nvfp4Args {
  int64_t rows, cols, ld_x, rows_p, cols_p;  // _p: rounded up to 16
  bool block_2d, rht_t, stochastic;
  uint64_t seed;
  const float *amax, *amax_t;
  uint8_t *y, *scale;
  int64_t ld_scale;
  uint8_t *y_t, *scale_t;
  int64_t ld_scale_t;
};

template <class Elem>
__global__ void __launch_bounds__(kT) nvfp4_quantize_kernel(const typename Elem::Storage *__restrict__ x,
                                                            Nvfp4Args a) {
  __shared__ float tile[kR][kC];
  __shared__ float m[kB][kB];
  __shared__ uint32_t col_amax[kC];
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kR, c0 = static_cast<int64_t>(blockIdx.y) * kC;
  const int t = static_cast<int>(threadIdx.x);
  const float s_enc = tf_nvfp4_global_scale(*a.amax), s_enc_t = tf_nvfp4_global_scale(*a.amax_t);
  load_tile<Elem>(x, a.rows, a.cols, a.ld_x, g, c0, tile);
  load_rht_matrix(m);
  __syncthreads();
  float col[kB];
  column16(tile, t, a.rht_t, m, col);  // the plain column when block_2d (rht_t is then off)
  col_amax[t] = abs_max16(col, 0u);
  __syncthreads();
  // One 16x16 block's scale: the max over its 16 column amaxes.
  auto code_2d = [&](int b) {
    uint32_t bits = 0;
    for (int k = 0; k < kB; ++k) bits = col_amax[b * kB + k] > bits ? col_amax[b * kB + k] : bits;
    return tf_nvfp4_block_scale(tf_f32_from_bits(bits), s_enc);
  };
  if (a.y) {
    const int r = t / (kC / kB), b = t % (kC / kB);
    const int64_t c = c0 + b * kB;
    if (c < a.cols && g + r < a.rows) {
      const float *v = tile[r] + b * kB;
      const uint8_t code = a.block_2d ? code_2d(b) : tf_nvfp4_block_scale(tf_f32_from_bits(abs_max16(v, 0u)), s_enc);
      a.scale[(g + r) * a.ld_scale + c / kB] = code;
      encode16(v, tf_nvfp4_encode_multiplier(code, s_enc), a.stochastic, a.seed,
               static_cast<uint64_t>((g + r) * a.cols_p + c), a.y + (g + r) * (a.cols_p / 2) + c / 2);
    }
  }
  const int64_t c = c0 + t;
  if (a.y_t && c < a.cols) {
    const uint8_t code = a.block_2d ? code_2d(t / kB) : tf_nvfp4_block_scale(tf_f32_from_bits(col_amax[t]), s_enc_t);
    a.scale_t[c * a.ld_scale_t + g / kB] = code;
    const uint64_t t_base = static_cast<uint64_t>(a.rows_p) * static_cast<uint64_t>(a.cols_p);
    encode16(col, tf_nvfp4_encode_multiplier(code, s_enc_t), a.stochastic, a.seed,
             t_base + static_cast<uint64_t>(c * a.rows_p + g), a.y_t + c * (a.rows_p / 2) + g / 2);
  }
}

int64_t round_up16(int64_t n) { return (n + kB - 1) / kB * kB; }

// The checks of the C entry points: x's sizes, and the padded data's index products and stochastic-rounding
// counters (up to 2 * rows_p * cols_p).
tf_status check_nvfp4_input(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x) {
  const tf_status s = check_input(x, dtype, rows, cols, ld_x);
  if (s != TF_OK) return s;
  if (rows > INT64_MAX - kB || cols > INT64_MAX - kB) return TF_ERR_OVERFLOW;
  const int64_t rows_p = round_up16(rows), cols_p = round_up16(cols);
  if (!tf_mul_fits(rows_p, cols_p) || !tf_mul_fits(rows_p * cols_p, 4)) return TF_ERR_OVERFLOW;
  return TF_OK;
}

}  // namespace
}  // namespace tf_cuda

extern "C" tf_status tf_nvfp4_amax_cuda(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x,
                                        int rht, float *amax, void *stream) {
  using namespace tf_cuda;
  const tf_status s = check_nvfp4_input(x, dtype, rows, cols, ld_x);
  if (s != TF_OK) return s;
  if (rht != 0 && rht != 1) return TF_ERR_BAD_ARGUMENT;
  if (!amax) return TF_ERR_NULL_POINTER;
  if (rows == 0 || cols == 0) return TF_OK;
  dim3 grid;
  const tf_status g = tile_grid(rows, cols, kR, kC, &grid);
  if (g != TF_OK) return g;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(dtype, [&](auto elem) {
    using Elem = decltype(elem);
    nvfp4_amax_kernel<Elem><<<grid, kT, 0, st>>>(static_cast<const typename Elem::Storage *>(x), rows, cols, ld_x,
                                                 rht != 0, amax);
    return launch_status();
  });
}

extern "C" tf_status tf_nvfp4_quantize_cuda(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x,
                                            int block_2d, int rht_t, int stochastic, uint64_t seed, const float *amax,
                                            const float *amax_t, uint8_t *y, uint8_t *scale, int64_t ld_scale,
                                            uint8_t *y_t, uint8_t *scale_t, int64_t ld_scale_t, void *stream) {
  using namespace tf_cuda;
  const tf_status s = check_nvfp4_input(x, dtype, rows, cols, ld_x);
  if (s != TF_OK) return s;
  if ((block_2d != 0 && block_2d != 1) || (rht_t != 0 && rht_t != 1) || (stochastic != 0 && stochastic != 1))
    return TF_ERR_BAD_ARGUMENT;
  if (block_2d && (rht_t || amax_t != amax)) return TF_ERR_BAD_ARGUMENT;  // 2D blocks: one scale for both
  if (!amax || !amax_t) return TF_ERR_NULL_POINTER;
  if (!pair_ok(y, scale) || !pair_ok(y_t, scale_t)) return TF_ERR_NULL_POINTER;
  const int64_t rows_p = round_up16(rows), cols_p = round_up16(cols);
  if ((y && ld_scale < cols_p / kB) || (y_t && ld_scale_t < rows_p / kB)) return TF_ERR_BAD_SIZE;
  if ((y && !tf_mul_fits(rows, ld_scale)) || (y_t && !tf_mul_fits(cols, ld_scale_t))) return TF_ERR_OVERFLOW;
  if (rows == 0 || cols == 0 || (!y && !y_t)) return TF_OK;
  dim3 grid;
  const tf_status g = tile_grid(rows, cols, kR, kC, &grid);
  if (g != TF_OK) return g;
  const Nvfp4Args a = {rows, cols,  ld_x,     rows_p, cols_p, block_2d != 0, rht_t != 0, stochastic != 0, seed, amax,
                       amax_t, y,   scale, ld_scale, y_t,    scale_t,       ld_scale_t};
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(dtype, [&](auto elem) {
    using Elem = decltype(elem);
    nvfp4_quantize_kernel<Elem><<<grid, kT, 0, st>>>(static_cast<const typename Elem::Storage *>(x), a);
    return launch_status();
  });
}
