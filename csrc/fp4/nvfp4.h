/*
 * NVFP4 quantizers on the CPU, with TransformerEngine's semantics (docs/block_scaling.md, "NVFP4";
 * the scalar arithmetic in nvfp4_format.h).
 *
 * x is a rows x cols matrix (row stride ld_x elements) of any size. Each call works on the rows
 * [row_begin, row_end), a band that starts on a multiple of 16 and ends on one or at rows, so callers
 * can split a matrix over threads. A matrix whose sizes are not multiples of 16 is quantized as its
 * zero-padding to rows_p x cols_p (both rounded up to 16), of which the outputs (contiguous) keep:
 *   rowwise     y   (rows x cols_p / 2 bytes), 1x16 blocks along cols, scale[r * ld_scale + c / 16];
 *   columnwise  y_t (cols x rows_p / 2 bytes), the transposed data, 16x1 blocks of x along rows,
 *               scale_t[c * ld_scale_t + r / 16].
 * So a partial block's scale comes from the elements present and its padding holds code 0 (but the
 * Hadamard transform of a partial group spreads over all 16). Scales are E4M3 codes. Either usage's
 * pointers may both be NULL to skip it.
 *
 * amax and quantize run AVX-512 or AVX2 kernels where the CPU has them (nvfp4_band.h), else portable C;
 * dequantize is built per x86-64 level (tf_isa_clones.h). The tier is chosen per call; every tier gives the same bytes.
 */
#ifndef TF_NVFP4_H
#define TF_NVFP4_H

#include <stdint.h>

#include "../common/tf_dtype.h"
#include "../common/tf_status.h"

#define TF_NVFP4_BLOCK 16

/*
 * *amax = max |v| over the band (NaN-propagating: Inf or NaN in the input shows in the result),
 * where v is x itself (rht 0), or the columnwise values after the random Hadamard transform of each
 * 16 consecutive elements of a column (rht 1): the amax a quantization of those values needs.
 */
tf_status tf_nvfp4_amax(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x,
                        int64_t row_begin, int64_t row_end, int rht, float *amax);

/*
 * Quantizes the band. amax and amax_t are the whole tensor's amaxes (finite, >= 0) of the rowwise
 * and columnwise values (tf_nvfp4_amax). block_2d: one scale per 16x16 block, shared by both usages
 * (written into each row's, or each transposed row's, slots). rht_t: the columnwise values are the
 * Hadamard-transformed ones (not with block_2d). stochastic: stochastic rounding with the random
 * stream `seed`, element (r, c) of y drawing counter r * cols_p + c and element (c, r) of y_t
 * drawing rows_p * cols_p + c * rows_p + r; else round to nearest even.
 */
tf_status tf_nvfp4_quantize(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x,
                            int64_t row_begin, int64_t row_end, int block_2d, int rht_t, int stochastic,
                            uint64_t seed, float amax, float amax_t, uint8_t *y, uint8_t *scale,
                            int64_t ld_scale, uint8_t *y_t, uint8_t *scale_t, int64_t ld_scale_t);

/*
 * codes[2i] and codes[2i + 1] = the E4M3 codes of packed byte y[i]'s low and high E2M1 values (every
 * E2M1 value is an E4M3 value), for i in [begin, end): the block GEMM's operands. AVX2's byte shuffle
 * where the CPU has it.
 */
tf_status tf_nvfp4_unpack_e4m3(const uint8_t *y, int64_t begin, int64_t end, uint8_t *codes);

/*
 * x[r * cols + c] = dtype(float32(e2m1(y, r, c) * decode factor)) for the rows [row_begin, row_end) of
 * the packed rows x cols matrix y (either usage's data: y_t is a cols x rows one), the factor from
 * the element's block scale scale[r * ld_scale + c / 16] and the tensor's amax.
 */
tf_status tf_nvfp4_dequantize(const uint8_t *y, int64_t rows, int64_t cols, int64_t row_begin, int64_t row_end,
                              const uint8_t *scale, int64_t ld_scale, float amax, void *x, tf_dtype dtype);

#endif /* TF_NVFP4_H */
