/*
 * FP8 quantizer kernels on the CPU.
 *
 * Buffers are contiguous unless a row stride is given. Every kernel works on a
 * sub-range of its problem ([begin, end) elements, or a band of rows) so the
 * caller can split the work over threads; each call is independent and
 * touches only its own part of the outputs.
 *
 * amax is reported as the bit pattern of max |x| (the sign bit cleared), which
 * orders like the value for non-negative floats and lets NaN win over Inf:
 * callers combine partial results with an unsigned max.
 */
#ifndef TF_FP8_QUANTIZE_H
#define TF_FP8_QUANTIZE_H

#include <stdint.h>

#include "../common/tf_dtype.h"
#include "../common/tf_status.h"
#include "fp8_format.h"

/* y[i] = fp8(float(x[i]) * scale) for i in [begin, end); *amax_bits = bits of max |x[i]|. */
tf_status tf_fp8_quantize(const void *x, tf_dtype dtype, int64_t begin, int64_t end,
                          float scale, tf_fp8_format format, uint8_t *y, uint32_t *amax_bits);

/* *amax_bits = bits of max |x[i]| for i in [begin, end). */
tf_status tf_fp8_amax(const void *x, tf_dtype dtype, int64_t begin, int64_t end,
                      uint32_t *amax_bits);

/* x[i] = dtype(decode(y[i]) * scale_inv) for i in [begin, end), rounded to nearest even. */
tf_status tf_fp8_dequantize(const uint8_t *y, tf_fp8_format format, int64_t begin, int64_t end,
                            float scale_inv, void *x, tf_dtype dtype);

/*
 * Cast-transpose of a rows x cols matrix x (row stride x_row_stride elements),
 * for the rows in [row_begin, row_end): writes y (rows x cols, row-major) and
 * y_t (cols x rows, row-major) from a single read of x.
 */
tf_status tf_fp8_cast_transpose(const void *x, tf_dtype dtype, int64_t rows, int64_t cols,
                                int64_t x_row_stride, int64_t row_begin, int64_t row_end,
                                float scale, tf_fp8_format format, uint8_t *y, uint8_t *y_t,
                                uint32_t *amax_bits);

/* Row band height that tf_fp8_cast_transpose works in; callers split rows at multiples of it. */
#define TF_FP8_CT_TILE 64
/* Callers that split rows at multiples of this (a multiple of TF_FP8_CT_TILE) keep the AVX2
 * path's taller tiles and the AVX-512 path's panels whole. */
#define TF_FP8_CT_BAND 128

/*
 * The lookup-table path of bfloat16 and float16 input. A 16-bit input has 65536 bit patterns,
 * so for one scale and format a table of their FP8 codes, encoded by tf_fp8_quantize's own
 * kernels, turns quantization into one lookup an element: the same bytes by construction. The
 * amax is taken on the bit patterns and gives the same bits as tf_fp8_amax. Building the table
 * costs about as much as quantizing 150000 elements and a lookup saves a fraction of an
 * encoding: about even at a million elements, a gain from two.
 */
#define TF_FP8_TABLE_ENTRIES 65536
#define TF_FP8_TABLE_MIN_ELEMENTS (1 << 21)

/* Whether a tensor of `elements` elements of `dtype` takes the table path: 16-bit and large, on the
 * portable and avx2 paths (the avx512 encoder is faster than a lookup). */
int tf_fp8_table_pays(tf_dtype dtype, int64_t elements);

/*
 * table[b] = fp8(value of the dtype's bit pattern b * scale) for b in [begin, end), within
 * [0, TF_FP8_TABLE_ENTRIES): callers may build disjoint parts of one table on different threads.
 */
tf_status tf_fp8_table_build(tf_dtype dtype, float scale, tf_fp8_format format, int64_t begin,
                             int64_t end, uint8_t *table);

/* tf_fp8_quantize of 16-bit x with a whole table from tf_fp8_table_build in place of the scale. */
tf_status tf_fp8_quantize_table(const void *x, tf_dtype dtype, int64_t begin, int64_t end,
                                const uint8_t *table, uint8_t *y, uint32_t *amax_bits);

#endif /* TF_FP8_QUANTIZE_H */
