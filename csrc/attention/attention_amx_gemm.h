/*
 * The two tile products of the AMX attention kernels, on 16 rows at a time
 * (tile numbers as in attention_amx.h: 0..3 accumulators, 4 A, 5 and 6 B).
 */
#ifndef TF_ATTENTION_AMX_GEMM_H
#define TF_ATTENTION_AMX_GEMM_H

#include "attention_amx_tile.h"
#include "attention_tile.h"

/*
 * c[16 x 16 blocks] (floats, ldc apart) = a b^T for a (16 rows of bf16, lda
 * apart, width a multiple of 32) and b^T given as pairs over the width:
 * [width / 2][cols][2] (tf_amx_pack_transposed). blocks (1..4) column blocks
 * of 16 are computed.
 */
TF_ATTN_INLINE void tf_amx_times_transposed(float *c, int64_t ldc, const uint16_t *a, int64_t lda,
                                            const uint16_t *bt, int64_t cols, int64_t width,
                                            int64_t blocks) {
  AMX_ZERO(0);
  if (blocks > 1) AMX_ZERO(1);
  if (blocks > 2) AMX_ZERO(2);
  if (blocks > 3) AMX_ZERO(3);
  const int64_t ldb = cols * 2 * (int64_t)sizeof(uint16_t);
  for (int64_t d = 0; d < width; d += TF_ATTN_AMX_K) {
    const uint16_t *b = bt + d / 2 * cols * 2;
    AMX_LOAD(4, a + d, lda * (int64_t)sizeof(uint16_t));
    AMX_LOAD(5, b, ldb);
    AMX_DP(0, 4, 5);
    if (blocks > 1) {
      AMX_LOAD(6, b + 32, ldb);
      AMX_DP(1, 4, 6);
    }
    if (blocks > 2) {
      AMX_LOAD(5, b + 64, ldb);
      AMX_DP(2, 4, 5);
    }
    if (blocks > 3) {
      AMX_LOAD(6, b + 96, ldb);
      AMX_DP(3, 4, 6);
    }
  }
  const int64_t ld = ldc * (int64_t)sizeof(float);
  AMX_STORE(0, c, ld);
  if (blocks > 1) AMX_STORE(1, c + 16, ld);
  if (blocks > 2) AMX_STORE(2, c + 32, ld);
  if (blocks > 3) AMX_STORE(3, c + 48, ld);
}

/*
 * c[16 x width] (floats, ldc apart; width a multiple of 16) += a b for a (16
 * rows of bf16, lda apart, `steps` x 32 columns) and b given as row pairs:
 * [steps x 16][width][2] (tf_amx_pack_pairs).
 */
TF_ATTN_INLINE void tf_amx_times_pairs(float *c, int64_t ldc, const uint16_t *a, int64_t lda,
                                       const uint16_t *b, int64_t width, int64_t steps) {
  const int64_t ld = ldc * (int64_t)sizeof(float), ldb = width * 2 * (int64_t)sizeof(uint16_t);
  for (int64_t n0 = 0; n0 < width; n0 += 64) {
    const int64_t cols = (width - n0) / 16 < 4 ? (width - n0) / 16 : 4;
    AMX_LOAD(0, c + n0, ld);
    if (cols > 1) AMX_LOAD(1, c + n0 + 16, ld);
    if (cols > 2) AMX_LOAD(2, c + n0 + 32, ld);
    if (cols > 3) AMX_LOAD(3, c + n0 + 48, ld);
    for (int64_t st = 0; st < steps; ++st) {
      const uint16_t *bs = b + st * 16 * width * 2 + n0 * 2;
      AMX_LOAD(4, a + st * TF_ATTN_AMX_K, lda * (int64_t)sizeof(uint16_t));
      AMX_LOAD(5, bs, ldb);
      AMX_DP(0, 4, 5);
      if (cols > 1) {
        AMX_LOAD(6, bs + 32, ldb);
        AMX_DP(1, 4, 6);
      }
      if (cols > 2) {
        AMX_LOAD(5, bs + 64, ldb);
        AMX_DP(2, 4, 5);
      }
      if (cols > 3) {
        AMX_LOAD(6, bs + 96, ldb);
        AMX_DP(3, 4, 6);
      }
    }
    AMX_STORE(0, c + n0, ld);
    if (cols > 1) AMX_STORE(1, c + n0 + 16, ld);
    if (cols > 2) AMX_STORE(2, c + n0 + 32, ld);
    if (cols > 3) AMX_STORE(3, c + n0 + 48, ld);
  }
}

#endif /* TF_ATTENTION_AMX_GEMM_H */
