/*
 * The bf16 product of the vector path's bf16 builds (attention_bf16.h), on
 * 16-float vectors: vdpbf16ps adds to each float32 lane the two products of a
 * pair of bf16 (one 32-bit word) of each operand. An operand whose pairs run
 * over the product's reduction is "pairs": element (r, c) of a pair row r
 * holds the reduction indices 2r and 2r + 1 of column c, as two adjacent
 * uint16_t.
 */
#ifndef TF_ATTENTION_BF16_TILE_H
#define TF_ATTENTION_BF16_TILE_H

#include <immintrin.h>

#include "../common/tf_transpose16.h"
#include "attention_amx_pack.h"
#include "attention_tile.h"

#if TF_ATTN_VW != 16
#error "the bf16 products need TF_ATTN_VW == 16"
#endif
/* Included under #pragma GCC target (attention_fwd_bf16.c), so every function of the file may inline these. */
#if !defined(__AVX512BF16__) || !defined(__AVX512BW__)
#error "include under a target with AVX512-BF16 and AVX512-BW"
#endif

/* The 16 pairs (32 uint16_t) at p. */
TF_ATTN_INLINE tf_vfu tf_bf16_load(const uint16_t *p) {
  tf_vfu v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* The pair at p as one word, to be broadcast against 16 pairs. */
TF_ATTN_INLINE uint32_t tf_bf16_pair(const uint16_t *p) {
  uint32_t w;
  memcpy(&w, p, sizeof w);
  return w;
}

/* acc + a0 b0 + a1 b1 per lane, for the pair a in every lane and the 16 pairs b. */
TF_ATTN_INLINE tf_vf tf_bf16_dot(tf_vf acc, uint32_t a, tf_vfu b) {
  return (tf_vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_set1_epi32((int)a), (__m512bh)b);
}

/* 16 pairs (lo[i], hi[i]), rounded to bf16 to nearest even (vcvtne2ps2bf16), stored at p. */
TF_ATTN_INLINE void tf_bf16_store_pairs(uint16_t *p, tf_vf lo, tf_vf hi) {
  /* The conversion puts lo in halfwords 0..15 and hi in 16..31; the permutation interleaves them. */
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i v = _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo));
  memcpy(p, &v, sizeof v);
}

/* The 32 floats lo, hi rounded to bf16 as above, stored in order at p. */
TF_ATTN_INLINE void tf_bf16_store_row(uint16_t *p, tf_vf lo, tf_vf hi) {
  const __m512bh v = _mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo);
  memcpy(p, &v, sizeof v);
}

/* dst[c * ldd + r] = src[r * lds + c] for r, c < 16 (floats). */
TF_ATTN_INLINE void tf_f32_transpose16(const float *src, int64_t lds, float *dst, int64_t ldd) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * lds);
  tf_transpose16_epi32(r);
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * ldd, r[i]);
}

/*
 * Rows [0, n) of 16 bf16 (src[r * lds + c]) as pairs over 32 rows: dst[c *
 * ldd + r] = src[r * lds + c] for r < 32, c < 16, zero for r >= n. Each pair
 * of rows, interleaved, is a row of 16 words: a word transpose.
 */
TF_ATTN_INLINE void tf_bf16_transpose_pairs(const uint16_t *src, int64_t lds, int64_t n,
                                            uint16_t *dst, int64_t ldd) {
  /* Halfwords 0..15 of a and 0..15 of b (32 + i), alternating. */
  const __m512i order = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                         39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  __m512i r[16];
  for (int i = 0; i < 16; ++i) {
    const __m256i zero = _mm256_setzero_si256();
    const __m256i a = 2 * i < n ? _mm256_loadu_si256((const void *)(src + 2 * i * lds)) : zero;
    const __m256i b = 2 * i + 1 < n ? _mm256_loadu_si256((const void *)(src + (2 * i + 1) * lds)) : zero;
    r[i] = _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), order, _mm512_castsi256_si512(b));
  }
  tf_transpose16_epi32(r);
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * ldd, r[i]);
}

/* Mask of the elements [d0, d0 + 32) of a row of D that lie before D. */
TF_ATTN_INLINE __mmask32 tf_bf16_row_mask(int64_t D, int64_t d0) {
  const int64_t n = D - d0 < 32 ? D - d0 : 32;
  return n <= 0 ? 0 : (__mmask32)(0xFFFFFFFFu >> (32 - n));
}

/*
 * tf_amx_pack_transposed (rows j in [0, n) from offset first, x^T as pairs over
 * the row's elements, zero past n and D), with a bf16 operand's pairs (words)
 * transposed as 16 x 16 blocks in registers; an E4M3 operand goes to the
 * packer, which decodes it. cols and dp are multiples of 16.
 */
TF_ATTN_INLINE void tf_bf16_pack_transposed(const tf_attn_operand *op, int64_t first, int64_t stride, int64_t n,
                                            int64_t cols, int64_t D, int64_t dp, uint16_t *dst) {
  if (op->elem != TF_ATTN_BF16) {
    tf_amx_pack_transposed(op, first, stride, n, cols, D, dp, dst);
    return;
  }
  const uint16_t *src = (const uint16_t *)op->data + first;
  for (int64_t j0 = 0; j0 < cols; j0 += 16)
    for (int64_t d0 = 0; d0 < dp; d0 += 32) {
      const __mmask32 in_d = tf_bf16_row_mask(D, d0);
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = j0 + i < n ? _mm512_maskz_loadu_epi16(in_d, src + (j0 + i) * stride + d0)
                          : _mm512_setzero_si512();
      tf_transpose16_epi32(r);
      for (int64_t c = 0; c < 16 && d0 / 2 + c < dp / 2; ++c)
        _mm512_storeu_si512(dst + 2 * ((d0 / 2 + c) * cols + j0), r[c]);
    }
}

/*
 * tf_amx_pack_pairs (rows j in [0, n) from offset first as pairs over the rows,
 * zero past n and D), with two bf16 rows interleaved in registers; an E4M3
 * operand goes to the packer. rows is even, dp a multiple of 16.
 */
TF_ATTN_INLINE void tf_bf16_pack_pairs(const tf_attn_operand *op, int64_t first, int64_t stride, int64_t n,
                                       int64_t rows, int64_t D, int64_t dp, uint16_t *dst) {
  if (op->elem != TF_ATTN_BF16) {
    tf_amx_pack_pairs(op, first, stride, n, rows, D, dp, dst);
    return;
  }
  const uint16_t *src = (const uint16_t *)op->data + first;
  /* Halfwords 0..15 (lo) or 16..31 (hi) of a and of b (32 + i), alternating. */
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < rows; j += 2)
    for (int64_t d0 = 0; d0 < dp; d0 += 32) {
      const __mmask32 in_d = tf_bf16_row_mask(D, d0);
      const __m512i a = j < n ? _mm512_maskz_loadu_epi16(in_d, src + j * stride + d0) : _mm512_setzero_si512();
      const __m512i b =
          j + 1 < n ? _mm512_maskz_loadu_epi16(in_d, src + (j + 1) * stride + d0) : _mm512_setzero_si512();
      uint16_t *out = dst + 2 * (j / 2 * dp + d0);
      _mm512_storeu_si512(out, _mm512_permutex2var_epi16(a, lo, b));
      if (d0 + 16 < dp) _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
}

/*
 * C[M x N] (row stride ldc) = (accumulate ? C : 0) + A B over K (even), where
 * A[r][kk] is A[r * lda + kk] (bf16, pairs of kk adjacent) and B is pairs
 * [K / 2][ldb][2]. M must be a multiple of TF_ATTN_GEMM_ROWS and N of 16; the
 * block of C in registers is that of tf_attn_gemm.
 */
#define TF_BF16_GEMM_BLOCK(COLS)                                                         \
  do {                                                                                   \
    tf_vf x[TF_ATTN_GEMM_ROWS][COLS];                                                    \
    TF_ATTN_UNROLL for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i)                           \
      TF_ATTN_UNROLL for (int c = 0; c < COLS; ++c)                                      \
        x[i][c] = accumulate ? tf_vf_load(C + (r + i) * ldc + n + 16 * c)                \
                             : tf_vf_splat(0.0f);                                        \
    for (int64_t kk = 0; kk < K; kk += 2) {                                              \
      tf_vfu b[COLS];                                                                    \
      TF_ATTN_UNROLL for (int c = 0; c < COLS; ++c)                                      \
        b[c] = tf_bf16_load(B + kk * ldb + 2 * (n + 16 * c));                            \
      TF_ATTN_UNROLL for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i) {                       \
        const uint32_t a = tf_bf16_pair(A + (r + i) * lda + kk);                         \
        TF_ATTN_UNROLL for (int c = 0; c < COLS; ++c) x[i][c] = tf_bf16_dot(x[i][c], a, b[c]); \
      }                                                                                  \
    }                                                                                    \
    TF_ATTN_UNROLL for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i)                           \
      TF_ATTN_UNROLL for (int c = 0; c < COLS; ++c)                                      \
        tf_vf_store(C + (r + i) * ldc + n + 16 * c, x[i][c]);                            \
  } while (0)

TF_ATTN_INLINE void tf_bf16_gemm(float *restrict C, int64_t ldc, const uint16_t *restrict A,
                                 int64_t lda, const uint16_t *restrict B, int64_t ldb, int64_t M,
                                 int64_t N, int64_t K, int accumulate) {
  for (int64_t r = 0; r < M; r += TF_ATTN_GEMM_ROWS) {
    int64_t n = 0;
    for (; n + 32 <= N; n += 32) TF_BF16_GEMM_BLOCK(2);
    if (n < N) TF_BF16_GEMM_BLOCK(1);
  }
}

#endif /* TF_ATTENTION_BF16_TILE_H */
