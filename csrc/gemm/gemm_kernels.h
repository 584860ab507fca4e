/* The per-path inner kernels of the FP8 GEMM (internal to csrc/gemm).
 *
 * A tile of the output is TF_GEMM_MB x TF_GEMM_NB, accumulated in float32 in `acc` (row stride
 * TF_GEMM_NB) over k blocks of at most TF_GEMM_KC. Each path packs a block of a and b in its own
 * layout, from FP8 codes decoded exactly (fp8_format.h):
 *
 * float32 paths (portable, AVX2): a as panels of TF_GEMM_MR rows, [MR][kc] floats (row-major, so
 *   packing a is a plain decode); b as panels of TF_GEMM_NR columns, [kc][NR] floats.
 * bf16 pair paths (AVX512-BF16, AMX): kc rounded up to kc_pad (a multiple of 32) with zeros;
 *   a as groups of 16 rows, [16][kc_pad] bf16 (row-major, what an AMX A tile loads);
 *   b as groups of 16 columns, [kc_pad / 2][16][2] bf16 (the VNNI layout of an AMX B tile). */
#ifndef TF_GEMM_KERNELS_H
#define TF_GEMM_KERNELS_H

#include <stdint.h>

#include "fp8_gemm.h"

#define TF_GEMM_MR 6
#define TF_GEMM_NR 16

/* acc[MB x NB] += a_pack . b_pack^T over kc (float32 layouts). */
void tf_gemm_block_f32_portable(int64_t kc, const float *a_pack, const float *b_pack, float *acc);
#if TF_X86
void tf_gemm_block_f32_avx2(int64_t kc, const float *a_pack, const float *b_pack, float *acc);
/* The same over kc_pad (bf16 pair layouts). */
void tf_gemm_block_bf16_avx512(int64_t kc_pad, const uint16_t *a_pack, const uint16_t *b_pack,
                               float *acc);
void tf_gemm_block_bf16_amx(int64_t kc_pad, const uint16_t *a_pack, const uint16_t *b_pack,
                            float *acc);
#endif

#endif /* TF_GEMM_KERNELS_H */
