/* The block-scaled GEMM's fused AVX2 kernel (gemm_kernels.h), for the AVX2 and AVX-512 tiers: each K
 * block summed in registers by FMAs in k order exactly as tf_gemm_block_f32_avx2 sums it into a zeroed
 * partial tile, then scaled into the tile's float32 total as the per-block path's combine does. The
 * total of a 6 x 16 register block stays in L1 (16 ymm registers hold the 12 sums, not the totals too),
 * but no partial tile is zeroed, stored and read back per K block. */
#include "gemm_kernels.h"

#if TF_X86
#include <immintrin.h>

TF_TARGET_AVX2 void tf_block_gemm_tile_f32_avx2(const tf_block_tile_f32 *t, float *total, int64_t rows,
                                                int64_t cols) {
  const int64_t row_blocks = tf_gemm_blocks(rows, TF_GEMM_MR), col_blocks = tf_gemm_blocks(cols, TF_GEMM_NR);
  for (int64_t r = 0; r < row_blocks * TF_GEMM_MR; ++r)
    for (int64_t j = 0; j < col_blocks * TF_GEMM_NR; j += 8) _mm256_storeu_ps(total + r * TF_GEMM_NB + j, _mm256_setzero_ps());
  /* K blocks outermost, as the per-block path: a block's b panel stays in L1 while the a panels stream */
  for (int64_t kb = 0; kb < t->blocks; ++kb) {
    const int64_t kc = t->k - kb * t->block < t->block ? t->k - kb * t->block : t->block;
    for (int64_t jp = 0; jp < col_blocks; ++jp) {
      const float *bp = t->b + kb * t->b_block_elems + jp * TF_GEMM_NR * kc;
      __m256 sb0 = _mm256_setzero_ps(), sb1 = _mm256_setzero_ps(); /* folded: b's scales are not gathered */
      if (!t->folded) {
        sb0 = _mm256_loadu_ps(t->sb + kb * TF_GEMM_NB + jp * TF_GEMM_NR);
        sb1 = _mm256_loadu_ps(t->sb + kb * TF_GEMM_NB + jp * TF_GEMM_NR + 8);
      }
      for (int64_t ip = 0; ip < row_blocks; ++ip) {
        const float *ap = t->a + kb * t->a_block_elems + ip * TF_GEMM_MR * kc;
        float *c = total + ip * TF_GEMM_MR * TF_GEMM_NB + jp * TF_GEMM_NR;
        __m256 s[TF_GEMM_MR][2];
        for (int i = 0; i < TF_GEMM_MR; ++i) s[i][0] = s[i][1] = _mm256_setzero_ps();
        for (int64_t p = 0; p < kc; ++p) {
          const __m256 b0 = _mm256_loadu_ps(bp + p * TF_GEMM_NR);
          const __m256 b1 = _mm256_loadu_ps(bp + p * TF_GEMM_NR + 8);
          for (int i = 0; i < TF_GEMM_MR; ++i) {
            const __m256 x = _mm256_broadcast_ss(ap + i * kc + p);
            s[i][0] = _mm256_fmadd_ps(x, b0, s[i][0]);
            s[i][1] = _mm256_fmadd_ps(x, b1, s[i][1]);
          }
        }
        for (int i = 0; i < TF_GEMM_MR; ++i) {
          float *ci = c + i * TF_GEMM_NB;
          __m256 add0 = s[i][0], add1 = s[i][1];
          if (!t->folded) {
            /* rows past `rows` (a's zero padding) are never stored to the output: no scale read */
            const int64_t r = ip * TF_GEMM_MR + i;
            const __m256 sa = _mm256_set1_ps(r < rows ? t->sa[r * t->sa_row_stride + kb * t->sa_block_stride] : 0.0f);
            add0 = _mm256_mul_ps(add0, _mm256_mul_ps(sa, sb0));
            add1 = _mm256_mul_ps(add1, _mm256_mul_ps(sa, sb1));
          }
          _mm256_storeu_ps(ci, _mm256_add_ps(_mm256_loadu_ps(ci), add0));
          _mm256_storeu_ps(ci + 8, _mm256_add_ps(_mm256_loadu_ps(ci + 8), add1));
        }
      }
    }
  }
}

/* Packed float32 values times their row's (a) or column's (b) scale, in place; exact under the caller's
 * range check (every product a float32 value). */
TF_TARGET_AVX2 void tf_gemm_fold_a_f32(float *a, int64_t rows, int64_t kc, const float *scale) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 s = _mm256_set1_ps(scale[r]);
    float *row = a + r * kc; /* panels of TF_GEMM_MR rows of [MR][kc]: rows follow each other */
    int64_t p = 0;
    for (; p + 8 <= kc; p += 8) _mm256_storeu_ps(row + p, _mm256_mul_ps(_mm256_loadu_ps(row + p), s));
    for (; p < kc; ++p) row[p] *= scale[r];
  }
}

TF_TARGET_AVX2 void tf_gemm_fold_b_f32(float *b, int64_t cols, int64_t kc, const float *scale) {
  for (int64_t jp = 0; jp < cols / TF_GEMM_NR; ++jp) {
    const __m256 s0 = _mm256_loadu_ps(scale + jp * TF_GEMM_NR), s1 = _mm256_loadu_ps(scale + jp * TF_GEMM_NR + 8);
    float *panel = b + jp * TF_GEMM_NR * kc; /* [kc][NR] */
    for (int64_t p = 0; p < kc; ++p) {
      _mm256_storeu_ps(panel + p * TF_GEMM_NR, _mm256_mul_ps(_mm256_loadu_ps(panel + p * TF_GEMM_NR), s0));
      _mm256_storeu_ps(panel + p * TF_GEMM_NR + 8, _mm256_mul_ps(_mm256_loadu_ps(panel + p * TF_GEMM_NR + 8), s1));
    }
  }
}
#endif
