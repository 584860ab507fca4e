/* The GEMM of the block-scaled recipes (MXFP8, Float8 block scaling, NVFP4) on the CPU: te_fuser's
 * FP8 GEMM (fp8_gemm.h) with one float32 scale per (row, K block) of each operand:
 *
 *   total[i, j] = 0;  for kb = 0, 1, ..., ceil(k / block) - 1 in order:
 *     total[i, j] += P_kb[i, j] * (a_scale[i, kb] * b_scale[j, kb])
 *   out[i, j] = round_out(total[i, j] + bias[j])
 *
 * P_kb is the sum over the block's k (the last block may be shorter: k - kb * block values) of the
 * exact products of the decoded FP8 values, by the FP8 GEMM's kernel of the tier (fp8_gemm.h: in k
 * order on the portable and AVX2 paths, by pairs of k on the bf16 ones), started from +0; P_kb is
 * what tf_fp8_gemm_nt gives for that block's columns of a and b with unit scales. Every product,
 * sum and the bias add round to float32 one at a time (no fused multiply-add); the output rounds
 * once. The bits do not depend on the tile split, so threads may share an output by tiles. */
#ifndef TF_BLOCK_SCALED_GEMM_H
#define TF_BLOCK_SCALED_GEMM_H

#include <stdint.h>

#include "fp8_gemm.h"

/* One operand: rows x k FP8 codes, row-major and contiguous, and its float32 scales, element
 * (r, kb) at scales[r * scale_row_stride + kb * scale_block_stride] (strides >= 0, in elements). */
typedef struct {
  const uint8_t *codes;
  tf_fp8_format format;
  const float *scales;
  int64_t scale_row_stride, scale_block_stride;
} tf_block_operand;

/* The number of K blocks: ceil(k / block); -1 if k < 0 or block < 1. */
int64_t tf_block_scaled_gemm_blocks(int64_t k, int64_t block);

/* Validates everything tf_block_scaled_gemm_nt checks, touching no pointer's data. block must lie
 * in [1, TF_GEMM_KC]. */
tf_status tf_block_scaled_gemm_check(int64_t m, int64_t n, int64_t k, int64_t block,
                                     const tf_block_operand *a, const tf_block_operand *b,
                                     int has_bias, tf_dtype bias_dtype, tf_dtype out_dtype, tf_isa isa);

/* Computes the output tiles [tile_begin, tile_end) of tf_fp8_gemm_tiles(m, n) with the given
 * path (isa <= tf_cpu_isa_detected()). bias (n elements of bias_dtype) may be NULL. Allocates
 * 0.5 MiB of scratch per call, plus (at most 16 MiB each) a's packed row of tiles and, on the bf16
 * paths, b's packed blocks and (AVX512-BF16's fused kernel) b's scales per tile, as tf_fp8_gemm_nt
 * does; TF_ERR_BAD_ARGUMENT if the 0.5 MiB cannot be had; without the others the tiles go block by
 * block through the FP8 GEMM's kernels, with the same bits. */
tf_status tf_block_scaled_gemm_nt(const tf_block_operand *a, const tf_block_operand *b, int64_t m,
                                  int64_t n, int64_t k, int64_t block, const void *bias,
                                  tf_dtype bias_dtype, void *out, tf_dtype out_dtype, tf_isa isa,
                                  int64_t tile_begin, int64_t tile_end);

#define TF_NVFP4_GEMM_BLOCK 16

/* NVFP4's GEMM: a and b hold E4M3 codes of E2M1 values (what tf_nvfp4_unpack_e4m3 writes), their scales
 * the values of the E4M3 block scales, blocks of 16 along k; alpha is the product of the two tensors'
 * global decode factors:
 *   total[i, j] = 0;  for kb in order: total[i, j] += P_kb[i, j] * (a_scale[i, kb] * b_scale[j, kb])
 *   out[i, j] = round_out(float32(total[i, j] * alpha) + bias[j])
 * where, for E4M3 scales, each term is exact (a block's E2M1 products sum to a multiple of 1/4 of at most
 * 576): only the additions into total and the epilogue round, whatever the tier; a scale that is not an
 * E4M3 value (NaN) takes the general order above. As Blackwell's NVFP4 MMA, which multiplies by the E4M3
 * scales inside and by alpha once at the end. TF_ERR_BAD_DTYPE unless both formats are E4M3; otherwise
 * as tf_block_scaled_gemm_nt with block 16. */
tf_status tf_nvfp4_gemm_nt(const tf_block_operand *a, const tf_block_operand *b, int64_t m, int64_t n, int64_t k,
                           float alpha, const void *bias, tf_dtype bias_dtype, void *out, tf_dtype out_dtype,
                           tf_isa isa, int64_t tile_begin, int64_t tile_end);

#endif /* TF_BLOCK_SCALED_GEMM_H */
