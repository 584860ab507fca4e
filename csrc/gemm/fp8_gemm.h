/* FP8 GEMM on the CPU with the GPU's semantics (torch._scaled_mm / cuBLASLt):
 *
 *   out[i, j] = round_out( (sum_k a[i, k] * b[j, k]) * (scale_inv_a * scale_inv_b) + bias[j] )
 *
 * a (m, k) and b (n, k) are row-major FP8 (E4M3 or E5M2, any mix), out (m, n) row-major float32,
 * bfloat16 or float16. The FP8 values are decoded without scaling to bfloat16 (exact), multiplied
 * (the products are exact in float32) and summed in float32; the epilogue computes in float32
 * (scale product, one multiply, bias add) and rounds once to the output dtype.
 *
 * Paths (tf_isa): portable C and AVX2 sum every output element in k order, one product at a time,
 * so they give identical bits. AVX512-BF16 (vdpbf16ps) and AMX (tdpbf16ps) add products two k at a
 * time in the hardware's order; all paths lie within the float32 summation bound
 * |out - exact| <= (k + 1) * 2^-24 * sum_k |a[i,k] b[j,k]| * |scale| before the epilogue.
 * The AVX512 tier (no BF16) uses the AVX2 kernel.
 *
 * The output is split into tiles of TF_GEMM_MB x TF_GEMM_NB; a call computes the tiles
 * [tile_begin, tile_end) (row-major over tiles), so the binding spreads them over threads. Every
 * tile is computed the same way whatever the split, so results do not depend on the thread count. */
#ifndef TF_FP8_GEMM_H
#define TF_FP8_GEMM_H

#include <stdint.h>

#include "../common/cpu_features.h"
#include "../common/tf_dtype.h"
#include "../common/tf_status.h"
#include "../fp8/fp8_format.h"

#define TF_GEMM_MB 192
#define TF_GEMM_NB 128
#define TF_GEMM_KC 256

/* The number of output tiles of an (m, n) output; -1 if m or n is negative. */
int64_t tf_fp8_gemm_tiles(int64_t m, int64_t n);

/* Validates everything tf_fp8_gemm_nt checks, touching no pointer's data. */
tf_status tf_fp8_gemm_check(int64_t m, int64_t n, int64_t k, tf_fp8_format format_a,
                            tf_fp8_format format_b, int has_bias, tf_dtype bias_dtype,
                            tf_dtype out_dtype, tf_isa isa);

/* Computes the output tiles [tile_begin, tile_end) with the given path. isa must not exceed
 * tf_cpu_isa_detected() (TF_ERR_BAD_ARGUMENT otherwise). bias (n elements of bias_dtype) may be
 * NULL. Allocates its packing buffers per call: about 0.3 MiB, plus a's packed row of tiles (k x 192
 * elements, at most 16 MiB) when the call spans several tiles of a row, and on the bf16 paths b's
 * packed blocks (at most 16 MiB) when it spans several rows of tiles. TF_ERR_BAD_ARGUMENT if the
 * 0.3 MiB cannot be had; without the larger two it packs per tile. */
tf_status tf_fp8_gemm_nt(const uint8_t *a, tf_fp8_format format_a, const uint8_t *b,
                         tf_fp8_format format_b, int64_t m, int64_t n, int64_t k,
                         float scale_inv_a, float scale_inv_b, const void *bias,
                         tf_dtype bias_dtype, void *out, tf_dtype out_dtype, tf_isa isa,
                         int64_t tile_begin, int64_t tile_end);

#endif /* TF_FP8_GEMM_H */
