/*
 * Row-tile loads and stores shared by the fused-op kernels (activation.c,
 * norm.c); private to the C sources.
 *
 * Kernels convert a tile of at most TF_OPS_TILE elements to float32 on the
 * stack, compute in float32, and store the tile in the output's dtype -- or,
 * for an FP8 output, as FP8 codes of value * scale while accumulating the
 * amax of the unscaled values. The dtype switch sits outside each loop so the
 * loops themselves vectorize; the kernels build their loops once per x86-64 level
 * (tf_isa_clones.h), so these helpers are always inlined.
 */
#ifndef TF_OPS_TILE_H
#define TF_OPS_TILE_H

#include <stdint.h>

#include "../common/tf_checks.h"
#include "../common/tf_isa_clones.h"
#include "../common/tf_status.h"
#include "ops_io.h"
#include "ops_math.h"

#define TF_OPS_TILE 512

static inline int tf_ops_dtype_ok(tf_dtype dtype) {
  return dtype == TF_FLOAT32 || dtype == TF_BFLOAT16 || dtype == TF_FLOAT16;
}

static inline int tf_ops_output_ok(const tf_ops_output *out) {
  if (!out) return 0;
  if (out->fp8) return out->format == TF_FP8_E4M3 || out->format == TF_FP8_E5M2;
  return tf_ops_dtype_ok(out->dtype);
}

/* v[i] = float(x[offset + i]) for i in [0, n). */
TF_ISA_INLINE void tf_ops_load(const void *restrict x, tf_dtype dtype, int64_t offset, int64_t n,
                               float *restrict v) {
  if (dtype == TF_FLOAT32) {
    const float *p = (const float *)x + offset;
    for (int64_t i = 0; i < n; ++i) v[i] = p[i];
  } else if (dtype == TF_BFLOAT16) {
    const uint16_t *p = (const uint16_t *)x + offset;
    for (int64_t i = 0; i < n; ++i) v[i] = tf_bf16_to_f32(p[i]);
  } else {
    const uint16_t *p = (const uint16_t *)x + offset;
    for (int64_t i = 0; i < n; ++i) v[i] = tf_f16_to_f32(p[i]);
  }
}

/* Stores v[0, n) at element offset `offset` of out; raises *amax_bits for an FP8 output. */
TF_ISA_INLINE void tf_ops_store(const tf_ops_output *out, int64_t offset, int64_t n,
                                const float *restrict v, uint32_t *amax_bits) {
  if (out->fp8) {
    uint8_t *p = (uint8_t *)out->data + offset;
    const float s = out->scale;
    uint32_t amax = *amax_bits;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t a = tf_f32_bits(v[i]) & 0x7FFFFFFFu;
      amax = a > amax ? a : amax;
    }
    if (out->format == TF_FP8_E4M3) {
      for (int64_t i = 0; i < n; ++i) p[i] = tf_fp8_e4m3_encode(v[i] * s);
    } else {
      for (int64_t i = 0; i < n; ++i) p[i] = tf_fp8_e5m2_encode(v[i] * s);
    }
    *amax_bits = amax;
  } else if (out->dtype == TF_FLOAT32) {
    float *p = (float *)out->data + offset;
    for (int64_t i = 0; i < n; ++i) p[i] = v[i];
  } else if (out->dtype == TF_BFLOAT16) {
    uint16_t *p = (uint16_t *)out->data + offset;
    for (int64_t i = 0; i < n; ++i) p[i] = tf_f32_to_bf16(v[i]);
  } else {
    uint16_t *p = (uint16_t *)out->data + offset;
    for (int64_t i = 0; i < n; ++i) p[i] = tf_f32_to_f16(v[i]);
  }
}

/* Stores float32 values in a floating dtype (no FP8). */
TF_ISA_INLINE void tf_ops_store_dtype(void *restrict x, tf_dtype dtype, int64_t offset, int64_t n,
                                      const float *restrict v) {
  const tf_ops_output out = {x, dtype, 0, TF_FP8_E4M3, 1.0f};
  uint32_t unused = 0;
  tf_ops_store(&out, offset, n, v, &unused);
}

/* Checks of a rows x cols problem handled for rows [row_begin, row_end). */
static inline tf_status tf_ops_check_rows(int64_t rows, int64_t cols, int64_t row_begin,
                                          int64_t row_end) {
  if (rows < 0 || cols < 0) return TF_ERR_BAD_SIZE;
  if (!tf_range_ok(row_begin, row_end, rows)) return TF_ERR_BAD_SIZE;
  if (!tf_mul_fits(rows, cols)) return TF_ERR_OVERFLOW;
  return TF_OK;
}

#endif /* TF_OPS_TILE_H */
