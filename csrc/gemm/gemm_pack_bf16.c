/* Packing of FP8 blocks into the bf16 pair layouts (gemm_kernels.h) for the AVX512-BF16 and AMX
 * paths, 32 codes a step: each code becomes its bf16 bits through the format's 256-entry table
 * (exact: FP8 values are bf16 values), held in eight registers and read with word permutes. */
#include "gemm_kernels.h"

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
    for (int64_t i = 0; i < kc_pad; i += 32) _mm512_storeu_si512((void *)(d + i), decode32(src + i, kc - i, &c));
  }
}

/* Transposes 16 rows of 16 dwords in place (4 x 4 blocks of 128-bit lanes, then the lanes). */
TF_TARGET_AVX512_BF16 static inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  /* u[4 g + j], lane l: column 4 l + j of rows 4 g .. 4 g + 3 */
  for (int g = 0; g < 4; ++g) {
    const __m512i *s = t + 4 * g;
    u[4 * g + 0] = _mm512_unpacklo_epi64(s[0], s[2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(s[0], s[2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(s[1], s[3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(s[1], s[3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
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
      transpose_16x16(r);
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512((void *)(group + (i / 2 + p) * 32), r[p]);
    }
  }
}
#endif
