/*
 * Transpose of FP8 data: the transposed bytes a gradient GEMM reads (the wgrad's x^T) when the data
 * came without them, e.g. an FP8 output handed to the next linear. FP8 codes are copied as bytes.
 */
#ifndef TF_FP8_TRANSPOSE_H
#define TF_FP8_TRANSPOSE_H

#include <stdint.h>

#include "../common/tf_status.h"

/*
 * Rows of x a band of tf_fp8_transpose should cover (callers split rows at multiples of it): the
 * AVX-512 path's panels (TF_FP8_CT_BAND, fp8_quantize.h).
 */
#define TF_FP8_TRANSPOSE_BAND 128

/*
 * y[c * rows + r] = x[r * cols + c] for x's rows r in [row_begin, row_end) and every column c:
 * x is rows x cols and y cols x rows, both contiguous. Each call writes only its rows' bytes of y.
 */
tf_status tf_fp8_transpose(const uint8_t *x, int64_t rows, int64_t cols, int64_t row_begin,
                           int64_t row_end, uint8_t *y);

#endif /* TF_FP8_TRANSPOSE_H */
