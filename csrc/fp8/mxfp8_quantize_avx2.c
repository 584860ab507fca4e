/*
 * MXFP8's quantizer on AVX2 + F16C: the bytes of fp8_block.c's loops, for the CPUs without AVX-512
 * (mxfp8_quantize_avx512.c serves those with it).
 *
 * Every dtype is widened to float32, 32 elements (4 vectors of 8) a step; a row's ragged end goes
 * through a zero-filled buffer. A block's amax is TE's fmaxf (NaN dropped) taken as int32 bits, its E8M0
 * code and multipliers fp8_block_format.h's, and its values go through fp8_encode_avx2.h's fast encoder
 * where every multiplier of the step allows it (tf_fp8_fast_scale), else through the generic one.
 *   - Rowwise, a 1x32 block is one step.
 *   - Columnwise, a group of up to 32 rows (one block high) goes 128 columns at a time: one pass along
 *     its rows for the column amaxes, one for the codes under per-lane multipliers (walking along rows
 *     keeps the power-of-two row strides of typical shapes out of one cache set).
 *   - With both usages, a group is encoded rowwise first, so the column pass reads it from cache.
 */
#include "mxfp8_band.h"

#if TF_X86
#include <string.h>

#include "fp8_block.h"
#include "fp8_block_format.h"
#include "fp8_encode_avx2.h"
#include "fp8_kernels.h"

enum { STEP = 32, LANES = 8, CHUNK = 128 };

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The elements x[i, i + n) as float32 in v[0..3], zeros past n (n <= 0: none is read). */
TF_AVX2_INLINE void load32(const void *x, int64_t i, int64_t n, tf_dtype d, __m256 v[4]) {
  if (n >= STEP) {
    for (int k = 0; k < 4; ++k) v[k] = load8(x, i + LANES * k, d);
    return;
  }
  float f[STEP] = {0.0f};
  for (int64_t j = 0; j < n; ++j)
    f[j] = d == TF_FLOAT32    ? ((const float *)x)[i + j]
           : d == TF_BFLOAT16 ? tf_bf16_to_f32(((const uint16_t *)x)[i + j])
                              : tf_f16_to_f32(((const uint16_t *)x)[i + j]);
  for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(f + LANES * k);
}

/* y[i, i + n) = the first n of 32 codes (n <= 0: nothing is written). */
TF_AVX2_INLINE void store32(uint8_t *y, int64_t i, __m256i codes, int64_t n) {
  if (n >= STEP) {
    _mm256_storeu_si256((__m256i *)(y + i), codes);
  } else if (n > 0) {
    uint8_t buffer[STEP];
    _mm256_storeu_si256((__m256i *)buffer, codes);
    memcpy(y + i, buffer, (size_t)n);
  }
}

/* tf_abs_bits_no_nan of each lane. */
TF_AVX2_INLINE __m256i abs_bits_no_nan8(__m256 v) {
  const __m256i a = abs_bits8(v);
  return _mm256_andnot_si256(_mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)), a);
}

/* The max of v[0..3]'s abs_bits_no_nan8, lane by lane. */
TF_AVX2_INLINE __m256i amax32(const __m256 v[4]) {
  return _mm256_max_epi32(_mm256_max_epi32(abs_bits_no_nan8(v[0]), abs_bits_no_nan8(v[1])),
                          _mm256_max_epi32(abs_bits_no_nan8(v[2]), abs_bits_no_nan8(v[3])));
}

/* The 32 codes of v[0..3]: the fast encoder (fast multipliers s) when `fast`, else the generic one (m). */
TF_AVX2_INLINE __m256i encode32(const __m256 v[4], const __m256 m[4], const __m256 s[4], int fast,
                                tf_fp8_format f) {
  if (!fast) {
    const __m256 w[4] = {_mm256_mul_ps(v[0], m[0]), _mm256_mul_ps(v[1], m[1]), _mm256_mul_ps(v[2], m[2]),
                         _mm256_mul_ps(v[3], m[3])};
    return codes32(w, f);
  }
  __m128i h[4];
  for (int k = 0; k < 4; ++k) h[k] = fast_round8(_mm256_mul_ps(_mm256_castsi256_ps(abs_bits8(v[k])), s[k]), f);
  /* Signed packs keep each sign bit; per 128-bit lane they leave 4-byte groups 0 2 4 6 | 1 3 5 7. */
  const __m256i sign = _mm256_packs_epi16(
      _mm256_packs_epi32(_mm256_castps_si256(v[0]), _mm256_castps_si256(v[1])),
      _mm256_packs_epi32(_mm256_castps_si256(v[2]), _mm256_castps_si256(v[3])));
  const __m256i ordered = _mm256_permutevar8x32_epi32(sign, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  return _mm256_or_si256(fast_codes32(h, f), _mm256_and_si256(ordered, _mm256_set1_epi8((char)0x80)));
}

/* Row r's 1x32 blocks: their scales and codes. */
TF_AVX2_INLINE void rowwise(const tf_mxfp8_args *a, int64_t r, tf_dtype d, tf_fp8_format f) {
  const int64_t row = r * a->ld_x, row_y = r * a->cols;
  for (int64_t b = 0; b < a->cols; b += STEP) {
    const int64_t n = a->cols - b;
    __m256 v[4];
    load32(a->x, row + b, n, d, v);
    const uint8_t code = tf_mxfp8_scale_code(tf_f32_from_bits(hmax_u32(amax32(v))), f);
    a->scale[r * a->ld_scale + b / TF_MXFP8_BLOCK] = code;
    const float multiplier = tf_e8m0_quant_multiplier(code);
    const __m256 m = _mm256_set1_ps(multiplier), s = _mm256_set1_ps(tf_fp8_fast_multiplier(multiplier, f));
    const __m256 ms[4] = {m, m, m, m}, ss[4] = {s, s, s, s};
    store32(a->y, row_y + b, encode32(v, ms, ss, tf_fp8_fast_scale(multiplier, f), f), n);
  }
}

/* The 32x1 blocks of the nr (<= 32) rows from g, whose first is a multiple of 32. */
TF_AVX2_INLINE void columnwise(const tf_mxfp8_args *a, int64_t g, int64_t nr, tf_dtype d, tf_fp8_format f) {
  uint8_t *scale = a->scale_col + g / TF_MXFP8_BLOCK * a->ld_scale_col;
  for (int64_t c0 = 0; c0 < a->cols; c0 += CHUNK) {
    const int64_t nc = min64(CHUNK, a->cols - c0), steps = (nc + STEP - 1) / STEP;
    __m256i amax[CHUNK / LANES];
    for (int k = 0; k < CHUNK / LANES; ++k) amax[k] = _mm256_setzero_si256();
    for (int64_t r = g; r < g + nr; ++r)
      for (int64_t q = 0; q < steps; ++q) {
        __m256 v[4];
        load32(a->x, r * a->ld_x + c0 + q * STEP, nc - q * STEP, d, v);
        for (int k = 0; k < 4; ++k) amax[4 * q + k] = _mm256_max_epi32(amax[4 * q + k], abs_bits_no_nan8(v[k]));
      }
    int32_t column_amax[CHUNK];
    float multiplier[CHUNK], fast_multiplier[CHUNK];
    int fast[CHUNK / STEP];
    for (int k = 0; k < CHUNK / LANES; ++k) _mm256_storeu_si256((__m256i *)(column_amax + LANES * k), amax[k]);
    for (int64_t q = 0; q < steps; ++q) {
      fast[q] = 1;
      for (int64_t j = q * STEP; j < (q + 1) * STEP; ++j) { /* past nc: amax 0, a fast multiplier, no store */
        const uint8_t code = tf_mxfp8_scale_code(tf_f32_from_bits((uint32_t)column_amax[j]), f);
        if (j < nc) scale[c0 + j] = code;
        multiplier[j] = tf_e8m0_quant_multiplier(code);
        fast_multiplier[j] = tf_fp8_fast_multiplier(multiplier[j], f);
        fast[q] &= tf_fp8_fast_scale(multiplier[j], f);
      }
    }
    for (int64_t r = g; r < g + nr; ++r)
      for (int64_t q = 0; q < steps; ++q) {
        const int64_t i = c0 + q * STEP;
        __m256 v[4], m[4], s[4];
        load32(a->x, r * a->ld_x + i, nc - q * STEP, d, v);
        for (int k = 0; k < 4; ++k) {
          m[k] = _mm256_loadu_ps(multiplier + q * STEP + LANES * k);
          s[k] = _mm256_loadu_ps(fast_multiplier + q * STEP + LANES * k);
        }
        store32(a->y_col, r * a->cols + i, encode32(v, m, s, fast[q], f), nc - q * STEP);
      }
  }
}

TF_AVX2_INLINE void band(const tf_mxfp8_args *a, int64_t row_begin, int64_t row_end, tf_dtype d,
                         tf_fp8_format f) {
  for (int64_t g = row_begin; g < row_end; g = (g / TF_MXFP8_BLOCK + 1) * TF_MXFP8_BLOCK) {
    const int64_t nr = min64(row_end, (g / TF_MXFP8_BLOCK + 1) * TF_MXFP8_BLOCK) - g;
    if (a->y)
      for (int64_t r = g; r < g + nr; ++r) rowwise(a, r, d, f);
    if (a->y_col) columnwise(a, g, nr, d, f);
  }
}

TF_TARGET_AVX2 void tf_mxfp8_band_avx2(const tf_mxfp8_args *a, int64_t row_begin, int64_t row_end) {
  TF_MXFP8_BANDS(band, a, row_begin, row_end);
}

#endif
