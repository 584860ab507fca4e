/*
 * The AVX-512 (F + BW + VL) FP8 encoders shared by the per-tensor quantizer (fp8_quantize_avx512.c)
 * and MXFP8's (mxfp8_quantize_avx512.c), 16 float32 lanes at a time; fp8_quantize_avx2.c's comments
 * explain them at half the width.
 *   - The fast encoder takes |x| times the fast multiplier (tf_fp8_fast_multiplier; valid where
 *     tf_fp8_fast_scale holds) and rounds it to the FP8 grid as float16, whose bits shifted right
 *     are the code.
 *   - The generic encoder takes x times any scale and builds the code from the float32 bits.
 * Include only where TF_X86 holds.
 */
#ifndef TF_FP8_ENCODE_AVX512_H
#define TF_FP8_ENCODE_AVX512_H

#include <immintrin.h>

#include "../common/cpu_features.h"
#include "../common/tf_dtype.h"
#include "fp8_format.h"

#define TF_AVX512_INLINE static inline __attribute__((always_inline)) TF_TARGET_AVX512

/* 16 values |v| (for E4M3 scaled by 2^-8) rounded to the FP8 grid, as float16 bits. */
TF_AVX512_INLINE __m256i fast_round16(__m512 a, tf_fp8_format f) {
  const float max_value = f == TF_FP8_E4M3 ? TF_FP8_E4M3_MAX * 0x1p-8f : TF_FP8_E5M2_MAX;
  const int mbits = f == TF_FP8_E4M3 ? 3 : 2;
  const __m512 c = _mm512_min_ps(_mm512_set1_ps(max_value), a); /* NaN stays NaN */
  __m512i e = _mm512_and_si512(_mm512_castps_si512(c), _mm512_set1_epi32(0x7F800000));
  e = _mm512_max_epi32(e, _mm512_set1_epi32((127 - 14) << 23));
  const __m512 magic = _mm512_castsi512_ps(_mm512_add_epi32(e, _mm512_set1_epi32((23 - mbits) << 23)));
  const __m512 rounded = _mm512_sub_ps(_mm512_add_ps(c, magic), magic);
  return _mm512_cvtps_ph(rounded, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/*
 * The 32 codes without sign of bfloat16 elements whose |x| patterns are in a: even elements
 * (a << 16) and odd ones (a with the low halves cleared) are rounded apart, and word j of the
 * result takes element 2j's code from he into its low byte and element 2j+1's from ho into its
 * high byte. s_even and s_odd are the fast multipliers of the even and the odd elements.
 */
TF_AVX512_INLINE __m256i bf16_codes32(__m512i a, __m512 s_even, __m512 s_odd, tf_fp8_format f) {
  const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
  const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(a, _mm512_set1_epi32((int)0xFFFF0000u)));
  const __m256i he = fast_round16(_mm512_mul_ps(even, s_even), f);
  const __m256i ho = fast_round16(_mm512_mul_ps(odd, s_odd), f);
  const __m256i lo = f == TF_FP8_E4M3 ? _mm256_srli_epi16(he, 7) : _mm256_srli_epi16(he, 8);
  const __m256i hi = f == TF_FP8_E4M3 ? _mm256_slli_epi16(ho, 1) : ho;
  return _mm256_ternarylogic_epi32(lo, hi, _mm256_set1_epi16((short)0xFF00), 0xD8); /* C ? B : A */
}

/* magnitude8 of fp8_quantize_avx2.c on 16 lanes: the codes without sign, less 2^mbits. */
TF_AVX512_INLINE __m512i magnitude16(__m512 v, uint32_t mbits, uint32_t bias, float max_value) {
  const uint32_t shift = 23u - mbits;
  const __m512 abs = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF)));
  const __m512i c = _mm512_castps_si512(_mm512_min_ps(_mm512_set1_ps(max_value), abs));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(c, shift), _mm512_set1_epi32(1));
  const uint32_t round_rebias = ((1u << (shift - 1u)) - 1u) - ((128u - bias) << 23);
  const __m512i t = _mm512_add_epi32(_mm512_add_epi32(c, _mm512_set1_epi32((int)round_rebias)), odd);
  const __m512i normal = _mm512_srai_epi32(t, shift);
  const uint32_t magic_bits = (127u + 24u - bias - mbits) << 23;
  const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(c), _mm512_castsi512_ps(_mm512_set1_epi32((int)magic_bits)));
  const __m512i sub =
      _mm512_sub_epi32(_mm512_castps_si512(sum), _mm512_set1_epi32((int)(magic_bits + (1u << mbits))));
  return _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(t, _mm512_setzero_si512()), normal, sub);
}

/* The 16 codes of v = x * scale: NaN's offset magnitudes are above 0x7F, which the min keeps. */
TF_AVX512_INLINE __m128i generic_codes16(__m512 v, tf_fp8_format f) {
  const uint32_t mbits = f == TF_FP8_E4M3 ? 3u : 2u;
  const __m512i mag = f == TF_FP8_E4M3 ? magnitude16(v, 3u, 7u, TF_FP8_E4M3_MAX)
                                       : magnitude16(v, 2u, 15u, TF_FP8_E5M2_MAX);
  const __m512i code = _mm512_min_epu32(_mm512_add_epi32(mag, _mm512_set1_epi32(1 << mbits)), _mm512_set1_epi32(0x7F));
  const __m512i sign = _mm512_srli_epi32(_mm512_castps_si512(v), 24);
  return _mm512_cvtepi32_epi8(_mm512_ternarylogic_epi32(code, sign, _mm512_set1_epi32(0x80), 0xF8)); /* A | B & C */
}

/* 16 elements from x + i as float32. */
TF_AVX512_INLINE __m512 load16(const void *x, int64_t i, tf_dtype d) {
  if (d == TF_FLOAT32) return _mm512_loadu_ps((const float *)x + i);
  const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
  return d == TF_BFLOAT16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}

/* Lanes [0, n) of the elements at x + i as float32, the others 0 (n <= 0: none is read). */
TF_AVX512_INLINE __m512 load_upto16(const void *x, int64_t i, int64_t n, tf_dtype d) {
  if (n >= 16) return load16(x, i, d);
  if (n <= 0) return _mm512_setzero_ps();
  const __mmask16 m = (__mmask16)((1u << n) - 1u);
  if (d == TF_FLOAT32) return _mm512_maskz_loadu_ps(m, (const float *)x + i);
  const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)x + i);
  return d == TF_BFLOAT16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}

#endif /* TF_FP8_ENCODE_AVX512_H */
