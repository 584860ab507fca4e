/*
 * Block-scaled FP8 quantizers on the CPU: MXFP8 (32-element blocks, E8M0 scales) and Float8 block
 * scaling (1x128 or 128x128 blocks, float32 scales), with TransformerEngine's semantics and layouts
 * (docs/block_scaling.md; the scales themselves in fp8_block_format.h).
 *
 * x is a rows x cols matrix (row stride ld_x elements); the outputs are contiguous. Each call
 * quantizes the rows [row_begin, row_end), so callers can split a matrix into bands over threads;
 * a band that feeds a column block must start on a block boundary (and end on one or at `rows`).
 * Either usage's pointers may both be NULL to skip it. Blocks at the right and bottom edges may be
 * partial: their amax covers the elements that exist.
 *
 * Built per x86-64 level (baseline, x86-64-v3, x86-64-v4; tf_isa_clones.h) and chosen per call by
 * tf_cpu_isa(); MXFP8 on AVX2 and AVX-512 runs kernels of its own (mxfp8_quantize_avx2.c,
 * mxfp8_quantize_avx512.c). Every path gives the same bytes.
 */
#ifndef TF_FP8_BLOCK_H
#define TF_FP8_BLOCK_H

#include <stdint.h>

#include "../common/tf_dtype.h"
#include "../common/tf_status.h"
#include "fp8_format.h"

#define TF_MXFP8_BLOCK 32
#define TF_FP8_BLOCK_LEN 128

/*
 * MXFP8. Rowwise (1x32 blocks along cols): y (rows x cols) and scale[r * ld_scale + c / 32], E8M0
 * codes, ld_scale >= ceil(cols / 32). Columnwise (32x1 blocks along rows), from x as well: y_col
 * (rows x cols, not transposed) and scale_col[(r / 32) * ld_scale_col + c], ld_scale_col >= cols.
 */
tf_status tf_mxfp8_quantize(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x,
                            int64_t row_begin, int64_t row_end, tf_fp8_format format, uint8_t *y,
                            uint8_t *scale, int64_t ld_scale, uint8_t *y_col, uint8_t *scale_col,
                            int64_t ld_scale_col);

/*
 * Float8 block scaling, TE's "GEMM ready" layouts; scale_inv = 1 / scale per block, float32.
 * block_dim 1: rowwise 1x128 tiles, y (rows x cols) and scale_inv[(c / 128) * ld_scale + r]
 *   (ld_scale >= rows); columnwise 128x1 tiles, y_t = the transposed data (cols x rows) and
 *   scale_inv_t[(r / 128) * ld_scale_t + c] (ld_scale_t >= cols).
 * block_dim 2: 128x128 blocks, y and scale_inv[(r / 128) * ld_scale + c / 128] (ld_scale >=
 *   ceil(cols / 128)); y_t (the transpose of y) and scale_inv_t[(c / 128) * ld_scale_t + r / 128]
 *   (ld_scale_t >= ceil(rows / 128)).
 * epsilon (>= 0, finite) floors each amax; pow2 rounds each scale down to a power of two.
 */
tf_status tf_fp8_block_quantize(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x,
                                int64_t row_begin, int64_t row_end, tf_fp8_format format, int block_dim,
                                float epsilon, int pow2, uint8_t *y, float *scale_inv, int64_t ld_scale,
                                uint8_t *y_t, float *scale_inv_t, int64_t ld_scale_t);

typedef enum tf_block_scale_kind {
  TF_BLOCK_SCALE_E8M0 = 0, /* uint8 codes, 2^(code - 127) */
  TF_BLOCK_SCALE_F32 = 1   /* float32 values */
} tf_block_scale_kind;

/*
 * x[r * cols + c] = dtype(float32(decode(y[r * cols + c]) * S)) for the rows [row_begin, row_end) of
 * the rows x cols FP8 matrix y, where S is the scale of the element's block (r / block_rows,
 * c / block_cols) in the scale_rows x scale_cols matrix `scale`: scale[i][j], or scale[j][i] when
 * scale_transposed. Covers every layout above (docs/block_scaling.md).
 */
tf_status tf_block_dequantize(const uint8_t *y, tf_fp8_format format, int64_t rows, int64_t cols,
                              int64_t row_begin, int64_t row_end, const void *scale,
                              tf_block_scale_kind kind, int64_t scale_rows, int64_t scale_cols,
                              int64_t block_rows, int64_t block_cols, int scale_transposed, void *x,
                              tf_dtype dtype);

#endif /* TF_FP8_BLOCK_H */
