/*
 * NVFP4's quantizer and amax on AVX2 (+ FMA + F16C): nvfp4_quantize_avx512.c's kernels, whose comments explain
 * them, at half the width. A 16-column block is two 8-lane halves: rowwise, a row's halves are folded into one
 * maximum before 8 rows' are reduced across lanes; columnwise, each half's 8 columns are lanes. The Hadamard sums
 * go 8 outputs at a time (16 sums would not fit in 16 registers). SplitMix64's 64-bit products are built from
 * vpmuludq's 32-bit ones (AVX2 has no 64-bit multiply).
 */
#include "nvfp4_band.h"

#if TF_X86
#include <float.h>
#include <immintrin.h>
#include <string.h>

#include "../fp8/fp8_encode_avx2.h"
#include "nvfp4.h"
#include "nvfp4_format.h"

enum { LANES = 16, HALF = 8 };

#define GOLDEN 0x9E3779B97F4A7C15ull

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Lanes [0, n) of the elements at x + i as float32, the others 0 (n <= 0: none is read). */
TF_AVX2_INLINE __m256 load_upto8(const void *x, int64_t i, int64_t n, tf_dtype d) {
  if (n >= HALF) return load8(x, i, d);
  if (n <= 0) return _mm256_setzero_ps();
  uint8_t buffer[32] = {0};
  memcpy(buffer, (const uint8_t *)x + i * (int64_t)tf_dtype_size(d), (size_t)n * tf_dtype_size(d));
  return load8(buffer, 0, d);
}

/* v[r][h] = row g + r of x at the columns [c + 8h, c + 8h + 8), zero beyond the columns [c, c + nk) and the rows. */
TF_AVX2_INLINE void load_rows16(const void *x, tf_dtype d, int64_t ld_x, int64_t rows, int64_t g, int64_t c,
                                int64_t nk, __m256 v[LANES][2]) {
  for (int r = 0; r < LANES; ++r)
    for (int h = 0; h < 2; ++h)
      v[r][h] = g + r < rows ? load_upto8(x, (g + r) * ld_x + c + HALF * h, nk - HALF * h, d) : _mm256_setzero_ps();
}

TF_AVX2_INLINE __m256i max2(__m256i a, __m256i b) { return _mm256_max_epi32(a, b); }

/* Lane r = the maximum over b[r]'s lanes, for 8 vectors: three rounds of halving shuffles. */
TF_AVX2_INLINE __m256i row_maxima8(const __m256i b[HALF]) {
  /* The rounds leave input k's maximum in lane 0 2 4 6 1 3 5 7 of k: fed rows 0 4 1 5 2 6 3 7, row r lands in lane r. */
  static const int order[HALF] = {0, 4, 1, 5, 2, 6, 3, 7};
  __m256i h[4];
  __m256 q[2];
  for (int p = 0; p < 4; ++p) {
    const __m256i a = b[order[2 * p]], c = b[order[2 * p + 1]];
    h[p] = max2(_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(a, c, 0x31));
  }
  for (int p = 0; p < 2; ++p) {
    const __m256 s = _mm256_castsi256_ps(h[2 * p]), t = _mm256_castsi256_ps(h[2 * p + 1]);
    q[p] = _mm256_castsi256_ps(
        max2(_mm256_castps_si256(_mm256_shuffle_ps(s, t, 0x44)), _mm256_castps_si256(_mm256_shuffle_ps(s, t, 0xEE))));
  }
  return max2(_mm256_castps_si256(_mm256_shuffle_ps(q[0], q[1], 0x88)),
              _mm256_castps_si256(_mm256_shuffle_ps(q[0], q[1], 0xDD)));
}

/* tf_fp8_e4m3_decode of codes in 32-bit lanes. */
TF_AVX2_INLINE __m256 e4m3_decode8(__m256i c) {
  const __m256i e = _mm256_and_si256(_mm256_srli_epi32(c, 3), _mm256_set1_epi32(15));
  const __m256i m = _mm256_and_si256(c, _mm256_set1_epi32(7));
  const __m256i normal =
      _mm256_or_si256(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(120)), 23), _mm256_slli_epi32(m, 20));
  const __m256i sub = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(0x1p-9f)));
  __m256i mag = _mm256_blendv_epi8(normal, sub, _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
  const __m256i nan = _mm256_cmpeq_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x7F)), _mm256_set1_epi32(0x7F));
  mag = _mm256_blendv_epi8(mag, _mm256_set1_epi32(0x7FC00000), nan);
  return _mm256_castsi256_ps(
      _mm256_or_si256(mag, _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24)));
}

/* tf_nvfp4_block_scale of 8 block amaxes (as bits) in 32-bit lanes, and *multiplier tf_nvfp4_encode_multiplier's. */
TF_AVX2_INLINE __m256i block_scales8(__m256i amax_bits, float s_enc, __m256 *multiplier) {
  const float to_scale = s_enc * (1.0f / 6.0f);
  const __m256 max = _mm256_set1_ps(FLT_MAX);
  const __m256 s = _mm256_min_ps(max, _mm256_mul_ps(_mm256_castsi256_ps(amax_bits), _mm256_set1_ps(to_scale)));
  const __m256i magnitude = _mm256_min_epu32(_mm256_add_epi32(magnitude8(s, 3u, 7u, TF_FP8_E4M3_MAX), _mm256_set1_epi32(8)),
                                             _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(s), 24), _mm256_set1_epi32(0x80));
  const __m256i codes = _mm256_or_si256(magnitude, sign);
  const float s_dec = 1.0f / s_enc;
  const __m256 scale = _mm256_mul_ps(e4m3_decode8(codes), _mm256_set1_ps(s_dec));
  *multiplier = _mm256_min_ps(max, _mm256_div_ps(_mm256_set1_ps(1.0f), scale));
  return codes;
}

TF_AVX2_INLINE __m256i e2m1_sign8(__m256i bits) {
  return _mm256_and_si256(_mm256_srli_epi32(bits, 28), _mm256_set1_epi32(8));
}

/* The code of a value on the grid (or truncated onto it) from its bits >> 22, by their low 3 bits: 252 + code from
 * 0.5 (253 too: 0.75 truncates to 0.5), 254 + code - 2 from 1.0 on; lanes below 0.5 are the callers'. */
TF_AVX2_INLINE __m256i grid_code8(__m256 r) {
  return _mm256_permutevar8x32_epi32(_mm256_setr_epi32(4, 5, 6, 7, 1, 1, 2, 3), _mm256_srli_epi32(_mm256_castps_si256(r), 22));
}

/* tf_e2m1_encode_rn of each lane (nvfp4_quantize_avx512.c's e2m1_rn16). */
TF_AVX2_INLINE __m256i e2m1_rn8(__m256 v) {
  const __m256 a = _mm256_castsi256_ps(abs_bits8(v));
  const __m256 c = _mm256_min_ps(_mm256_set1_ps(6.0f), a); /* NaN stays NaN */
  const __m256i e = _mm256_max_epi32(_mm256_and_si256(_mm256_castps_si256(c), _mm256_set1_epi32(0x7F800000)),
                                     _mm256_set1_epi32(127 << 23));
  const __m256 magic = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_set1_epi32(22 << 23)));
  const __m256 r = _mm256_sub_ps(_mm256_add_ps(c, magic), magic);
  const __m256i nonzero = _mm256_castps_si256(_mm256_cmp_ps(r, _mm256_setzero_ps(), _CMP_NEQ_OQ));
  return _mm256_or_si256(_mm256_and_si256(grid_code8(r), nonzero), e2m1_sign8(_mm256_castps_si256(v)));
}

/* tf_e2m1_encode_sr of each lane with the 24 random bits u24 (nvfp4_quantize_avx512.c's e2m1_sr16). */
TF_AVX2_INLINE __m256i e2m1_sr8(__m256 v, __m256i u24) {
  const __m256 a = _mm256_castsi256_ps(abs_bits8(v));
  const __m256 c = _mm256_min_ps(_mm256_set1_ps(6.0f), a);
  const __m256i from_half = _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(0.5f), _CMP_GE_OQ)); /* NaN: no */
  const __m256i lo = _mm256_and_si256(grid_code8(c), from_half);
  const __m256 grid = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256 inverse_q = _mm256_setr_ps(2.0f, 2.0f, 2.0f, 2.0f, 1.0f, 1.0f, 0.5f, 0.5f);
  const __m256 d = _mm256_mul_ps(_mm256_sub_ps(a, _mm256_permutevar8x32_ps(grid, lo)),
                                 _mm256_permutevar8x32_ps(inverse_q, lo));
  const __m256 up = _mm256_and_ps(_mm256_cmp_ps(a, _mm256_set1_ps(6.0f), _CMP_LT_OQ),
                                  _mm256_cmp_ps(_mm256_cvtepi32_ps(u24), _mm256_mul_ps(d, _mm256_set1_ps(16777216.0f)),
                                                _CMP_LT_OQ));
  /* up's lanes are all ones (-1) or 0. */
  return _mm256_or_si256(_mm256_sub_epi32(lo, _mm256_castps_si256(up)), e2m1_sign8(_mm256_castps_si256(v)));
}

/* z * c mod 2^64 in each 64-bit lane, from 32 x 32 -> 64-bit products. */
TF_AVX2_INLINE __m256i mul64(__m256i z, uint64_t c) {
  const __m256i lo = _mm256_set1_epi64x((long long)(c & 0xFFFFFFFFu)), hi = _mm256_set1_epi64x((long long)(c >> 32));
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(z, 32), lo), _mm256_mul_epu32(z, hi));
  return _mm256_add_epi64(_mm256_mul_epu32(z, lo), _mm256_slli_epi64(cross, 32));
}

/* tf_nvfp4_random24 of the SplitMix64 state z of each 64-bit lane, in the lane's low 32 bits. */
TF_AVX2_INLINE __m256i random24x4(__m256i z) {
  z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), 0xBF58476D1CE4E5B9ull);
  z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), 0x94D049BB133111EBull);
  z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
  return _mm256_srli_epi64(z, 40);
}

/* 8 draws in 32-bit lanes: lanes 0-3 from the states z0, 4-7 from z1. */
TF_AVX2_INLINE __m256i random24x8(__m256i z0, __m256i z1) {
  const __m256 a = _mm256_castsi256_ps(random24x4(z0)), b = _mm256_castsi256_ps(random24x4(z1));
  /* The even 32-bit lanes: 0 2 of a, 0 2 of b | 4 6 of a, 4 6 of b, put back in order. */
  return _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(a, b, 0x88)), 0xD8);
}

/* The 8 bytes of 16 codes (lanes 0-7 in lo, 8-15 in hi), two a byte, the even lane's in the low nibble. */
TF_AVX2_INLINE __m128i pack_codes16(__m256i lo, __m256i hi) {
  const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  const __m256i a = _mm256_permutevar8x32_epi32(_mm256_or_si256(lo, _mm256_srli_epi64(lo, 28)), even);
  const __m256i b = _mm256_permutevar8x32_epi32(_mm256_or_si256(hi, _mm256_srli_epi64(hi, 28)), even);
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(a), _mm256_castsi256_si128(b));
  return _mm_packus_epi16(words, _mm_setzero_si128());
}

TF_AVX2_INLINE int rht_negative(int j, int i) {
  return (__builtin_popcount((unsigned)(i & j)) & 1) ^ ((TF_NVFP4_RHT_SIGN_MASK >> j) & 1);
}

/* t[i] for i in [i0, i0 + 8) of the transform of v[.][h] (nvfp4_quantize_avx512.c's rht16). */
TF_AVX2_INLINE void rht8(const __m256 v[LANES][2], int h, int i0, __m256 t[LANES]) {
#pragma GCC unroll 8
  for (int i = 0; i < HALF; ++i) t[i0 + i] = _mm256_setzero_ps();
#pragma GCC unroll 16
  for (int j = 0; j < LANES; ++j) {
    const __m256 p = _mm256_mul_ps(v[j][h], _mm256_set1_ps(0.25f));
    const __m256 n = _mm256_xor_ps(p, _mm256_set1_ps(-0.0f));
#pragma GCC unroll 8
    for (int i = 0; i < HALF; ++i) t[i0 + i] = _mm256_add_ps(t[i0 + i], rht_negative(j, i0 + i) ? n : p);
  }
}

/* The columnwise values of half h of the block: transformed, or v itself. */
TF_AVX2_INLINE void column_values(const __m256 v[LANES][2], int h, int rht, __m256 t[LANES]) {
  if (rht) {
    rht8(v, h, 0, t);
    rht8(v, h, HALF, t);
  } else {
    for (int i = 0; i < LANES; ++i) t[i] = v[i][h];
  }
}

/* ---- amax -------------------------------------------------------------------------------------- */

TF_AVX2_INLINE int32_t amax_band(const tf_nvfp4_amax_args *a, int64_t row_begin, int64_t row_end, tf_dtype d) {
  __m256i best = _mm256_setzero_si256();
  __m256 v[LANES][2], t[LANES];
  for (int64_t g = row_begin; g < row_end; g += LANES)
    for (int64_t c = 0; c < a->cols; c += LANES) {
      load_rows16(a->x, d, a->ld_x, a->rows, g, c, a->cols - c, v);
      for (int h = 0; h < 2; ++h) {
        column_values(v, h, a->rht, t);
        for (int i = 0; i < LANES; ++i) best = max2(best, abs_bits8(t[i]));
      }
    }
  return (int32_t)hmax_u32(best); /* non-negative int32 values: unsigned order is theirs */
}

TF_TARGET_AVX2 void tf_nvfp4_amax_band_avx2(const tf_nvfp4_amax_args *a, int64_t row_begin, int64_t row_end,
                                            int32_t *result) {
  *result = a->dtype == TF_FLOAT32    ? amax_band(a, row_begin, row_end, TF_FLOAT32)
            : a->dtype == TF_BFLOAT16 ? amax_band(a, row_begin, row_end, TF_BFLOAT16)
                                      : amax_band(a, row_begin, row_end, TF_FLOAT16);
}

/* ---- quantize ---------------------------------------------------------------------------------- */

/* Lane k's offsets of the SplitMix64 state, 4 lanes a vector: k * GOLDEN (rowwise) and k * rows_p * GOLDEN
 * (columnwise). */
typedef struct draws {
  __m256i row[4], col[4];
} draws;

TF_AVX2_INLINE __m256i lane_multiples4(uint64_t first, uint64_t step) {
  return _mm256_setr_epi64x((long long)(first * step), (long long)((first + 1u) * step),
                            (long long)((first + 2u) * step), (long long)((first + 3u) * step));
}

/* 16 draws from the state z0 of lane 0, lane k's offset by offsets[k / 4]: lanes 0-7 in r[0], 8-15 in r[1]. */
TF_AVX2_INLINE void random24x16(uint64_t z0, const __m256i offsets[4], __m256i r[2]) {
  const __m256i z = _mm256_set1_epi64x((long long)z0);
  r[0] = random24x8(_mm256_add_epi64(z, offsets[0]), _mm256_add_epi64(z, offsets[1]));
  r[1] = random24x8(_mm256_add_epi64(z, offsets[2]), _mm256_add_epi64(z, offsets[3]));
}

TF_AVX2_INLINE void rowwise16(const tf_nvfp4_quantize_args *a, const __m256 v[LANES][2], int64_t g, int64_t nr,
                              int64_t c, int two_d, uint8_t code_2d, float multiplier_2d, const draws *dr) {
  uint32_t code[LANES];
  float multiplier[LANES];
  if (two_d) {
    for (int r = 0; r < LANES; ++r) code[r] = code_2d, multiplier[r] = multiplier_2d;
  } else {
    for (int q = 0; q < 2; ++q) {
      __m256i bits[HALF];
      __m256 mu;
      for (int r = 0; r < HALF; ++r)
        bits[r] = max2(abs_bits8(v[HALF * q + r][0]), abs_bits8(v[HALF * q + r][1]));
      _mm256_storeu_si256((__m256i *)(code + HALF * q), block_scales8(row_maxima8(bits), a->s_enc, &mu));
      _mm256_storeu_ps(multiplier + HALF * q, mu);
    }
  }
  const int64_t ld_y = a->cols_p / 2;
  for (int64_t r = 0; r < nr; ++r) {
    a->scale[(g + r) * a->ld_scale + c / LANES] = (uint8_t)code[r];
    const __m256 m = _mm256_set1_ps(multiplier[r]);
    const __m256 s0 = _mm256_mul_ps(v[r][0], m), s1 = _mm256_mul_ps(v[r][1], m);
    __m256i c0, c1;
    if (a->stochastic) {
      __m256i u[2];
      random24x16(a->seed + ((uint64_t)((g + r) * a->cols_p + c) + 1u) * GOLDEN, dr->row, u);
      c0 = e2m1_sr8(s0, u[0]), c1 = e2m1_sr8(s1, u[1]);
    } else {
      c0 = e2m1_rn8(s0), c1 = e2m1_rn8(s1);
    }
    _mm_storel_epi64((__m128i *)(a->y + (g + r) * ld_y + c / 2), pack_codes16(c0, c1));
  }
}

TF_AVX2_INLINE void columnwise16(const tf_nvfp4_quantize_args *a, const __m256 v[LANES][2], int64_t g, int64_t c,
                                 int64_t nk, int two_d, uint8_t code_2d, float multiplier_2d, const draws *dr) {
  const uint64_t counter = (uint64_t)a->rows_p * (uint64_t)a->cols_p + (uint64_t)(c * a->rows_p + g);
  const int64_t ld_y_t = a->rows_p / 2;
  for (int h = 0; h < 2 && HALF * h < nk; ++h) {
    __m256 t[LANES], mu;
    uint32_t code[HALF], low[HALF], high[HALF];
    column_values(v, h, a->rht_t, t);
    if (two_d) {
      for (int k = 0; k < HALF; ++k) code[k] = code_2d;
      mu = _mm256_set1_ps(multiplier_2d);
    } else {
      __m256i m = _mm256_setzero_si256();
      for (int i = 0; i < LANES; ++i) m = max2(m, abs_bits8(t[i]));
      _mm256_storeu_si256((__m256i *)code, block_scales8(m, a->s_enc_t, &mu));
    }
    /* Value i of column c + 8h + k draws counter + (8h + k) * rows_p + i. */
    const uint64_t z0 = a->seed + (counter + (uint64_t)(HALF * h) * (uint64_t)a->rows_p + 1u) * GOLDEN;
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int i = 0; i < LANES; ++i) {
      const __m256 s = _mm256_mul_ps(t[i], mu);
      __m256i codes;
      if (a->stochastic) {
        const __m256i z = _mm256_set1_epi64x((long long)(z0 + (uint64_t)i * GOLDEN));
        codes = e2m1_sr8(s, random24x8(_mm256_add_epi64(z, dr->col[0]), _mm256_add_epi64(z, dr->col[1])));
      } else {
        codes = e2m1_rn8(s);
      }
      if (i < HALF)
        lo = _mm256_or_si256(lo, _mm256_sllv_epi32(codes, _mm256_set1_epi32(4 * i)));
      else
        hi = _mm256_or_si256(hi, _mm256_sllv_epi32(codes, _mm256_set1_epi32(4 * (i - HALF))));
    }
    _mm256_storeu_si256((__m256i *)low, lo);
    _mm256_storeu_si256((__m256i *)high, hi);
    for (int64_t k = 0; k < min64(HALF, nk - HALF * h); ++k) {
      const int64_t col = c + HALF * h + k;
      const uint64_t bytes = (uint64_t)low[k] | (uint64_t)high[k] << 32;
      a->scale_t[col * a->ld_scale_t + g / LANES] = (uint8_t)code[k];
      memcpy(a->y_t + col * ld_y_t + g / 2, &bytes, sizeof bytes);
    }
  }
}

TF_AVX2_INLINE void quantize_band(const tf_nvfp4_quantize_args *a, int64_t row_begin, int64_t row_end, tf_dtype d) {
  const uint64_t rows_p_golden = (uint64_t)a->rows_p * GOLDEN;
  draws dr;
  for (int q = 0; q < 4; ++q) {
    dr.row[q] = lane_multiples4((uint64_t)(4 * q), GOLDEN);
    dr.col[q] = lane_multiples4((uint64_t)(4 * q), rows_p_golden);
  }
  __m256 v[LANES][2];
  for (int64_t g = row_begin; g < row_end; g += LANES) {
    const int64_t nr = min64(LANES, a->rows - g);
    for (int64_t c = 0; c < a->cols; c += LANES) {
      const int64_t nk = min64(LANES, a->cols - c);
      load_rows16(a->x, d, a->ld_x, a->rows, g, c, nk, v);
      uint8_t code_2d = 0;
      float multiplier_2d = 0.0f, multiplier_2d_t = 0.0f;
      if (a->block_2d) {
        __m256i m = _mm256_setzero_si256();
        for (int r = 0; r < LANES; ++r) m = max2(m, max2(abs_bits8(v[r][0]), abs_bits8(v[r][1])));
        const float amax = tf_f32_from_bits(hmax_u32(m));
        code_2d = tf_nvfp4_block_scale(amax, a->s_enc);
        multiplier_2d = tf_nvfp4_encode_multiplier(code_2d, a->s_enc);
        multiplier_2d_t = tf_nvfp4_encode_multiplier(code_2d, a->s_enc_t);
      }
      if (a->y) rowwise16(a, v, g, nr, c, a->block_2d, code_2d, multiplier_2d, &dr);
      if (a->y_t) columnwise16(a, v, g, c, nk, a->block_2d, code_2d, multiplier_2d_t, &dr);
    }
  }
}

TF_TARGET_AVX2 void tf_nvfp4_quantize_band_avx2(const tf_nvfp4_quantize_args *a, int64_t row_begin,
                                                int64_t row_end) {
  if (a->dtype == TF_FLOAT32)
    quantize_band(a, row_begin, row_end, TF_FLOAT32);
  else if (a->dtype == TF_BFLOAT16)
    quantize_band(a, row_begin, row_end, TF_BFLOAT16);
  else
    quantize_band(a, row_begin, row_end, TF_FLOAT16);
}

#endif /* TF_X86 */
