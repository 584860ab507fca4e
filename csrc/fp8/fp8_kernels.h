/*
 * The kernel sets behind fp8_quantize.h, one per instruction-set path.
 *
 * fp8_quantize.c checks every argument, then calls the set of the path the
 * CPU runs. Every set gives the same bytes and the same amax bits as the
 * portable one for every input; tests/c/test_fp8_core.c compares them. The
 * kernels take checked arguments only and do no checking of their own.
 */
#ifndef TF_FP8_KERNELS_H
#define TF_FP8_KERNELS_H

#include <float.h>

#include <stdint.h>

#include "../common/tf_dtype.h"
#include "../common/cpu_features.h"
#include "fp8_format.h"

/* y[i] = fp8(x[i] * scale) for i in [begin, end); returns the bits of max |x[i]|. */
typedef uint32_t (*tf_fp8_quantize_fn)(const void *x, int64_t begin, int64_t end, float scale,
                                       uint8_t *y);
/* Returns the bits of max |x[i]| for i in [begin, end). */
typedef uint32_t (*tf_fp8_amax_fn)(const void *x, int64_t begin, int64_t end);
/*
 * Cast-transpose of the rows x cols block at x (row stride ld_x elements):
 * y[r * ld_y + c] = y_t[c * ld_t + r] = fp8(x[r * ld_x + c] * scale); returns amax bits.
 */
typedef uint32_t (*tf_fp8_cast_transpose_fn)(const void *x, int64_t ld_x, int64_t rows,
                                             int64_t cols, float scale, uint8_t *y, int64_t ld_y,
                                             uint8_t *y_t, int64_t ld_t);

/*
 * The lookup-table quantize kernel of 16-bit input (see tf_fp8_table_build): tf_fp8_quantize_fn
 * with fp8(x * scale) replaced by table[bit pattern of x], for bfloat16 and float16 alike.
 */
typedef uint32_t (*tf_fp8_quantize_table_fn)(const void *x, int64_t begin, int64_t end,
                                             const uint8_t *table, uint8_t *y);

/*
 * x[i] = table[y[i]] for i in [begin, end): the lookup of dequantize's 16-bit outputs (bfloat16 and
 * float16), whose 256 values fp8_quantize.c computes once per call on the portable path's code.
 */
typedef void (*tf_fp8_lookup16_fn)(const uint8_t *y, int64_t begin, int64_t end, const uint16_t *table,
                                   uint16_t *x);
/* The same for float32 outputs, as their bits. */
typedef void (*tf_fp8_lookup32_fn)(const uint8_t *y, int64_t begin, int64_t end, const uint32_t *table,
                                   uint32_t *x);

/*
 * Tables indexed [tf_dtype][tf_fp8_format] (amax: [tf_dtype]); the quantize table kernels
 * [tf_dtype - TF_BFLOAT16], bfloat16 then float16.
 */
typedef struct tf_fp8_kernel_set {
  tf_fp8_quantize_fn quantize[3][2];
  tf_fp8_amax_fn amax[3];
  tf_fp8_cast_transpose_fn cast_transpose[3][2];
  tf_fp8_quantize_table_fn quantize_table[2];
  tf_fp8_lookup16_fn lookup16;
  tf_fp8_lookup32_fn lookup32;
} tf_fp8_kernel_set;

/* The portable lookups, which the AVX2 set shares (no lookup of 256 entries pays there). */
void tf_fp8_lookup16_portable(const uint8_t *y, int64_t begin, int64_t end, const uint16_t *table,
                              uint16_t *x);
void tf_fp8_lookup32_portable(const uint8_t *y, int64_t begin, int64_t end, const uint32_t *table,
                              uint32_t *x);

/*
 * The amax bits of 16-bit input from m, the largest of its |x| bit patterns (sign bit cleared),
 * which order like the values: bfloat16 widens by a shift, float16 exactly, except that the
 * widening quiets a signalling NaN, which reorders NaN payloads; then UINT32_MAX asks the caller
 * to recount in float32 bits.
 */
static inline uint32_t tf_fp8_amax_of_16bit_max(uint32_t m, tf_dtype d) {
  if (d == TF_BFLOAT16) return m << 16;
  return m > 0x7C00u ? UINT32_MAX : tf_f32_bits(tf_f16_to_f32((uint16_t)m));
}

/* Plain C, vectorized by the compiler for the baseline target: runs everywhere. */
extern const tf_fp8_kernel_set tf_fp8_kernels_portable;

/*
 * AVX2 with F16C (x86-64-v3 and every AVX-512 CPU): NULL where the file is
 * not built for x86-64. Only called when the CPU has both extensions.
 */
extern const tf_fp8_kernel_set *const tf_fp8_kernels_avx2;

/*
 * AVX-512 F + BW + VL: NULL where the file is not built for x86-64. Only called when the CPU
 * has the avx512 tier; hands its tails to the AVX2 set.
 */
extern const tf_fp8_kernel_set *const tf_fp8_kernels_avx512;

#if TF_X86
/* The AVX-512 set's cast-transpose kernels (fp8_cast_transpose_avx512.c). */
#define TF_FP8_DECLARE_CAST_TRANSPOSE(NAME)                                                            \
  uint32_t NAME(const void *x, int64_t ld_x, int64_t rows, int64_t cols, float scale, uint8_t *y,     \
                int64_t ld_y, uint8_t *y_t, int64_t ld_t)
TF_FP8_DECLARE_CAST_TRANSPOSE(tf_fp8_cast_transpose_avx512_f32_e4m3);
TF_FP8_DECLARE_CAST_TRANSPOSE(tf_fp8_cast_transpose_avx512_f32_e5m2);
TF_FP8_DECLARE_CAST_TRANSPOSE(tf_fp8_cast_transpose_avx512_bf16_e4m3);
TF_FP8_DECLARE_CAST_TRANSPOSE(tf_fp8_cast_transpose_avx512_bf16_e5m2);
TF_FP8_DECLARE_CAST_TRANSPOSE(tf_fp8_cast_transpose_avx512_f16_e4m3);
TF_FP8_DECLARE_CAST_TRANSPOSE(tf_fp8_cast_transpose_avx512_f16_e5m2);

/*
 * The byte transpose's whole panels on AVX-512 (fp8_cast_transpose_avx512.c): y_t[c * ld_t + r] =
 * x[r * ld_x + c] for the rows of whole TF_FP8_CT_BAND-row panels of [0, rows) and the columns
 * [0, returned), a multiple of 64 (0 when there is no whole panel, or no memory for its buffer).
 */
int64_t tf_fp8_transpose_panels_avx512(const uint8_t *x, int64_t ld_x, int64_t rows, int64_t cols,
                                       uint8_t *y_t, int64_t ld_t);
#endif

/*
 * Whether the SIMD paths' fast encoder applies: scale > 0 and finite, so that |x * scale| =
 * |x| * scale and sign(x * scale) = sign(x) for every x, NaN included; for E4M3, scale * 2^-8 must
 * be normal so that |x| * (scale * 2^-8) is |x| * scale scaled exactly wherever the FP8 code is not
 * zero.
 */
static inline int tf_fp8_fast_scale(float scale, tf_fp8_format f) {
  return scale > 0.0f && scale <= FLT_MAX && (f == TF_FP8_E5M2 || scale >= 0x1p-118f);
}

/* The multiplier the fast encoder uses: E4M3 works on values scaled by 2^-8. */
static inline float tf_fp8_fast_multiplier(float scale, tf_fp8_format f) {
  return f == TF_FP8_E4M3 ? scale * 0x1p-8f : scale;
}

/* The set for the instruction-set path in force (see common/cpu_features.h). */
const tf_fp8_kernel_set *tf_fp8_kernels_active(void);

#endif /* TF_FP8_KERNELS_H */
