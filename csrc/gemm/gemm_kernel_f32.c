/* float32 inner kernels of the FP8 GEMM: plain C and AVX2+FMA, MR x NR register blocks.
 *
 * Both add one exact product at a time to each accumulator, in k order. A product of two bf16
 * values is exact in float32, so round(acc + a*b) (FMA) equals round(acc + round(a*b)) (C, which
 * -std=c11 does not contract): the two kernels give identical bits. */
#include "gemm_kernels.h"

#if TF_X86
#include <immintrin.h>
#endif

/* Halves of a panel (6 x 8 accumulators) so that baseline SSE2's 16 registers hold them. */
void tf_gemm_block_f32_portable(int64_t kc, const float *a_pack, const float *b_pack, float *acc,
                                int64_t rows, int64_t cols) {
  enum { HALF = TF_GEMM_NR / 2 };
  for (int64_t jp = 0; jp < tf_gemm_blocks(cols, TF_GEMM_NR); ++jp) {
    const float *bp = b_pack + jp * TF_GEMM_NR * kc;
    for (int64_t ip = 0; ip < tf_gemm_blocks(rows, TF_GEMM_MR); ++ip) {
      const float *ap = a_pack + ip * TF_GEMM_MR * kc;
      for (int h = 0; h < TF_GEMM_NR; h += HALF) {
        float *c = acc + ip * TF_GEMM_MR * TF_GEMM_NB + jp * TF_GEMM_NR + h;
        float r[TF_GEMM_MR][HALF];
        for (int i = 0; i < TF_GEMM_MR; ++i)
          for (int j = 0; j < HALF; ++j) r[i][j] = c[i * TF_GEMM_NB + j];
        for (int64_t p = 0; p < kc; ++p) {
          const float *bb = bp + p * TF_GEMM_NR + h;
          for (int i = 0; i < TF_GEMM_MR; ++i) {
            const float x = ap[i * kc + p];
            for (int j = 0; j < HALF; ++j) r[i][j] += x * bb[j];
          }
        }
        for (int i = 0; i < TF_GEMM_MR; ++i)
          for (int j = 0; j < HALF; ++j) c[i * TF_GEMM_NB + j] = r[i][j];
      }
    }
  }
}

#if TF_X86
/* 6 rows x 16 columns: 12 ymm accumulators, 2 loads of b and 6 broadcasts of a per k. */
TF_TARGET_AVX2 void tf_gemm_block_f32_avx2(int64_t kc, const float *a_pack, const float *b_pack,
                                           float *acc, int64_t rows, int64_t cols) {
  for (int64_t jp = 0; jp < tf_gemm_blocks(cols, TF_GEMM_NR); ++jp) {
    const float *bp = b_pack + jp * TF_GEMM_NR * kc; /* stays in L1 while the a panels stream */
    for (int64_t ip = 0; ip < tf_gemm_blocks(rows, TF_GEMM_MR); ++ip) {
      const float *ap = a_pack + ip * TF_GEMM_MR * kc;
      float *c = acc + ip * TF_GEMM_MR * TF_GEMM_NB + jp * TF_GEMM_NR;
      __m256 c00 = _mm256_loadu_ps(c + 0 * TF_GEMM_NB), c01 = _mm256_loadu_ps(c + 0 * TF_GEMM_NB + 8);
      __m256 c10 = _mm256_loadu_ps(c + 1 * TF_GEMM_NB), c11 = _mm256_loadu_ps(c + 1 * TF_GEMM_NB + 8);
      __m256 c20 = _mm256_loadu_ps(c + 2 * TF_GEMM_NB), c21 = _mm256_loadu_ps(c + 2 * TF_GEMM_NB + 8);
      __m256 c30 = _mm256_loadu_ps(c + 3 * TF_GEMM_NB), c31 = _mm256_loadu_ps(c + 3 * TF_GEMM_NB + 8);
      __m256 c40 = _mm256_loadu_ps(c + 4 * TF_GEMM_NB), c41 = _mm256_loadu_ps(c + 4 * TF_GEMM_NB + 8);
      __m256 c50 = _mm256_loadu_ps(c + 5 * TF_GEMM_NB), c51 = _mm256_loadu_ps(c + 5 * TF_GEMM_NB + 8);
      for (int64_t p = 0; p < kc; ++p) {
        const __m256 b0 = _mm256_loadu_ps(bp + p * TF_GEMM_NR);
        const __m256 b1 = _mm256_loadu_ps(bp + p * TF_GEMM_NR + 8);
        const float *a = ap + p;
        __m256 x = _mm256_broadcast_ss(a);
        c00 = _mm256_fmadd_ps(x, b0, c00), c01 = _mm256_fmadd_ps(x, b1, c01);
        x = _mm256_broadcast_ss(a + 1 * kc);
        c10 = _mm256_fmadd_ps(x, b0, c10), c11 = _mm256_fmadd_ps(x, b1, c11);
        x = _mm256_broadcast_ss(a + 2 * kc);
        c20 = _mm256_fmadd_ps(x, b0, c20), c21 = _mm256_fmadd_ps(x, b1, c21);
        x = _mm256_broadcast_ss(a + 3 * kc);
        c30 = _mm256_fmadd_ps(x, b0, c30), c31 = _mm256_fmadd_ps(x, b1, c31);
        x = _mm256_broadcast_ss(a + 4 * kc);
        c40 = _mm256_fmadd_ps(x, b0, c40), c41 = _mm256_fmadd_ps(x, b1, c41);
        x = _mm256_broadcast_ss(a + 5 * kc);
        c50 = _mm256_fmadd_ps(x, b0, c50), c51 = _mm256_fmadd_ps(x, b1, c51);
      }
      _mm256_storeu_ps(c + 0 * TF_GEMM_NB, c00), _mm256_storeu_ps(c + 0 * TF_GEMM_NB + 8, c01);
      _mm256_storeu_ps(c + 1 * TF_GEMM_NB, c10), _mm256_storeu_ps(c + 1 * TF_GEMM_NB + 8, c11);
      _mm256_storeu_ps(c + 2 * TF_GEMM_NB, c20), _mm256_storeu_ps(c + 2 * TF_GEMM_NB + 8, c21);
      _mm256_storeu_ps(c + 3 * TF_GEMM_NB, c30), _mm256_storeu_ps(c + 3 * TF_GEMM_NB + 8, c31);
      _mm256_storeu_ps(c + 4 * TF_GEMM_NB, c40), _mm256_storeu_ps(c + 4 * TF_GEMM_NB + 8, c41);
      _mm256_storeu_ps(c + 5 * TF_GEMM_NB, c50), _mm256_storeu_ps(c + 5 * TF_GEMM_NB + 8, c51);
    }
  }
}
#endif
