/*
 * One band of rows of tf_mxfp8_quantize (fp8_block.h), its arguments already checked there: the
 * portable loops (fp8_block.c) and the AVX2 and AVX-512 kernels (mxfp8_quantize_avx2.c,
 * mxfp8_quantize_avx512.c) take the same arguments and write the same bytes.
 */
#ifndef TF_MXFP8_BAND_H
#define TF_MXFP8_BAND_H

#include <stdint.h>

#include "../common/cpu_features.h"
#include "../common/tf_dtype.h"
#include "fp8_format.h"

typedef struct tf_mxfp8_args {
  const void *x;
  tf_dtype dtype;
  int64_t rows, cols, ld_x;
  tf_fp8_format format;
  uint8_t *y, *scale; /* rowwise: NULL to skip */
  int64_t ld_scale;
  uint8_t *y_col, *scale_col; /* columnwise: NULL to skip */
  int64_t ld_scale_col;
} tf_mxfp8_args;

#if TF_X86
/* The rows [row_begin, row_end) on AVX-512 F + BW + VL, or on AVX2 + F16C; each only called where the CPU
 * has its extensions. */
void tf_mxfp8_band_avx512(const tf_mxfp8_args *a, int64_t row_begin, int64_t row_end);
void tf_mxfp8_band_avx2(const tf_mxfp8_args *a, int64_t row_begin, int64_t row_end);
#endif

#endif /* TF_MXFP8_BAND_H */
