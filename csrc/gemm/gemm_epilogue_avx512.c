/* The FP8 GEMM's epilogue in 16-float vectors, for float32 and bf16 outputs: the same bits as the
 * scalar epilogue in fp8_gemm.c (one multiply, one add, then tf_f32_to_bf16's rounding written
 * in integer lanes, since vcvtneps2bf16 flushes subnormal inputs to zero). */
#include "gemm_kernels.h"

#if TF_X86
#include <immintrin.h>

/* 16 bias values (n of them, the rest 0) as float32; bf16 and float16 widen exactly. */
TF_TARGET_AVX512 static inline __m512 load_bias(const void *bias, tf_dtype d, int64_t j, __mmask16 m) {
  if (d == TF_FLOAT32) return _mm512_maskz_loadu_ps(m, (const float *)bias + j);
  const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)bias + j);
  if (d == TF_BFLOAT16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

/* tf_f32_to_bf16 per lane: round to nearest even, NaN kept quiet with its sign and high payload. */
TF_TARGET_AVX512 static inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

TF_TARGET_AVX512 void tf_gemm_epilogue_avx512(const float *acc, int64_t rows, int64_t cols, float scale,
                                              const void *bias, tf_dtype bias_dtype, void *out,
                                              tf_dtype out_dtype, int64_t ldo, int64_t row0, int64_t col0) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < cols; j += 16) {
    const __mmask16 m = cols - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cols - j)) - 1);
    const __m512 b = bias ? load_bias(bias, bias_dtype, col0 + j, m) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; ++i) {
      __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, acc + i * TF_GEMM_NB + j), s);
      if (bias) v = _mm512_add_ps(v, b);
      const int64_t o = (row0 + i) * ldo + col0 + j;
      if (out_dtype == TF_FLOAT32)
        _mm512_mask_storeu_ps((float *)out + o, m, v);
      else
        _mm256_mask_storeu_epi16((uint16_t *)out + o, m, to_bf16(v));
    }
  }
}
#endif
