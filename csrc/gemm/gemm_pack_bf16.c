/* Packing of FP8 blocks into the bf16 pair layouts (gemm_kernels.h) for the AVX512-BF16 and AMX
 * paths, 32 codes a step: each code becomes its bf16 bits through the format's 256-entry table
 * (exact: FP8 values are bf16 values), held in eight registers and read with word permutes. */
#include "gemm_kernels.h"

#include "../common/tf_transpose16.h"

#if TF_X86
#include <immintrin.h>
#include <string.h>

/* The table as eight registers of 32 words: t[j] holds codes 32 j .. 32 j + 31. */
typedef struct {
  __m512i t[8];
} code_table;

TF_TARGET_AVX512_BF16 static inline code_table load_table(const uint16_t codes[256]) {
  code_table c;
  for (int j = 0; j < 8; ++j) c.t[j] = _mm512_loadu_si512((const void *)(codes + 32 * j));
  return c;
}

/* The bf16 bits of the first n (at most 32; none when n <= 0) codes at src, zeros past them
 * (code 0 is +0 in both formats): a permute per 64-code quarter, then bits 6 and 7 pick one. */
TF_TARGET_AVX512_BF16 static inline __m512i decode32(const uint8_t *src, int64_t n, const code_table *c) {
  if (n <= 0) return _mm512_setzero_si512();
  const __mmask32 valid = n >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << n) - 1);
  const __m512i idx = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(valid, src));
  const __m512i q0 = _mm512_permutex2var_epi16(c->t[0], idx, c->t[1]);
  const __m512i q1 = _mm512_permutex2var_epi16(c->t[2], idx, c->t[3]);
  const __m512i q2 = _mm512_permutex2var_epi16(c->t[4], idx, c->t[5]);
  const __m512i q3 = _mm512_permutex2var_epi16(c->t[6], idx, c->t[7]);
  const __mmask32 bit6 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(0x40));
  const __mmask32 bit7 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(0x80));
  return _mm512_mask_blend_epi16(bit7, _mm512_mask_blend_epi16(bit6, q0, q1),
                                 _mm512_mask_blend_epi16(bit6, q2, q3));
}

TF_TARGET_AVX512_BF16 void tf_gemm_pack_a_bf16(const uint8_t *x, int64_t ld, int64_t r0,
                                               int64_t valid, int64_t rows, int64_t k0, int64_t kc,
                                               int64_t kc_pad, const uint16_t codes[256],
                                               uint16_t *dst) {
  const code_table c = load_table(codes);
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t *d = dst + r * kc_pad;
    if (r >= valid) {
      memset(d, 0, sizeof(uint16_t) * (size_t)kc_pad);
      continue;
    }
    const uint8_t *src = x + (r0 + r) * ld + k0;
    for (int64_t i = 0; i < kc_pad; i += 32) {
      const __mmask32 keep = kc_pad - i >= 32 ? ~(__mmask32)0 : 0xFFFFu; /* kc_pad - i is 32 or 16 */
      _mm512_mask_storeu_epi16((void *)(d + i), keep, decode32(src + i, kc - i, &c));
    }
  }
}

TF_TARGET_AVX512_BF16 void tf_gemm_pack_b_bf16(const uint8_t *x, int64_t ld, int64_t r0,
                                               int64_t valid, int64_t cols, int64_t k0, int64_t kc,
                                               int64_t kc_pad, const uint16_t codes[256],
                                               uint16_t *dst) {
  const code_table c = load_table(codes);
  for (int64_t g = 0; g < cols; g += 16) {
    uint16_t *group = dst + g * kc_pad;
    for (int64_t i = 0; i < kc_pad; i += 32) {
      /* column j's 16 pairs as a row of dwords; transposed, row p is pair p of the 16 columns */
      __m512i r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = g + j < valid ? decode32(x + (r0 + g + j) * ld + k0 + i, kc - i, &c) : _mm512_setzero_si512();
      tf_transpose16_epi32(r);
      const int pairs = kc_pad - i >= 32 ? 16 : 8;
      for (int p = 0; p < pairs; ++p) _mm512_storeu_si512((void *)(group + (i / 2 + p) * 32), r[p]);
    }
  }
}

/* The 32 bf16 values of v times their multipliers, lanes 2i and 2i + 1 by lane i of `scale`: exact when
 * every product is a bf16 value (the caller's range check), so its float32 bits end in 16 zeros. */
TF_TARGET_AVX512_BF16 static inline __m512i times(__m512i v, __m512 scale) {
  const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
  const __m512 even = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), scale);
  const __m512 odd = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(v, high)), scale);
  return _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(odd), high),
                         _mm512_srli_epi32(_mm512_castps_si512(even), 16));
}

TF_TARGET_AVX512_BF16 void tf_gemm_fold_a_bf16(uint16_t *a, int64_t rows, int64_t kc_pad, const float *scale) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 s = _mm512_set1_ps(scale[r]);
    uint16_t *row = a + r * kc_pad;
    for (int64_t i = 0; i < kc_pad; i += 32) {
      const __mmask32 keep = kc_pad - i >= 32 ? ~(__mmask32)0 : 0xFFFFu; /* kc_pad - i is 32 or 16 */
      _mm512_mask_storeu_epi16((void *)(row + i), keep, times(_mm512_maskz_loadu_epi16(keep, (const void *)(row + i)), s));
    }
  }
}

TF_TARGET_AVX512_BF16 void tf_gemm_fold_b_bf16(uint16_t *b, int64_t cols, int64_t kc_pad, const float *scale) {
  for (int64_t g = 0; g < cols; g += 16) {
    const __m512 s = _mm512_loadu_ps(scale + g); /* a row of the group holds one pair of each of its 16 columns */
    uint16_t *group = b + g * kc_pad;
    for (int64_t i = 0; i < 16 * kc_pad; i += 32)
      _mm512_storeu_si512((void *)(group + i), times(_mm512_loadu_si512((const void *)(group + i)), s));
  }
}
#endif
