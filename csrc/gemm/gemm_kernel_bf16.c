/* bf16-pair inner kernels of the FP8 GEMM: AVX512-BF16 (vdpbf16ps) and AMX (tdpbf16ps).
 * Both add the products of k pairs (2p, 2p+1) to float32 accumulators in the hardware's order;
 * layouts in gemm_kernels.h. */
#include "gemm_kernels.h"

#if TF_X86
#include <immintrin.h>
#include <string.h>

/* 16 bf16 pairs of b (one VNNI row of a 16-column group) as a vector. */
TF_TARGET_AVX512_BF16 static inline __m512bh load_pairs(const uint16_t *p) {
  return (__m512bh)_mm512_loadu_si512((const void *)p);
}

/* The pair a[row][2p], a[row][2p+1] broadcast to all 16 lanes. */
TF_TARGET_AVX512_BF16 static inline __m512bh broadcast_pair(const uint16_t *p) {
  int32_t pair;
  memcpy(&pair, p, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(pair);
}

/* 8 rows x 32 columns (two 16-column groups): 16 zmm accumulators. */
TF_TARGET_AVX512_BF16 void tf_gemm_block_bf16_avx512(int64_t kc_pad, const uint16_t *a_pack,
                                                     const uint16_t *b_pack, float *acc,
                                                     int64_t rows, int64_t cols) {
  for (int64_t r0 = 0; r0 < tf_gemm_blocks(rows, 8) * 8; r0 += 8) {
    for (int64_t g = 0; g < tf_gemm_blocks(cols, 32) * 2; g += 2) {
      const uint16_t *b0 = b_pack + g * 16 * kc_pad, *b1 = b0 + 16 * kc_pad;
      float *c = acc + r0 * TF_GEMM_NB + g * 16;
      __m512 r[8][2];
      for (int i = 0; i < 8; ++i) {
        r[i][0] = _mm512_loadu_ps(c + i * TF_GEMM_NB);
        r[i][1] = _mm512_loadu_ps(c + i * TF_GEMM_NB + 16);
      }
      for (int64_t p = 0; p < kc_pad / 2; ++p) {
        const __m512bh x0 = load_pairs(b0 + p * 32), x1 = load_pairs(b1 + p * 32);
        for (int i = 0; i < 8; ++i) {
          const __m512bh a = broadcast_pair(a_pack + (r0 + i) * kc_pad + 2 * p);
          r[i][0] = _mm512_dpbf16_ps(r[i][0], a, x0);
          r[i][1] = _mm512_dpbf16_ps(r[i][1], a, x1);
        }
      }
      for (int i = 0; i < 8; ++i) {
        _mm512_storeu_ps(c + i * TF_GEMM_NB, r[i][0]);
        _mm512_storeu_ps(c + i * TF_GEMM_NB + 16, r[i][1]);
      }
    }
  }
}

/* The 64-byte tile configuration of palette 1. */
typedef struct {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

/* 32 x 32 blocks of the output: tiles 0-3 accumulate (16 x 16 float32 each), 4-5 hold two
 * 16 x 32 bf16 blocks of a, 6-7 two 16-pair x 16-column blocks of b. */
TF_TARGET_AMX void tf_gemm_block_bf16_amx(int64_t kc_pad, const uint16_t *a_pack,
                                          const uint16_t *b_pack, float *acc, int64_t rows,
                                          int64_t cols) {
  tile_config cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  const int64_t ldc = TF_GEMM_NB * (int64_t)sizeof(float), lda = kc_pad * (int64_t)sizeof(uint16_t);
  for (int64_t rg = 0; rg < tf_gemm_blocks(rows, 32) * 2; rg += 2) {
    for (int64_t cg = 0; cg < tf_gemm_blocks(cols, 32) * 2; cg += 2) {
      float *c = acc + rg * 16 * TF_GEMM_NB + cg * 16;
      _tile_loadd(0, c, ldc);
      _tile_loadd(1, c + 16, ldc);
      _tile_loadd(2, c + 16 * TF_GEMM_NB, ldc);
      _tile_loadd(3, c + 16 * TF_GEMM_NB + 16, ldc);
      const uint16_t *a0 = a_pack + rg * 16 * kc_pad, *a1 = a0 + 16 * kc_pad;
      const uint16_t *b0 = b_pack + cg * 16 * kc_pad, *b1 = b0 + 16 * kc_pad;
      for (int64_t kk = 0; kk < kc_pad; kk += 32) {
        _tile_loadd(4, a0 + kk, lda);
        _tile_loadd(5, a1 + kk, lda);
        _tile_loadd(6, b0 + kk * 16, 64);
        _tile_loadd(7, b1 + kk * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c, ldc);
      _tile_stored(1, c + 16, ldc);
      _tile_stored(2, c + 16 * TF_GEMM_NB, ldc);
      _tile_stored(3, c + 16 * TF_GEMM_NB + 16, ldc);
    }
  }
  _tile_release();
}
#endif
