/*
 * The AVX2 (+ F16C) FP8 encoders shared by the per-tensor quantizer (fp8_quantize_avx2.c) and MXFP8's
 * (mxfp8_quantize_avx2.c), 8 float32 lanes at a time:
 *   - the generic encoder (codes32) takes x times any scale and builds the codes from the float32 bits;
 *   - the fast encoder takes |x| times the fast multiplier (tf_fp8_fast_multiplier; valid where
 *     tf_fp8_fast_scale holds), rounds it to the FP8 grid as float16 (fast_round8), whose bits shifted
 *     right are the codes (fast_codes32).
 * Include only where TF_X86 holds.
 */
#ifndef TF_FP8_ENCODE_AVX2_H
#define TF_FP8_ENCODE_AVX2_H

#include <immintrin.h>

#include "../common/cpu_features.h"
#include "../common/tf_dtype.h"
#include "fp8_format.h"

#define TF_AVX2_INLINE static inline __attribute__((always_inline)) TF_TARGET_AVX2

/*
 * The codes of 8 values without their sign, less 2^mbits (the code of the
 * smallest normal value): -2^mbits..max_code - 2^mbits for numbers and Inf, a
 * value above 0x7F and below 0x7000 for NaN. The offset lets the sign of the
 * rounding sum choose between the normal and the subnormal result.
 */
TF_AVX2_INLINE __m256i magnitude8(__m256 v, uint32_t mbits, uint32_t bias, float max_value) {
  const uint32_t shift = 23u - mbits;
  const __m256 abs = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  /* vminps returns its second operand when either is NaN: numbers and Inf saturate, NaN stays. */
  const __m256i c = _mm256_castps_si256(_mm256_min_ps(_mm256_set1_ps(max_value), abs));
  /*
   * Normal: round to nearest even at bit `shift`, less the smallest normal. t < 0 exactly when
   * c lies more than half a step below the smallest normal; in that half step both results are 0.
   */
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(c, (int)shift), _mm256_set1_epi32(1));
  const uint32_t round_rebias = ((1u << (shift - 1u)) - 1u) - ((128u - bias) << 23);
  const __m256i t = _mm256_add_epi32(_mm256_add_epi32(c, _mm256_set1_epi32((int)round_rebias)), odd);
  const __m256i normal = _mm256_srai_epi32(t, (int)shift);
  /* Subnormal: the add rounds to the FP8 grid; the code is the sum's bits past C's. */
  const uint32_t magic_bits = (127u + 24u - bias - mbits) << 23;
  const __m256 magic = _mm256_castsi256_ps(_mm256_set1_epi32((int)magic_bits));
  const __m256 sum = _mm256_add_ps(_mm256_castsi256_ps(c), magic);
  const __m256i sub =
      _mm256_sub_epi32(_mm256_castps_si256(sum), _mm256_set1_epi32((int)(magic_bits + (1u << mbits))));
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(normal), _mm256_castsi256_ps(sub),
                                              _mm256_castsi256_ps(t)));
}

/* Mantissa bits of a format. The kernels pass the dtype and the format as constants, which fold. */
TF_AVX2_INLINE uint32_t format_mbits(tf_fp8_format f) { return f == TF_FP8_E4M3 ? 3u : 2u; }

TF_AVX2_INLINE __m256i magnitude8_of(__m256 v, tf_fp8_format f) {
  return f == TF_FP8_E4M3 ? magnitude8(v, 3u, 7u, TF_FP8_E4M3_MAX) : magnitude8(v, 2u, 15u, TF_FP8_E5M2_MAX);
}

/*
 * The 32 codes of v[0..3] (elements 0..31 in order) as 32 bytes. Packing to
 * 16 bits keeps the offset magnitudes, which then get 2^mbits back; packing to
 * bytes saturates a NaN's to 0x7F or above, and vpminub brings it to 0x7F. The
 * signs come from packing the values with signed saturation, which keeps each
 * one's sign bit.
 */
TF_AVX2_INLINE __m256i codes32(const __m256 v[4], tf_fp8_format f) {
  const __m256i offset = _mm256_set1_epi16((short)(1u << format_mbits(f)));
  const __m256i lo =
      _mm256_add_epi16(_mm256_packs_epi32(magnitude8_of(v[0], f), magnitude8_of(v[1], f)), offset);
  const __m256i hi =
      _mm256_add_epi16(_mm256_packs_epi32(magnitude8_of(v[2], f), magnitude8_of(v[3], f)), offset);
  const __m256i sign = _mm256_packs_epi16(
      _mm256_packs_epi32(_mm256_castps_si256(v[0]), _mm256_castps_si256(v[1])),
      _mm256_packs_epi32(_mm256_castps_si256(v[2]), _mm256_castps_si256(v[3])));
  const __m256i bytes = _mm256_or_si256(_mm256_min_epu8(_mm256_packus_epi16(lo, hi), _mm256_set1_epi8(0x7F)),
                                        _mm256_and_si256(sign, _mm256_set1_epi8((char)0x80)));
  /* The packs work per 128-bit lane: 4-byte groups 0 2 4 6 | 1 3 5 7 back in order. */
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* 8 elements from x + i as float32. */
TF_AVX2_INLINE __m256 load8_f32(const void *x, int64_t i) { return _mm256_loadu_ps((const float *)x + i); }
TF_AVX2_INLINE __m256 load8_bf16(const void *x, int64_t i) {
  const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
TF_AVX2_INLINE __m256 load8_f16(const void *x, int64_t i) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i)));
}

TF_AVX2_INLINE __m256 load8(const void *x, int64_t i, tf_dtype d) {
  return d == TF_FLOAT32 ? load8_f32(x, i) : d == TF_BFLOAT16 ? load8_bf16(x, i) : load8_f16(x, i);
}

TF_AVX2_INLINE __m256i abs_bits8(__m256 v) {
  return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7FFFFFFF));
}

TF_AVX2_INLINE uint32_t hmax_u32(__m256i m) {
  __m128i r = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  r = _mm_max_epu32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(1, 0, 3, 2)));
  r = _mm_max_epu32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(2, 3, 0, 1)));
  return (uint32_t)_mm_cvtsi128_si32(r);
}

/* ---- The fast encoder (positive finite scale). ---- */

/*
 * 8 values |v| (non-negative or NaN; for E4M3 scaled by 2^-8) rounded to the FP8 grid, as
 * float16 bits. Both formats' smallest normal value is 2^-14 in these units, float16's own.
 */
TF_AVX2_INLINE __m128i fast_round8(__m256 a, tf_fp8_format f) {
  const float max_value = f == TF_FP8_E4M3 ? TF_FP8_E4M3_MAX * 0x1p-8f : TF_FP8_E5M2_MAX;
  const int mbits = f == TF_FP8_E4M3 ? 3 : 2;
  /* vminps returns its second operand when either is NaN: numbers and Inf saturate, NaN stays. */
  const __m256 c = _mm256_min_ps(_mm256_set1_ps(max_value), a);
  __m256i e = _mm256_and_si256(_mm256_castps_si256(c), _mm256_set1_epi32(0x7F800000));
  e = _mm256_max_epi32(e, _mm256_set1_epi32((127 - 14) << 23));
  /* M's float32 step is c's FP8 step; M's last bit is even, so the add rounds ties to even. */
  const __m256 magic = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_set1_epi32((23 - mbits) << 23)));
  const __m256 rounded = _mm256_sub_ps(_mm256_add_ps(c, magic), magic);
  return _mm256_cvtps_ph(rounded, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/*
 * The 32 codes without sign of h[0..3] (float16 bits of elements 8k..8k+7 in h[k]), in order.
 * NaN's float16 bits are 0x7E00 and above: E4M3's shift leaves 0xFC..0xFF, which vpminub brings
 * to 0x7F; E5M2's leaves 0x7E or 0x7F (numbers end at 0x7B), which get the low bits set.
 */
TF_AVX2_INLINE __m256i fast_codes32(const __m128i h[4], tf_fp8_format f) {
  const int shift = f == TF_FP8_E4M3 ? 7 : 8;
  /* packus works per 128-bit lane: pairing h0 with h2 and h1 with h3 gives elements in order. */
  const __m256i h02 = _mm256_inserti128_si256(_mm256_castsi128_si256(h[0]), h[2], 1);
  const __m256i h13 = _mm256_inserti128_si256(_mm256_castsi128_si256(h[1]), h[3], 1);
  const __m256i codes = _mm256_packus_epi16(_mm256_srli_epi16(h02, shift), _mm256_srli_epi16(h13, shift));
  if (f == TF_FP8_E4M3) return _mm256_min_epu8(codes, _mm256_set1_epi8(0x7F));
  const __m256i nan = _mm256_cmpgt_epi8(codes, _mm256_set1_epi8(0x7B));
  return _mm256_or_si256(codes, _mm256_and_si256(nan, _mm256_set1_epi8(3)));
}

#endif /* TF_FP8_ENCODE_AVX2_H */
