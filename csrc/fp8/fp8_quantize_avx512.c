/*
 * The FP8 quantizer kernels on AVX-512 (F + BW + VL), 16 lanes at a time, 64 elements a step.
 *
 * The encoders (fp8_encode_avx512.h) are fp8_quantize_avx2.c's, whose comments explain them, at
 * twice the width; what differs is how the lanes are gathered and packed:
 *   - bfloat16 is widened without a shuffle: of each 32-bit pair of elements, the even one is the
 *     pair shifted left by 16 and the odd one the pair with its low half cleared. Their float16
 *     bits then give the codes of elements 2j and 2j+1 as the low and high byte of word j, merged
 *     by one vpternlogd, so the 64 codes come out in order;
 *   - the signs come from mask registers (vpmovw2m, vpcmpd) and are added to the codes by one
 *     masked byte add;
 *   - the generic encoder narrows its 32-bit codes with vpmovdb.
 * No table kernels of their own: on this tier the fast encoder is quicker than a lookup, so
 * tf_fp8_table_pays turns the table path off, and the table kernels, still callable, are AVX2's.
 * Cast-transpose is fp8_cast_transpose_avx512.c's. Dequantize's outputs are copied out of their 256
 * values by lookup16 and lookup32, 32 codes a step.
 *
 * Only whole steps are done here; the elements past them are handed to the AVX2 kernels (which
 * hand their own remainder to the portable ones): the same bytes.
 */
#include <float.h>

#include "fp8_kernels.h"
#include "fp8_quantize.h"

#include "../common/cpu_features.h"

#if TF_X86
#include "fp8_encode_avx512.h"

enum { GENERIC = 0, FAST = 1 };

/* ---- The fast encoder's 64-element steps (its rounding: fp8_encode_avx512.h). ---- */

/* The codes of float16 bits h >> shift (E4M3: 7, E5M2: 8), NaN's brought to 0x7F, signs added. */
TF_AVX512_INLINE __m512i finish_codes(__m512i codes, __mmask64 negative, tf_fp8_format f) {
  if (f == TF_FP8_E4M3)
    codes = _mm512_min_epu8(codes, _mm512_set1_epi8(0x7F));
  else /* E5M2 numbers end at 0x7B; NaN leaves 0x7E or 0x7F */
    codes = _mm512_mask_mov_epi8(codes, _mm512_cmpgt_epu8_mask(codes, _mm512_set1_epi8(0x7B)),
                                 _mm512_set1_epi8(0x7F));
  return _mm512_mask_add_epi8(codes, negative, codes, _mm512_set1_epi8((char)0x80));
}

/* The 64 codes without sign of h[0..3] (float16 bits of elements 16k..16k+15 in h[k]), in order. */
TF_AVX512_INLINE __m512i codes_of_halves(const __m256i h[4], tf_fp8_format f) {
  const int shift = f == TF_FP8_E4M3 ? 7 : 8;
  const __m512i h01 = _mm512_inserti64x4(_mm512_castsi256_si512(h[0]), h[1], 1);
  const __m512i h23 = _mm512_inserti64x4(_mm512_castsi256_si512(h[2]), h[3], 1);
  /* packus works per 128-bit lane, leaving the 8-element groups in the order 0 4 1 5 2 6 3 7. */
  const __m512i packed = _mm512_packus_epi16(_mm512_srli_epi16(h01, shift), _mm512_srli_epi16(h23, shift));
  return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), packed);
}

/*
 * Fast-encodes the 64 elements at x + i (s: the fast multiplier) and folds |x| into *amax:
 * float32 lanes for float32 input, 16-bit lanes for bfloat16 and float16.
 */
TF_AVX512_INLINE __m512i fast_encode64(const void *x, int64_t i, __m512 s, __m512i *amax, tf_dtype d,
                                       tf_fp8_format f) {
  if (d == TF_FLOAT32) {
    __m256i h[4];
    __mmask16 neg[4];
    for (int k = 0; k < 4; ++k) {
      const __m512i xk = _mm512_loadu_si512((const float *)x + i + 16 * k);
      const __m512i a = _mm512_and_si512(xk, _mm512_set1_epi32(0x7FFFFFFF));
      *amax = _mm512_max_epu32(*amax, a);
      neg[k] = _mm512_cmplt_epi32_mask(xk, _mm512_setzero_si512());
      h[k] = fast_round16(_mm512_mul_ps(_mm512_castsi512_ps(a), s), f);
    }
    const __mmask64 negative =
        _mm512_kunpackd(_mm512_kunpackw(neg[3], neg[2]), _mm512_kunpackw(neg[1], neg[0]));
    return finish_codes(codes_of_halves(h, f), negative, f);
  }
  const __m512i x0 = _mm512_loadu_si512((const uint16_t *)x + i);
  const __m512i x1 = _mm512_loadu_si512((const uint16_t *)x + i + 32);
  const __m512i abs_mask = _mm512_set1_epi16(0x7FFF);
  const __m512i a0 = _mm512_and_si512(x0, abs_mask), a1 = _mm512_and_si512(x1, abs_mask);
  *amax = _mm512_max_epu16(*amax, _mm512_max_epu16(a0, a1));
  const __mmask64 negative = _mm512_kunpackd(_mm512_movepi16_mask(x1), _mm512_movepi16_mask(x0));
  if (d == TF_BFLOAT16) {
    const __m512i codes =
        _mm512_inserti64x4(_mm512_castsi256_si512(bf16_codes32(a0, s, s, f)), bf16_codes32(a1, s, s, f), 1);
    return finish_codes(codes, negative, f);
  }
  const __m256i h[4] = {
      fast_round16(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(a0)), s), f),
      fast_round16(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(a0, 1)), s), f),
      fast_round16(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(a1)), s), f),
      fast_round16(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(a1, 1)), s), f)};
  return finish_codes(codes_of_halves(h, f), negative, f);
}

/* ---- Either encoder. ---- */

/*
 * Encodes the 64 elements at x + i and folds their |x| into *amax (16-bit lanes for 16-bit input
 * under the fast encoder, float32 bits otherwise). s is the scale, or the fast multiplier.
 */
TF_AVX512_INLINE __m512i encode64(const void *x, int64_t i, __m512 s, __m512i *amax, tf_dtype d,
                                  tf_fp8_format f, int mode) {
  if (mode == FAST) return fast_encode64(x, i, s, amax, d, f);
  __m128i q[4];
  for (int k = 0; k < 4; ++k) {
    const __m512 xk = load16(x, i + 16 * k, d);
    *amax = _mm512_max_epu32(*amax, _mm512_and_si512(_mm512_castps_si512(xk), _mm512_set1_epi32(0x7FFFFFFF)));
    q[k] = generic_codes16(_mm512_mul_ps(xk, s), f);
  }
  const __m512i lo = _mm512_inserti32x4(_mm512_castsi128_si512(q[0]), q[1], 1);
  return _mm512_inserti32x4(_mm512_inserti32x4(lo, q[2], 2), q[3], 3);
}

/* The amax bits of an encode64 accumulator, or UINT32_MAX where the caller must recount. */
TF_AVX512_INLINE uint32_t amax_of(__m512i amax, tf_dtype d, int mode) {
  if (mode == GENERIC || d == TF_FLOAT32) return _mm512_reduce_max_epu32(amax);
  const __m512i m = _mm512_max_epu32(_mm512_and_si512(amax, _mm512_set1_epi32(0xFFFF)), _mm512_srli_epi32(amax, 16));
  return tf_fp8_amax_of_16bit_max(_mm512_reduce_max_epu32(m), d);
}

enum { PREFETCH_BYTES = 4096 };

TF_AVX512_INLINE uint32_t quantize_range(const void *x, int64_t begin, int64_t end, float scale, uint8_t *y,
                                         tf_dtype d, tf_fp8_format f, int mode) {
  const __m512 s = _mm512_set1_ps(mode == FAST ? tf_fp8_fast_multiplier(scale, f) : scale);
  __m512i amax = _mm512_setzero_si512();
  const int64_t size = tf_dtype_size(d);
  int64_t i = begin;
  for (; end - i >= 64; i += 64) {
    /* x 4 KiB ahead, as on the AVX2 path (a hint: the address may lie past x). */
    const uintptr_t ahead = (uintptr_t)x + (uintptr_t)(i * size + PREFETCH_BYTES);
    for (int64_t line = 0; line < 64 * size; line += 64)
      _mm_prefetch((const char *)(ahead + (uintptr_t)line), _MM_HINT_T0);
    _mm512_storeu_si512(y + i, encode64(x, i, s, &amax, d, f, mode));
  }
  uint32_t head = amax_of(amax, d, mode);
  if (head == UINT32_MAX) head = tf_fp8_kernels_portable.amax[d](x, begin, i);
  const uint32_t tail = tf_fp8_kernels_avx2->quantize[d][f](x, i, end, scale, y);
  return head > tail ? head : tail;
}

#define DEFINE_QUANTIZE(NAME, DTYPE, FORMAT)                                                       \
  static TF_TARGET_AVX512 uint32_t NAME(const void *x, int64_t begin, int64_t end, float scale,    \
                                        uint8_t *y) {                                              \
    return tf_fp8_fast_scale(scale, FORMAT) ? quantize_range(x, begin, end, scale, y, DTYPE, FORMAT, FAST) \
                                     : quantize_range(x, begin, end, scale, y, DTYPE, FORMAT, GENERIC); \
  }

DEFINE_QUANTIZE(quantize_f32_e4m3, TF_FLOAT32, TF_FP8_E4M3)
DEFINE_QUANTIZE(quantize_f32_e5m2, TF_FLOAT32, TF_FP8_E5M2)
DEFINE_QUANTIZE(quantize_bf16_e4m3, TF_BFLOAT16, TF_FP8_E4M3)
DEFINE_QUANTIZE(quantize_bf16_e5m2, TF_BFLOAT16, TF_FP8_E5M2)
DEFINE_QUANTIZE(quantize_f16_e4m3, TF_FLOAT16, TF_FP8_E4M3)
DEFINE_QUANTIZE(quantize_f16_e5m2, TF_FLOAT16, TF_FP8_E5M2)

/* The table kernels are AVX2's (see the top of the file). */
static uint32_t quantize_table_bf16(const void *x, int64_t begin, int64_t end, const uint8_t *table, uint8_t *y) {
  return tf_fp8_kernels_avx2->quantize_table[0](x, begin, end, table, y);
}
static uint32_t quantize_table_f16(const void *x, int64_t begin, int64_t end, const uint8_t *table, uint8_t *y) {
  return tf_fp8_kernels_avx2->quantize_table[1](x, begin, end, table, y);
}

/* float32: 32 elements a step in float32 bits; bfloat16 and float16: 64 in 16-bit lanes. */
TF_AVX512_INLINE uint32_t amax_range(const void *x, int64_t begin, int64_t end, tf_dtype d) {
  __m512i m0 = _mm512_setzero_si512(), m1 = _mm512_setzero_si512();
  const __m512i abs_mask = _mm512_set1_epi32(d == TF_FLOAT32 ? 0x7FFFFFFF : 0x7FFF7FFF);
  const int64_t step = d == TF_FLOAT32 ? 32 : 64, half = step / 2;
  const char *p = (const char *)x;
  const int64_t size = tf_dtype_size(d);
  int64_t i = begin;
  for (; end - i >= step; i += step) {
    const __m512i v0 = _mm512_and_si512(_mm512_loadu_si512(p + i * size), abs_mask);
    const __m512i v1 = _mm512_and_si512(_mm512_loadu_si512(p + (i + half) * size), abs_mask);
    m0 = d == TF_FLOAT32 ? _mm512_max_epu32(m0, v0) : _mm512_max_epu16(m0, v0);
    m1 = d == TF_FLOAT32 ? _mm512_max_epu32(m1, v1) : _mm512_max_epu16(m1, v1);
  }
  uint32_t head = d == TF_FLOAT32 ? amax_of(_mm512_max_epu32(m0, m1), d, GENERIC)
                                  : amax_of(_mm512_max_epu16(m0, m1), d, FAST);
  if (head == UINT32_MAX) head = tf_fp8_kernels_portable.amax[d](x, begin, i);
  const uint32_t tail = tf_fp8_kernels_avx2->amax[d](x, i, end);
  return head > tail ? head : tail;
}

#define DEFINE_AMAX(NAME, DTYPE)                                                    \
  static TF_TARGET_AVX512 uint32_t NAME(const void *x, int64_t begin, int64_t end) { \
    return amax_range(x, begin, end, DTYPE);                                        \
  }

DEFINE_AMAX(amax_f32, TF_FLOAT32)
DEFINE_AMAX(amax_bf16, TF_BFLOAT16)
DEFINE_AMAX(amax_f16, TF_FLOAT16)

/*
 * The words of 32 codes c (one per 16-bit lane) in a table of 256 16-bit values held in t[8]: vpermi2w
 * looks a code's low 6 bits up in a pair of registers (64 values), and its bits 6 and 7 pick among the
 * four pairs' answers.
 */
TF_AVX512_INLINE __m512i lookup_words(const __m512i t[8], __m512i c) {
  const __mmask32 high6 = _mm512_test_epi16_mask(c, _mm512_set1_epi16(0x40));
  const __m512i low = _mm512_mask_blend_epi16(high6, _mm512_permutex2var_epi16(t[0], c, t[1]),
                                              _mm512_permutex2var_epi16(t[2], c, t[3]));
  const __m512i high = _mm512_mask_blend_epi16(high6, _mm512_permutex2var_epi16(t[4], c, t[5]),
                                               _mm512_permutex2var_epi16(t[6], c, t[7]));
  return _mm512_mask_blend_epi16(_mm512_test_epi16_mask(c, _mm512_set1_epi16(0x80)), low, high);
}

TF_AVX512_INLINE __m512i codes32(const uint8_t *y) {
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)y));
}

/* x[i] = table[y[i]], 32 codes a step. */
static TF_TARGET_AVX512 void lookup16(const uint8_t *y, int64_t begin, int64_t end, const uint16_t *table,
                                      uint16_t *x) {
  __m512i t[8];
  for (int k = 0; k < 8; ++k) t[k] = _mm512_loadu_si512(table + 32 * k);
  int64_t i = begin;
  for (; end - i >= 32; i += 32) _mm512_storeu_si512(x + i, lookup_words(t, codes32(y + i)));
  tf_fp8_lookup16_portable(y, i, end, table, x);
}

/*
 * The same for 32-bit values, 32 codes a step: their low and high halves looked up as two tables of
 * words, then paired up (the in-lane unpacks leave 128-bit lanes of elements 0-3, 8-11, ... and 4-7,
 * 12-15, ..., which one permute of 64-bit pairs per output puts in order).
 */
static TF_TARGET_AVX512 void lookup32(const uint8_t *y, int64_t begin, int64_t end, const uint32_t *table,
                                      uint32_t *x) {
  uint16_t halves[2][256];
  for (int k = 0; k < 256; ++k) {
    halves[0][k] = (uint16_t)table[k];
    halves[1][k] = (uint16_t)(table[k] >> 16);
  }
  __m512i lo[8], hi[8];
  for (int k = 0; k < 8; ++k) {
    lo[k] = _mm512_loadu_si512(halves[0] + 32 * k);
    hi[k] = _mm512_loadu_si512(halves[1] + 32 * k);
  }
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  int64_t i = begin;
  for (; end - i >= 32; i += 32) {
    const __m512i c = codes32(y + i), l = lookup_words(lo, c), h = lookup_words(hi, c);
    const __m512i a = _mm512_unpacklo_epi16(l, h), b = _mm512_unpackhi_epi16(l, h);
    _mm512_storeu_si512(x + i, _mm512_permutex2var_epi64(a, first, b));
    _mm512_storeu_si512(x + i + 16, _mm512_permutex2var_epi64(a, second, b));
  }
  tf_fp8_lookup32_portable(y, i, end, table, x);
}

static const tf_fp8_kernel_set avx512_kernels = {
    .quantize = {{quantize_f32_e4m3, quantize_f32_e5m2},
                 {quantize_bf16_e4m3, quantize_bf16_e5m2},
                 {quantize_f16_e4m3, quantize_f16_e5m2}},
    .amax = {amax_f32, amax_bf16, amax_f16},
    .cast_transpose = {{tf_fp8_cast_transpose_avx512_f32_e4m3, tf_fp8_cast_transpose_avx512_f32_e5m2},
                       {tf_fp8_cast_transpose_avx512_bf16_e4m3, tf_fp8_cast_transpose_avx512_bf16_e5m2},
                       {tf_fp8_cast_transpose_avx512_f16_e4m3, tf_fp8_cast_transpose_avx512_f16_e5m2}},
    .quantize_table = {quantize_table_bf16, quantize_table_f16},
    .lookup16 = lookup16,
    .lookup32 = lookup32};

const tf_fp8_kernel_set *const tf_fp8_kernels_avx512 = &avx512_kernels;

#else /* not x86-64 */

const tf_fp8_kernel_set *const tf_fp8_kernels_avx512 = 0;

#endif
