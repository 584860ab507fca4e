/* The block-scaled GEMM's fused AVX512-BF16 kernel (gemm_kernels.h): each K block summed in registers
 * by vdpbf16ps exactly as tf_gemm_block_bf16_avx512 sums it, then scaled into a float32 total that
 * stays in registers over all blocks, so no partial tile goes through memory. */
#include "gemm_kernels.h"

#if TF_X86
#include <immintrin.h>
#include <string.h>

enum { ROWS = 6 }; /* 12 block sums + 12 totals + 3 operands: 27 of the 32 zmm registers */
_Static_assert(TF_GEMM_MB % 96 == 0 && 96 % ROWS == 0, "a's packed rows cover whole register blocks");

TF_TARGET_AVX512_BF16 void tf_block_gemm_tile_bf16_avx512(const tf_block_tile *t, float *total, int64_t rows,
                                                          int64_t cols) {
  for (int64_t r0 = 0; r0 < tf_gemm_blocks(rows, ROWS) * ROWS; r0 += ROWS) {
    for (int64_t g = 0; g < tf_gemm_blocks(cols, 32) * 2; g += 2) {
      __m512 tot[ROWS][2];
      for (int i = 0; i < ROWS; ++i) tot[i][0] = tot[i][1] = _mm512_setzero_ps();
      for (int64_t kb = 0; kb < t->blocks; ++kb) {
        const int64_t kc = t->k - kb * t->block < t->block ? t->k - kb * t->block : t->block;
        const int64_t kc_pad = tf_block_kc_pad(kc), pairs = (kc + 1) / 2;
        const uint16_t *a = t->a + kb * t->a_block_elems + r0 * kc_pad;
        const uint16_t *b0 = t->b + kb * t->b_block_elems + g * 16 * kc_pad, *b1 = b0 + 16 * kc_pad;
        __m512 sum[ROWS][2];
        for (int i = 0; i < ROWS; ++i) sum[i][0] = sum[i][1] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; ++p) {
          const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)(b0 + p * 32));
          const __m512bh x1 = (__m512bh)_mm512_loadu_si512((const void *)(b1 + p * 32));
          for (int i = 0; i < ROWS; ++i) {
            int32_t pair;
            memcpy(&pair, a + i * kc_pad + 2 * p, sizeof(pair));
            const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
            sum[i][0] = _mm512_dpbf16_ps(sum[i][0], av, x0);
            sum[i][1] = _mm512_dpbf16_ps(sum[i][1], av, x1);
          }
        }
        if (t->folded) {
          for (int i = 0; i < ROWS; ++i) {
            tot[i][0] = _mm512_add_ps(tot[i][0], sum[i][0]);
            tot[i][1] = _mm512_add_ps(tot[i][1], sum[i][1]);
          }
          continue;
        }
        const __m512 sb0 = _mm512_loadu_ps(t->sb + kb * TF_GEMM_NB + g * 16);
        const __m512 sb1 = _mm512_loadu_ps(t->sb + kb * TF_GEMM_NB + g * 16 + 16);
        for (int i = 0; i < ROWS; ++i) {
          /* rows past `rows` (a's zero padding) are never stored to the output: no scale read */
          const float s = r0 + i < rows ? t->sa[(r0 + i) * t->sa_row_stride + kb * t->sa_block_stride] : 0.0f;
          const __m512 sv = _mm512_set1_ps(s);
          tot[i][0] = _mm512_add_ps(tot[i][0], _mm512_mul_ps(sum[i][0], _mm512_mul_ps(sv, sb0)));
          tot[i][1] = _mm512_add_ps(tot[i][1], _mm512_mul_ps(sum[i][1], _mm512_mul_ps(sv, sb1)));
        }
      }
      for (int i = 0; i < ROWS; ++i) {
        _mm512_storeu_ps(total + (r0 + i) * TF_GEMM_NB + g * 16, tot[i][0]);
        _mm512_storeu_ps(total + (r0 + i) * TF_GEMM_NB + g * 16 + 16, tot[i][1]);
      }
    }
  }
}
#endif
