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

/* A tier's entry point calls its file's band(a, row_begin, row_end, dtype, format), an always-inline function,
 * through this: one build of it per input dtype and format, so that neither is tested in the inner loops. */
#define TF_MXFP8_BAND_OF(BAND, A, B, E, D) \
  ((A)->format == TF_FP8_E4M3 ? BAND(A, B, E, D, TF_FP8_E4M3) : BAND(A, B, E, D, TF_FP8_E5M2))
#define TF_MXFP8_BANDS(BAND, A, B, E)                                         \
  ((A)->dtype == TF_FLOAT32    ? TF_MXFP8_BAND_OF(BAND, A, B, E, TF_FLOAT32)  \
   : (A)->dtype == TF_BFLOAT16 ? TF_MXFP8_BAND_OF(BAND, A, B, E, TF_BFLOAT16) \
                               : TF_MXFP8_BAND_OF(BAND, A, B, E, TF_FLOAT16))

#if TF_X86
/* The rows [row_begin, row_end) on AVX-512 F + BW + VL, or on AVX2 + F16C; each only called where the CPU
 * has its extensions. */
void tf_mxfp8_band_avx512(const tf_mxfp8_args *a, int64_t row_begin, int64_t row_end);
void tf_mxfp8_band_avx2(const tf_mxfp8_args *a, int64_t row_begin, int64_t row_end);
#endif

#endif /* TF_MXFP8_BAND_H */
