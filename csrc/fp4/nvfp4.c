#include "nvfp4.h"

#include <float.h>

#include "../common/tf_checks.h"
#include "../common/tf_isa_clones.h"
#include "nvfp4_band.h"
#include "nvfp4_format.h"

#if TF_X86
#include <immintrin.h>
#endif

/* A band is worked in tiles of 16 rows by up to TILE_COLS columns, widened to float32 once (32 KiB
 * on the stack), so rowwise and columnwise blocks come from one read of x. */
enum { TILE_COLS = 512, DEQUANTIZE_CHUNK = 1024 };
#define BLOCK TF_NVFP4_BLOCK

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t round_up16(int64_t a) { return (a + BLOCK - 1) / BLOCK * BLOCK; }

/* f[i] = float(x[offset + i]) for i in [0, n). */
TF_ISA_INLINE void load_f32(const void *x, tf_dtype dtype, int64_t offset, int64_t n, float *restrict f) {
  if (dtype == TF_FLOAT32) {
    const float *restrict p = (const float *)x + offset;
    for (int64_t i = 0; i < n; ++i) f[i] = p[i];
  } else if (dtype == TF_BFLOAT16) {
    const uint16_t *restrict p = (const uint16_t *)x + offset;
    for (int64_t i = 0; i < n; ++i) f[i] = tf_bf16_to_f32(p[i]);
  } else {
    const uint16_t *restrict p = (const uint16_t *)x + offset;
    for (int64_t i = 0; i < n; ++i) f[i] = tf_f16_to_f32(p[i]);
  }
}

/* The tile of rows [g, g + 16) and columns [c0, c0 + nc) of x, zero beyond the rows (< rows) and the
 * columns (nc) that exist, up to ncp = nc rounded up to 16: a partial block is a zero-padded one. */
TF_ISA_INLINE void load_tile(const void *x, tf_dtype dtype, int64_t ld_x, int64_t rows, int64_t g, int64_t c0,
                             int64_t nc, int64_t ncp, float tile[BLOCK][TILE_COLS]) {
  for (int r = 0; r < BLOCK; ++r) {
    const int64_t n = g + r < rows ? nc : 0;
    if (n) load_f32(x, dtype, (g + r) * ld_x + c0, n, tile[r]);
    for (int64_t c = n; c < ncp; ++c) tile[r][c] = 0.0f;
  }
}

/* max over |f[i]|'s bits as int32 for i in [0, n), m included: ordered like the values, NaN above Inf. */
TF_ISA_INLINE int32_t abs_bits_max(const float *restrict f, int64_t n, int32_t m) {
  for (int64_t i = 0; i < n; ++i) {
    const int32_t a = (int32_t)(tf_f32_bits(f[i]) & 0x7FFFFFFFu);
    m = a > m ? a : m;
  }
  return m;
}

TF_ISA_INLINE float amax_of(int32_t bits) { return tf_f32_from_bits((uint32_t)bits); }

/* negative[j][i]: the transform's matrix entry M[j][i] (tf_nvfp4_rht_entry) is -1/4, else +1/4. */
TF_ISA_INLINE void rht_signs(uint8_t negative[BLOCK][BLOCK]) {
  for (int j = 0; j < BLOCK; ++j)
    for (int i = 0; i < BLOCK; ++i) negative[j][i] = tf_nvfp4_rht_entry(j, i) < 0.0f;
}

/*
 * The columnwise values of the tile's columns [b, b + 16), transposed: t[i][k] is value i of column b + k's
 * group, tile[i][b + k] itself, or (rht) its transform w = v M, w[i] = sum over j of float32(v[j] * M[j][i])
 * added in j order from +0 in float32. The 16 columns are the vector lanes, each summed in that order;
 * v[j] * -1/4 is -(v[j] * 1/4) exactly (rounding is symmetric), so each product is one of two per j.
 */
TF_ISA_INLINE void columns16(const float tile[BLOCK][TILE_COLS], int64_t b, int rht,
                             const uint8_t negative[BLOCK][BLOCK], float t[BLOCK][BLOCK]) {
  if (!rht) {
    for (int i = 0; i < BLOCK; ++i)
      for (int k = 0; k < BLOCK; ++k) t[i][k] = tile[i][b + k];
    return;
  }
  float product[2][BLOCK][BLOCK]; /* [negative][j][k] */
  for (int j = 0; j < BLOCK; ++j)
    for (int k = 0; k < BLOCK; ++k) {
      product[0][j][k] = tile[j][b + k] * 0.25f;
      product[1][j][k] = -product[0][j][k];
    }
  /* j outermost: the 16 sums of a step are independent, where i outermost chained 16 dependent adds (4x slower). */
  for (int i = 0; i < BLOCK; ++i)
    for (int k = 0; k < BLOCK; ++k) t[i][k] = 0.0f;
  for (int j = 0; j < BLOCK; ++j)
    for (int i = 0; i < BLOCK; ++i) {
      const float *restrict p = product[negative[j][i]][j];
      for (int k = 0; k < BLOCK; ++k) t[i][k] += p[k];
    }
}

/* bits[k] = max over i of |t[i][k]|'s bits as int32 (abs_bits_max per lane). */
TF_ISA_INLINE void lane_abs_bits_max(const float t[BLOCK][BLOCK], int32_t bits[BLOCK]) {
  for (int k = 0; k < BLOCK; ++k) bits[k] = 0;
  for (int i = 0; i < BLOCK; ++i)
    for (int k = 0; k < BLOCK; ++k) {
      const int32_t a = (int32_t)(tf_f32_bits(t[i][k]) & 0x7FFFFFFFu);
      bits[k] = a > bits[k] ? a : bits[k];
    }
}

/*
 * tf_e2m1_encode_sr without branches, which GCC vectorizes: the same comparisons; the lower code's
 * magnitude as the sum of the grid's steps up to it (exact); the division by q, a power of two, as the
 * product with 1 / q (the same real number, so the same float32); u24 < 2^24 converted as a signed int.
 */
TF_ISA_INLINE uint8_t encode_sr_lanes(float v, uint32_t u24) {
  const float a = tf_f32_from_bits(tf_f32_bits(v) & 0x7FFFFFFFu);
  const uint32_t lo = (uint32_t)(a >= 0.5f) + (uint32_t)(a >= 1.0f) + (uint32_t)(a >= 1.5f) +
                      (uint32_t)(a >= 2.0f) + (uint32_t)(a >= 3.0f) + (uint32_t)(a >= 4.0f) +
                      (uint32_t)(a >= 6.0f);
  const float lo_value = (a >= 0.5f ? 0.5f : 0.0f) + (a >= 1.0f ? 0.5f : 0.0f) + (a >= 1.5f ? 0.5f : 0.0f) +
                         (a >= 2.0f ? 0.5f : 0.0f) + (a >= 3.0f ? 1.0f : 0.0f) + (a >= 4.0f ? 1.0f : 0.0f) +
                         (a >= 6.0f ? 2.0f : 0.0f);
  const float inverse_q = a >= 4.0f ? 0.5f : a >= 2.0f ? 1.0f : 2.0f;
  const float d = (a - lo_value) * inverse_q;
  const uint32_t up = (uint32_t)(a < 6.0f) & (uint32_t)((float)(int32_t)u24 < d * 16777216.0f);
  return (uint8_t)((lo + up) | tf_e2m1_sign(v));
}

/* codes[i] = E2M1(v[i] * multiplier[i / 16]) for i in [0, n), n a multiple of 16; element i draws counter + i. */
TF_ISA_INLINE void encode_run(const float *restrict v, const float *restrict multiplier, int64_t n, int stochastic,
                              uint64_t seed, uint64_t counter, uint8_t *restrict codes) {
  for (int64_t b = 0; b < n; b += BLOCK) {
    const float mu = multiplier[b / BLOCK];
    if (stochastic) {
      uint32_t u24[BLOCK]; /* drawn in a loop of their own, which GCC vectorizes (64-bit lanes) */
      for (int i = 0; i < BLOCK; ++i) u24[i] = tf_nvfp4_random24(seed, counter + (uint64_t)(b + i));
      for (int i = 0; i < BLOCK; ++i) codes[b + i] = encode_sr_lanes(v[b + i] * mu, u24[i]);
    } else {
      for (int i = 0; i < BLOCK; ++i) codes[b + i] = tf_e2m1_encode_rn(v[b + i] * mu);
    }
  }
}

/* out[k] = codes[2k] | codes[2k + 1] << 4 for k in [0, n / 2). */
TF_ISA_INLINE void pack_run(const uint8_t *restrict codes, int64_t n, uint8_t *restrict out) {
  for (int64_t k = 0; k < n / 2; ++k) out[k] = (uint8_t)(codes[2 * k] | (codes[2 * k + 1] << 4));
}

/* ---- amax -------------------------------------------------------------------------------------- */

typedef tf_nvfp4_amax_args amax_args;

TF_ISA_INLINE void amax_band_body(const amax_args *a, int64_t row_begin, int64_t row_end, int32_t *result) {
  float tile[BLOCK][TILE_COLS];
  uint8_t negative[BLOCK][BLOCK];
  float t[BLOCK][BLOCK];
  int32_t best = 0;
  rht_signs(negative);
  for (int64_t g = row_begin; g < row_end; g += BLOCK) {
    for (int64_t c0 = 0; c0 < a->cols; c0 += TILE_COLS) {
      const int64_t nc = min64(TILE_COLS, a->cols - c0), ncp = round_up16(nc);
      load_tile(a->x, a->dtype, a->ld_x, a->rows, g, c0, nc, a->rht ? ncp : nc, tile);
      if (!a->rht) {
        for (int r = 0; r < BLOCK; ++r) best = abs_bits_max(tile[r], nc, best);
        continue;
      }
      /* Padding columns (zero) transform to zeros, which leave the maximum as it is. */
      for (int64_t b = 0; b < ncp; b += BLOCK) {
        columns16((const float(*)[TILE_COLS])tile, b, 1, (const uint8_t(*)[BLOCK])negative, t);
        for (int i = 0; i < BLOCK; ++i) best = abs_bits_max(t[i], BLOCK, best);
      }
    }
  }
  *result = best;
}

/* The portable build only: AVX2 and AVX-512 CPUs take nvfp4_quantize_avx2.c's and nvfp4_quantize_avx512.c's. */
static void amax_band(const amax_args *a, int64_t row_begin, int64_t row_end, int32_t *result) {
  amax_band_body(a, row_begin, row_end, result);
}

static int dtype_ok(tf_dtype dtype) {
  return dtype == TF_FLOAT32 || dtype == TF_BFLOAT16 || dtype == TF_FLOAT16;
}

/* The checks every entry point shares: the sizes, the band (starting on a 16-row bound, ending on one or
 * at rows) and the index products of the sizes rounded up to 16 (the padded data's, and the
 * stochastic-rounding counters up to 2 * rows_p * cols_p). */
static tf_status check_matrix(int64_t rows, int64_t cols, int64_t row_begin, int64_t row_end) {
  if (rows < 0 || cols < 0) return TF_ERR_BAD_SIZE;
  if (!tf_range_ok(row_begin, row_end, rows) || row_begin % BLOCK || (row_end % BLOCK && row_end != rows))
    return TF_ERR_BAD_SIZE;
  if (rows > INT64_MAX - BLOCK || cols > INT64_MAX - BLOCK) return TF_ERR_OVERFLOW;
  const int64_t rows_p = round_up16(rows), cols_p = round_up16(cols);
  if (!tf_mul_fits(rows_p, cols_p) || !tf_mul_fits(rows_p * cols_p, 4)) return TF_ERR_OVERFLOW;
  return TF_OK;
}

static tf_status check_input(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x,
                             int64_t row_begin, int64_t row_end) {
  if (!dtype_ok(dtype)) return TF_ERR_BAD_DTYPE;
  const tf_status s = check_matrix(rows, cols, row_begin, row_end);
  if (s != TF_OK) return s;
  if (ld_x < cols) return TF_ERR_BAD_SIZE;
  if (!tf_mul_fits(rows, ld_x) || !tf_mul_fits(rows * ld_x, tf_dtype_size(dtype))) return TF_ERR_OVERFLOW;
  if (row_end > row_begin && cols > 0 && !x) return TF_ERR_NULL_POINTER;
  return TF_OK;
}

tf_status tf_nvfp4_amax(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x,
                        int64_t row_begin, int64_t row_end, int rht, float *amax) {
  const tf_status s = check_input(x, dtype, rows, cols, ld_x, row_begin, row_end);
  if (s != TF_OK) return s;
  if (rht != 0 && rht != 1) return TF_ERR_BAD_ARGUMENT;
  if (!amax) return TF_ERR_NULL_POINTER;
  int32_t bits = 0;
  if (row_end > row_begin && cols > 0) {
    const amax_args a = {x, dtype, rows, cols, ld_x, rht};
#if TF_X86
    if (tf_nvfp4_avx512_usable())
      tf_nvfp4_amax_band_avx512(&a, row_begin, row_end, &bits);
    else if (tf_cpu_isa() >= TF_ISA_AVX2)
      tf_nvfp4_amax_band_avx2(&a, row_begin, row_end, &bits);
    else
#endif
      amax_band(&a, row_begin, row_end, &bits);
  }
  *amax = amax_of(bits);
  return TF_OK;
}

/* ---- quantize ---------------------------------------------------------------------------------- */

typedef tf_nvfp4_quantize_args quantize_args;

TF_ISA_INLINE void quantize_band_body(const quantize_args *a, int64_t row_begin, int64_t row_end) {
  float tile[BLOCK][TILE_COLS];
  uint8_t negative[BLOCK][BLOCK];
  float t[BLOCK][BLOCK], multiplier[TILE_COLS / BLOCK];
  uint8_t codes_2d[TILE_COLS / BLOCK], codes[TILE_COLS], codes_t[BLOCK][BLOCK];
  const uint64_t t_base = (uint64_t)a->rows_p * (uint64_t)a->cols_p;
  const int64_t ld_y = a->cols_p / 2, ld_y_t = a->rows_p / 2;
  rht_signs(negative);
  for (int64_t g = row_begin; g < row_end; g += BLOCK) {
    const int64_t nr = min64(BLOCK, a->rows - g);
    for (int64_t c0 = 0; c0 < a->cols; c0 += TILE_COLS) {
      const int64_t nc = min64(TILE_COLS, a->cols - c0), ncp = round_up16(nc);
      load_tile(a->x, a->dtype, a->ld_x, a->rows, g, c0, nc, ncp, tile);
      if (a->block_2d) {
        for (int64_t b = 0; b < ncp; b += BLOCK) {
          int32_t bits = 0;
          for (int r = 0; r < BLOCK; ++r) bits = abs_bits_max(tile[r] + b, BLOCK, bits);
          codes_2d[b / BLOCK] = tf_nvfp4_block_scale(amax_of(bits), a->s_enc);
        }
      }
      if (a->y) {
        for (int64_t r = 0; r < nr; ++r) {
          uint8_t *restrict scale = a->scale + (g + r) * a->ld_scale + c0 / BLOCK;
          for (int64_t b = 0; b < ncp; b += BLOCK) {
            const uint8_t code = a->block_2d ? codes_2d[b / BLOCK]
                                             : tf_nvfp4_block_scale(amax_of(abs_bits_max(tile[r] + b, BLOCK, 0)), a->s_enc);
            scale[b / BLOCK] = code;
            multiplier[b / BLOCK] = tf_nvfp4_encode_multiplier(code, a->s_enc);
          }
          encode_run(tile[r], multiplier, ncp, a->stochastic, a->seed, (uint64_t)((g + r) * a->cols_p + c0), codes);
          pack_run(codes, ncp, a->y + (g + r) * ld_y + c0 / 2);
        }
      }
      if (a->y_t) {
        for (int64_t b = 0; b < nc; b += BLOCK) {
          const int64_t nk = min64(BLOCK, nc - b);
          float mult_t[BLOCK];
          uint8_t code_t[BLOCK];
          columns16((const float(*)[TILE_COLS])tile, b, a->rht_t, (const uint8_t(*)[BLOCK])negative, t);
          if (a->block_2d) {
            for (int k = 0; k < BLOCK; ++k) code_t[k] = codes_2d[b / BLOCK];
          } else {
            int32_t bits[BLOCK];
            lane_abs_bits_max((const float(*)[BLOCK])t, bits);
            for (int k = 0; k < BLOCK; ++k) code_t[k] = tf_nvfp4_block_scale(amax_of(bits[k]), a->s_enc_t);
          }
          for (int k = 0; k < BLOCK; ++k) mult_t[k] = tf_nvfp4_encode_multiplier(code_t[k], a->s_enc_t);
          /* Value i of column c draws t_base + c * rows_p + g + i. */
          const uint64_t counter = t_base + (uint64_t)((c0 + b) * a->rows_p + g);
          if (a->stochastic) {
            uint32_t u24[BLOCK][BLOCK]; /* drawn in loops of their own, as encode_run does */
            for (int i = 0; i < BLOCK; ++i)
              for (int k = 0; k < BLOCK; ++k)
                u24[i][k] = tf_nvfp4_random24(a->seed, counter + (uint64_t)k * (uint64_t)a->rows_p + (uint64_t)i);
            for (int i = 0; i < BLOCK; ++i)
              for (int k = 0; k < BLOCK; ++k) codes_t[i][k] = encode_sr_lanes(t[i][k] * mult_t[k], u24[i][k]);
          } else {
            for (int i = 0; i < BLOCK; ++i)
              for (int k = 0; k < BLOCK; ++k) codes_t[i][k] = tf_e2m1_encode_rn(t[i][k] * mult_t[k]);
          }
          for (int64_t k = 0; k < nk; ++k) {
            const int64_t c = c0 + b + k;
            uint8_t *restrict out = a->y_t + c * ld_y_t + g / 2;
            a->scale_t[c * a->ld_scale_t + g / BLOCK] = code_t[k];
            for (int h = 0; h < BLOCK / 2; ++h) out[h] = (uint8_t)(codes_t[2 * h][k] | (codes_t[2 * h + 1][k] << 4));
          }
        }
      }
    }
  }
}

static void quantize_band(const quantize_args *a, int64_t row_begin, int64_t row_end) {
  quantize_band_body(a, row_begin, row_end);
}

static int amax_ok(float amax) { return amax >= 0.0f && amax <= FLT_MAX; }

/* A usage's data and scale pointers: both or neither. */
static int pair_ok(const void *data, const void *scale) { return (data == 0) == (scale == 0); }

tf_status tf_nvfp4_quantize(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x,
                            int64_t row_begin, int64_t row_end, int block_2d, int rht_t, int stochastic,
                            uint64_t seed, float amax, float amax_t, uint8_t *y, uint8_t *scale,
                            int64_t ld_scale, uint8_t *y_t, uint8_t *scale_t, int64_t ld_scale_t) {
  const tf_status s = check_input(x, dtype, rows, cols, ld_x, row_begin, row_end);
  if (s != TF_OK) return s;
  if ((block_2d != 0 && block_2d != 1) || (rht_t != 0 && rht_t != 1) || (stochastic != 0 && stochastic != 1))
    return TF_ERR_BAD_ARGUMENT;
  if (block_2d && (rht_t || amax_t != amax)) return TF_ERR_BAD_ARGUMENT; /* 2D blocks: one scale for both */
  if (!amax_ok(amax) || !amax_ok(amax_t)) return TF_ERR_BAD_ARGUMENT;
  if (!pair_ok(y, scale) || !pair_ok(y_t, scale_t)) return TF_ERR_NULL_POINTER;
  const int64_t rows_p = round_up16(rows), cols_p = round_up16(cols);
  if ((y && ld_scale < cols_p / BLOCK) || (y_t && ld_scale_t < rows_p / BLOCK)) return TF_ERR_BAD_SIZE;
  if ((y && !tf_mul_fits(rows, ld_scale)) || (y_t && !tf_mul_fits(cols, ld_scale_t))) return TF_ERR_OVERFLOW;
  if (row_end == row_begin || cols == 0 || (!y && !y_t)) return TF_OK;
  const quantize_args a = {x,     dtype, rows, cols, ld_x, rows_p, cols_p, block_2d, rht_t, stochastic, seed,
                           tf_nvfp4_global_scale(amax), tf_nvfp4_global_scale(amax_t), y, scale, ld_scale,
                           y_t,   scale_t, ld_scale_t};
#if TF_X86
  if (tf_nvfp4_avx512_usable()) {
    tf_nvfp4_quantize_band_avx512(&a, row_begin, row_end);
    return TF_OK;
  }
  if (tf_cpu_isa() >= TF_ISA_AVX2) {
    tf_nvfp4_quantize_band_avx2(&a, row_begin, row_end);
    return TF_OK;
  }
#endif
  quantize_band(&a, row_begin, row_end);
  return TF_OK;
}

/* ---- dequantize -------------------------------------------------------------------------------- */

typedef struct dequantize_args {
  const uint8_t *y;
  int64_t cols;
  const uint8_t *scale;
  int64_t ld_scale;
  float amax;
  void *x;
  tf_dtype dtype;
} dequantize_args;

TF_ISA_INLINE void dequantize_band_body(const dequantize_args *a, int64_t row_begin, int64_t row_end) {
  float value[DEQUANTIZE_CHUNK];
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t c0 = 0; c0 < a->cols; c0 += DEQUANTIZE_CHUNK) {
      const int64_t n = min64(DEQUANTIZE_CHUNK, a->cols - c0);
      const uint8_t *restrict y = a->y + (r * a->cols + c0) / 2;
      for (int64_t b = 0; b < n; b += BLOCK) {
        const float factor = tf_nvfp4_decode_factor(a->scale[r * a->ld_scale + (c0 + b) / BLOCK], a->amax);
        for (int k = 0; k < BLOCK / 2; ++k) {
          const uint8_t byte = y[(b >> 1) + k];
          value[b + 2 * k] = tf_e2m1_decode(byte & 15u) * factor;
          value[b + 2 * k + 1] = tf_e2m1_decode((uint8_t)(byte >> 4)) * factor;
        }
      }
      const int64_t at = r * a->cols + c0;
      if (a->dtype == TF_FLOAT32) {
        float *restrict x = (float *)a->x + at;
        for (int64_t c = 0; c < n; ++c) x[c] = value[c];
      } else if (a->dtype == TF_BFLOAT16) {
        uint16_t *restrict x = (uint16_t *)a->x + at;
        for (int64_t c = 0; c < n; ++c) x[c] = tf_f32_to_bf16(value[c]);
      } else {
        uint16_t *restrict x = (uint16_t *)a->x + at;
        for (int64_t c = 0; c < n; ++c) x[c] = tf_f32_to_f16(value[c]);
      }
    }
  }
}

TF_ISA_CLONES(dequantize_band, (const dequantize_args *a, int64_t row_begin, int64_t row_end),
              (a, row_begin, row_end))

tf_status tf_nvfp4_dequantize(const uint8_t *y, int64_t rows, int64_t cols, int64_t row_begin, int64_t row_end,
                              const uint8_t *scale, int64_t ld_scale, float amax, void *x, tf_dtype dtype) {
  if (!dtype_ok(dtype)) return TF_ERR_BAD_DTYPE;
  if (rows < 0 || cols < 0 || cols % BLOCK || !tf_range_ok(row_begin, row_end, rows)) return TF_ERR_BAD_SIZE;
  if (!tf_mul_fits(rows, cols) || !tf_mul_fits(rows * cols, tf_dtype_size(dtype))) return TF_ERR_OVERFLOW;
  if (ld_scale < cols / BLOCK) return TF_ERR_BAD_SIZE;
  if (!tf_mul_fits(rows, ld_scale)) return TF_ERR_OVERFLOW;
  if (!amax_ok(amax)) return TF_ERR_BAD_ARGUMENT;
  if (row_end == row_begin || cols == 0) return TF_OK;
  if (!y || !x || !scale) return TF_ERR_NULL_POINTER;
  const dequantize_args a = {y, cols, scale, ld_scale, amax, x, dtype};
  dequantize_band(&a, row_begin, row_end);
  return TF_OK;
}

/* ---- unpacking to E4M3 ------------------------------------------------------------------------- */

/* The E4M3 code of each E2M1 code: 0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negated. */
static const uint8_t E4M3_OF_E2M1[16] = {0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C,
                                         0x80, 0xB0, 0xB8, 0xBC, 0xC0, 0xC4, 0xC8, 0xCC};

static void unpack_portable(const uint8_t *y, int64_t begin, int64_t end, uint8_t *codes) {
  for (int64_t i = begin; i < end; ++i) {
    codes[2 * i] = E4M3_OF_E2M1[y[i] & 15];
    codes[2 * i + 1] = E4M3_OF_E2M1[y[i] >> 4];
  }
}

#if TF_X86
/* 32 bytes a step: each nibble looked up by vpshufb, the low and high codes interleaved in order. */
TF_TARGET_AVX2 static void unpack_avx2(const uint8_t *y, int64_t begin, int64_t end, uint8_t *codes) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)E4M3_OF_E2M1));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  int64_t i = begin;
  for (; end - i >= 32; i += 32) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)(y + i));
    const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(b, nibble));
    const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble));
    /* Per 128-bit lane: bytes 0-7 (and 16-23) in a0, 8-15 (and 24-31) in a1. */
    const __m256i a0 = _mm256_unpacklo_epi8(lo, hi), a1 = _mm256_unpackhi_epi8(lo, hi);
    _mm256_storeu_si256((__m256i *)(codes + 2 * i), _mm256_permute2x128_si256(a0, a1, 0x20));
    _mm256_storeu_si256((__m256i *)(codes + 2 * i + 32), _mm256_permute2x128_si256(a0, a1, 0x31));
  }
  unpack_portable(y, i, end, codes);
}
#endif

tf_status tf_nvfp4_unpack_e4m3(const uint8_t *y, int64_t begin, int64_t end, uint8_t *codes) {
  if (begin < 0 || end < begin || !tf_mul_fits(end, 2)) return TF_ERR_BAD_SIZE;
  if (end > begin && (!y || !codes)) return TF_ERR_NULL_POINTER;
#if TF_X86
  if (tf_cpu_isa() >= TF_ISA_AVX2) {
    unpack_avx2(y, begin, end, codes);
    return TF_OK;
  }
#endif
  unpack_portable(y, begin, end, codes);
  return TF_OK;
}
