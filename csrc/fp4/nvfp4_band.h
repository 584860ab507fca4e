/*
 * One band of rows of tf_nvfp4_amax and tf_nvfp4_quantize (nvfp4.h), their arguments already checked
 * there: the portable loops (nvfp4.c, built per x86-64 level) and the AVX-512 and AVX2 kernels
 * (nvfp4_quantize_avx512.c, nvfp4_quantize_avx2.c) take the same arguments and give the same bytes.
 */
#ifndef TF_NVFP4_BAND_H
#define TF_NVFP4_BAND_H

#include <stdint.h>

#include "../common/cpu_features.h"
#include "../common/tf_dtype.h"

typedef struct tf_nvfp4_amax_args {
  const void *x;
  tf_dtype dtype;
  int64_t rows, cols, ld_x;
  int rht;
} tf_nvfp4_amax_args;

typedef struct tf_nvfp4_quantize_args {
  const void *x;
  tf_dtype dtype;
  int64_t rows, cols, ld_x, rows_p, cols_p; /* _p: rounded up to 16, the padded data's sizes */
  int block_2d, rht_t, stochastic;
  uint64_t seed;
  float s_enc, s_enc_t;
  uint8_t *y, *scale;
  int64_t ld_scale;
  uint8_t *y_t, *scale_t;
  int64_t ld_scale_t;
} tf_nvfp4_quantize_args;

#if TF_X86
/* Whether the AVX-512 kernels may run: the tier (capped) is AVX-512 or above and the CPU has AVX-512 DQ. */
int tf_nvfp4_avx512_usable(void);

/* The rows [row_begin, row_end) on AVX-512 F + BW + VL + DQ; only called where tf_nvfp4_avx512_usable(). *result:
 * the maximum of |value|'s bits as int32 (NaN above Inf). */
void tf_nvfp4_amax_band_avx512(const tf_nvfp4_amax_args *a, int64_t row_begin, int64_t row_end, int32_t *result);
void tf_nvfp4_quantize_band_avx512(const tf_nvfp4_quantize_args *a, int64_t row_begin, int64_t row_end);

/* The same on AVX2 + FMA + F16C (nvfp4_quantize_avx2.c); only called where tf_cpu_isa() >= TF_ISA_AVX2. */
void tf_nvfp4_amax_band_avx2(const tf_nvfp4_amax_args *a, int64_t row_begin, int64_t row_end, int32_t *result);
void tf_nvfp4_quantize_band_avx2(const tf_nvfp4_quantize_args *a, int64_t row_begin, int64_t row_end);
#endif

#endif /* TF_NVFP4_BAND_H */
