/* The per-path inner kernels of the FP8 GEMM (internal to csrc/gemm).
 *
 * A tile of the output is TF_GEMM_MB x TF_GEMM_NB, accumulated in float32 in `acc` (row stride
 * TF_GEMM_NB) over k blocks of at most TF_GEMM_KC. Each path packs a block of a and b in its own
 * layout, from FP8 codes decoded exactly (fp8_format.h):
 *
 * float32 paths (portable, AVX2): a as panels of TF_GEMM_MR rows, [MR][kc] floats (row-major, so
 *   packing a is a plain decode); b as panels of TF_GEMM_NR columns, [kc][NR] floats.
 * bf16 pair paths (AVX512-BF16, AMX): kc rounded up to kc_pad (a multiple of 32; of 16 for the
 *   block-scaled GEMM's fused kernel, whose blocks may hold 16 values) with zeros;
 *   a as groups of 16 rows, [16][kc_pad] bf16 (row-major, what an AMX A tile loads);
 *   b as groups of 16 columns, [kc_pad / 2][16][2] bf16 (the VNNI layout of an AMX B tile). */
#ifndef TF_GEMM_KERNELS_H
#define TF_GEMM_KERNELS_H

#include <stdint.h>

#include "fp8_gemm.h"

#define TF_GEMM_MR 6
#define TF_GEMM_NR 16

/* Every path's register blocks tile a block exactly: rows in 6s (float32) and 32s (AMX),
 * columns in 16s and 32s, k in AMX's 32-deep tiles. */
_Static_assert(TF_GEMM_MB % 96 == 0, "TF_GEMM_MB must be a multiple of lcm(6, 32)");
_Static_assert(TF_GEMM_NB % 32 == 0, "TF_GEMM_NB must be a multiple of 32");
_Static_assert(TF_GEMM_KC % 32 == 0, "TF_GEMM_KC must be a multiple of 32");

/* Packs rows [r0, r0 + rows) of x (FP8 codes of format f, row stride ld; rows past `valid` as
 * zeros), k block [k0, k0 + kc), into a's float32 layout (pack_a) or b's (pack_b; rows a multiple of
 * TF_GEMM_NR), decoded exactly (gemm_pack_f32.c): every packer writes the same bits. */
void tf_gemm_pack_a_f32_portable(const uint8_t *x, int64_t ld, int64_t r0, int64_t valid, int64_t rows,
                                 int64_t k0, int64_t kc, tf_fp8_format f, float *dst);
void tf_gemm_pack_b_f32_portable(const uint8_t *x, int64_t ld, int64_t r0, int64_t valid, int64_t cols,
                                 int64_t k0, int64_t kc, tf_fp8_format f, float *dst);
#if TF_X86
void tf_gemm_pack_a_f32_avx2(const uint8_t *x, int64_t ld, int64_t r0, int64_t valid, int64_t rows,
                             int64_t k0, int64_t kc, tf_fp8_format f, float *dst);
void tf_gemm_pack_b_f32_avx2(const uint8_t *x, int64_t ld, int64_t r0, int64_t valid, int64_t cols,
                             int64_t k0, int64_t kc, tf_fp8_format f, float *dst);
#endif

/* acc[MB x NB] += a_pack . b_pack^T over kc (float32 layouts), for the register blocks that
 * cover the first `rows` rows and `cols` columns (the rest of the tile is left alone, so small
 * outputs cost what they hold; packed rows and columns past them within a block are zeros). */
void tf_gemm_block_f32_portable(int64_t kc, const float *a_pack, const float *b_pack, float *acc,
                                int64_t rows, int64_t cols);
/* The epilogue: out[row0 + i, col0 + j] = round_out(acc[i, j] * scale + bias[col0 + j]) for the
 * first rows x cols of an accumulator tile (row stride TF_GEMM_NB), each step in float32. */
void tf_gemm_epilogue_portable(const float *acc, int64_t rows, int64_t cols, float scale,
                               const void *bias, tf_dtype bias_dtype, void *out, tf_dtype out_dtype,
                               int64_t ldo, int64_t row0, int64_t col0);
#if TF_X86
void tf_gemm_block_f32_avx2(int64_t kc, const float *a_pack, const float *b_pack, float *acc,
                            int64_t rows, int64_t cols);
/* The same over kc_pad (bf16 pair layouts). */
void tf_gemm_block_bf16_avx512(int64_t kc_pad, const uint16_t *a_pack, const uint16_t *b_pack,
                               float *acc, int64_t rows, int64_t cols);
void tf_gemm_block_bf16_amx(int64_t kc_pad, const uint16_t *a_pack, const uint16_t *b_pack,
                            float *acc, int64_t rows, int64_t cols);
/* tf_gemm_epilogue_portable for float32 and bf16 outputs in AVX-512 vectors, bit for bit. */
void tf_gemm_epilogue_avx512(const float *acc, int64_t rows, int64_t cols, float scale,
                             const void *bias, tf_dtype bias_dtype, void *out, tf_dtype out_dtype,
                             int64_t ldo, int64_t row0, int64_t col0);
/* Packs rows [r0, r0 + rows) of x (FP8 codes, row stride ld; rows past `valid` as zeros), k block
 * [k0, k0 + kc) zero-padded to kc_pad (a multiple of 16), into a's layout (pack_a) or b's (pack_b;
 * rows a multiple of 16), through `codes`, the bf16 bits of each FP8 code. */
void tf_gemm_pack_a_bf16(const uint8_t *x, int64_t ld, int64_t r0, int64_t valid, int64_t rows,
                         int64_t k0, int64_t kc, int64_t kc_pad, const uint16_t codes[256],
                         uint16_t *dst);
void tf_gemm_pack_b_bf16(const uint8_t *x, int64_t ld, int64_t r0, int64_t valid, int64_t rows,
                         int64_t k0, int64_t kc, int64_t kc_pad, const uint16_t codes[256],
                         uint16_t *dst);
#endif

/* The block-scaled GEMM's (block_scaled_gemm.h) fused kernel on AVX512-BF16: one output tile, its
 * K blocks packed in the bf16 pair layouts above, block kb of min(block, k - kb * block) values in
 * kc_pad = tf_block_kc_pad(that). Per 6 x 32 register block of the first rows x cols of the tile:
 *   total = +0; for kb in order: P = +0 plus the block's pairs in order (vdpbf16ps, as
 *   tf_gemm_block_bf16_avx512 adds them; the zero pairs of the padding are skipped: adding +-0 to a
 *   sum of FP8 products changes no bit, as no such sum is -0 or subnormal); total += P * (sa * sb),
 *   or, folded (the packed values already multiplied by their scales where block_scaled_gemm.c
 *   shows that P then is that product), total += P
 * and stores total (row stride TF_GEMM_NB). */
typedef struct {
  int64_t blocks, block, k;
  const uint16_t *a; /* block kb at a + kb * a_block_elems: [rows][kc_pad] */
  int64_t a_block_elems;
  const uint16_t *b; /* block kb at b + kb * b_block_elems: [cols / 16][kc_pad / 2][16][2] */
  int64_t b_block_elems;
  const float *sa; /* a's scale of the tile's row i, block kb: sa[i * sa_row_stride + kb * sa_block_stride] */
  int64_t sa_row_stride, sa_block_stride;
  const float *sb; /* [blocks][TF_GEMM_NB]: b's scales of the tile's columns (0 past cols) */
  int folded;      /* 1: sa and sb are not read */
} tf_block_tile;

/* The same sums on the float32 layouts (block kb of a at a + kb * a_block_elems: MR-row panels of
 * [MR][kc]; of b at b + kb * b_block_elems: NR-column panels of [kc][NR]; kc = min(block, k - kb * block),
 * unpadded), FMAs in k order as tf_gemm_block_f32_avx2 adds them, and per 6 x 16 register block:
 * total += P * (sa * sb), or folded total += P (block_scaled_gemm_f32.c). */
typedef struct {
  int64_t blocks, block, k;
  const float *a;
  int64_t a_block_elems;
  const float *b;
  int64_t b_block_elems;
  const float *sa;
  int64_t sa_row_stride, sa_block_stride;
  const float *sb; /* [blocks][TF_GEMM_NB], 0 past cols */
  int folded;
} tf_block_tile_f32;

#if TF_X86
void tf_block_gemm_tile_bf16_avx512(const tf_block_tile *t, float *total, int64_t rows, int64_t cols);
void tf_block_gemm_tile_f32_avx2(const tf_block_tile_f32 *t, float *total, int64_t rows, int64_t cols);

/* Multiply packed bf16 values in place: row r of a's layout (pack_a) by scale[r] for r < rows, or
 * column j of b's layout (pack_b; cols a multiple of 16) by scale[j] for j < cols, in float32 and
 * kept as bf16 by truncation: every product must be a bf16 value (the caller's range check), so
 * each result is exact. */
void tf_gemm_fold_a_bf16(uint16_t *a, int64_t rows, int64_t kc_pad, const float *scale);
void tf_gemm_fold_b_bf16(uint16_t *b, int64_t cols, int64_t kc_pad, const float *scale);
/* The same on the float32 layouts (row r of a at a + r * kc; b's cols a multiple of 16), exact under
 * the same check. */
void tf_gemm_fold_a_f32(float *a, int64_t rows, int64_t kc, const float *scale);
void tf_gemm_fold_b_f32(float *b, int64_t cols, int64_t kc, const float *scale);
#endif

/* The packed length of a K block of kc values on the fused kernel: a multiple of 16, not 32, so that
 * NVFP4's 16-value blocks carry no padding through memory. */
static inline int64_t tf_block_kc_pad(int64_t kc) { return (kc + 15) / 16 * 16; }

/* The number of blocks of `size` that cover `extent`. */
static inline int64_t tf_gemm_blocks(int64_t extent, int64_t size) { return (extent + size - 1) / size; }

#endif /* TF_GEMM_KERNELS_H */
