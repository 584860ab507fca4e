#include "fp8_block.h"

#include <float.h>

#include "../common/tf_checks.h"
#include "../common/tf_isa_clones.h"
#include "fp8_block_format.h"
#include "mxfp8_band.h"

/*
 * A band is worked in tiles of one block of rows by up to TILE_FLOATS / (block rows) columns, widened
 * to float32 once (64 KiB on the stack), so rowwise and columnwise blocks come from one read of x.
 */
enum { TILE_FLOATS = 16384 };
#define MX_TILE_COLS (TILE_FLOATS / TF_MXFP8_BLOCK)
#define BLOCK_TILE_COLS (TILE_FLOATS / TF_FP8_BLOCK_LEN)

static int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

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

/* max |f[i]| over [0, n), NaN dropped. */
TF_ISA_INLINE float row_amax(const float *restrict f, int64_t n) {
  int32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t a = tf_abs_bits_no_nan(f[i]);
    m = a > m ? a : m;
  }
  return tf_f32_from_bits((uint32_t)m);
}

/* m[c] = max(m[c], |f[c]|) for c in [0, n), NaN dropped: the column amaxes, a row at a time. */
TF_ISA_INLINE void column_amax(const float *restrict f, int64_t n, int32_t *restrict m) {
  for (int64_t c = 0; c < n; ++c) {
    const int32_t a = tf_abs_bits_no_nan(f[c]);
    m[c] = a > m[c] ? a : m[c];
  }
}

/* y[i] = fp8(f[i] * multiplier) for i in [0, n). */
TF_ISA_INLINE void encode(const float *restrict f, int64_t n, float multiplier, tf_fp8_format format,
                          uint8_t *restrict y) {
  if (format == TF_FP8_E4M3) {
    for (int64_t i = 0; i < n; ++i) y[i] = tf_fp8_e4m3_encode(f[i] * multiplier);
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = tf_fp8_e5m2_encode(f[i] * multiplier);
  }
}

/* y[c] = fp8(f[c] * multiplier[c]) for c in [0, n): a row under per-column (or per-element) scales. */
TF_ISA_INLINE void encode_columns(const float *restrict f, int64_t n, const float *restrict multiplier,
                                  tf_fp8_format format, uint8_t *restrict y) {
  if (format == TF_FP8_E4M3) {
    for (int64_t c = 0; c < n; ++c) y[c] = tf_fp8_e4m3_encode(f[c] * multiplier[c]);
  } else {
    for (int64_t c = 0; c < n; ++c) y[c] = tf_fp8_e5m2_encode(f[c] * multiplier[c]);
  }
}

/* ---- MXFP8 ------------------------------------------------------------------------------------- */

TF_ISA_INLINE void mx_band_body(const tf_mxfp8_args *a, int64_t row_begin, int64_t row_end) {
  float tile[TF_MXFP8_BLOCK][MX_TILE_COLS];
  int32_t amax[MX_TILE_COLS];
  float multiplier[MX_TILE_COLS];
  /* Row groups start on a 32-row boundary so that they are the columnwise blocks. */
  for (int64_t g = row_begin; g < row_end; g = (g / TF_MXFP8_BLOCK + 1) * TF_MXFP8_BLOCK) {
    const int64_t nr = min64(row_end, (g / TF_MXFP8_BLOCK + 1) * TF_MXFP8_BLOCK) - g;
    for (int64_t c0 = 0; c0 < a->cols; c0 += MX_TILE_COLS) {
      const int64_t nc = min64(MX_TILE_COLS, a->cols - c0);
      for (int64_t r = 0; r < nr; ++r) load_f32(a->x, a->dtype, (g + r) * a->ld_x + c0, nc, tile[r]);
      if (a->y) {
        for (int64_t r = 0; r < nr; ++r) {
          /* Each element's multiplier spelled out, so that the row encodes as one vectorized loop. */
          for (int64_t b = 0; b < nc; b += TF_MXFP8_BLOCK) {
            const int64_t n = min64(TF_MXFP8_BLOCK, nc - b);
            const uint8_t code = tf_mxfp8_scale_code(row_amax(tile[r] + b, n), a->format);
            a->scale[(g + r) * a->ld_scale + (c0 + b) / TF_MXFP8_BLOCK] = code;
            const float m = tf_e8m0_quant_multiplier(code);
            for (int i = 0; i < TF_MXFP8_BLOCK; ++i) multiplier[b + i] = m;
          }
          encode_columns(tile[r], nc, multiplier, a->format, a->y + (g + r) * a->cols + c0);
        }
      }
      if (a->y_col) {
        for (int64_t c = 0; c < nc; ++c) amax[c] = 0;
        for (int64_t r = 0; r < nr; ++r) column_amax(tile[r], nc, amax);
        for (int64_t c = 0; c < nc; ++c) {
          const uint8_t code = tf_mxfp8_scale_code(tf_f32_from_bits((uint32_t)amax[c]), a->format);
          a->scale_col[g / TF_MXFP8_BLOCK * a->ld_scale_col + c0 + c] = code;
          multiplier[c] = tf_e8m0_quant_multiplier(code);
        }
        for (int64_t r = 0; r < nr; ++r)
          encode_columns(tile[r], nc, multiplier, a->format, a->y_col + (g + r) * a->cols + c0);
      }
    }
  }
}

TF_ISA_CLONES(mx_band, (const tf_mxfp8_args *a, int64_t row_begin, int64_t row_end), (a, row_begin, row_end))

static int dtype_ok(tf_dtype dtype) {
  return dtype == TF_FLOAT32 || dtype == TF_BFLOAT16 || dtype == TF_FLOAT16;
}

static int format_ok(tf_fp8_format format) { return format == TF_FP8_E4M3 || format == TF_FP8_E5M2; }

/* A band that feeds blocks of `block` rows starts on a block boundary and ends on one or at rows
 * (or is empty). */
static int band_aligned(int64_t row_begin, int64_t row_end, int64_t rows, int64_t block) {
  return row_begin == row_end || (row_begin % block == 0 && (row_end % block == 0 || row_end == rows));
}

/* The checks every quantizer shares: x's sizes and the band. */
static tf_status check_input(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x,
                             int64_t row_begin, int64_t row_end) {
  if (!dtype_ok(dtype)) return TF_ERR_BAD_DTYPE;
  if (rows < 0 || cols < 0 || ld_x < cols) return TF_ERR_BAD_SIZE;
  if (!tf_range_ok(row_begin, row_end, rows)) return TF_ERR_BAD_SIZE;
  if (!tf_mul_fits(rows, ld_x) || !tf_mul_fits(rows * ld_x, tf_dtype_size(dtype))) return TF_ERR_OVERFLOW;
  if (!tf_mul_fits(rows, cols)) return TF_ERR_OVERFLOW;
  if (row_end > row_begin && cols > 0 && !x) return TF_ERR_NULL_POINTER;
  return TF_OK;
}

/* A usage's data and scale pointers: both or neither. */
static int pair_ok(const void *data, const void *scale) { return (data == 0) == (scale == 0); }

tf_status tf_mxfp8_quantize(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x,
                            int64_t row_begin, int64_t row_end, tf_fp8_format format, uint8_t *y,
                            uint8_t *scale, int64_t ld_scale, uint8_t *y_col, uint8_t *scale_col,
                            int64_t ld_scale_col) {
  const tf_status s = check_input(x, dtype, rows, cols, ld_x, row_begin, row_end);
  if (s != TF_OK) return s;
  if (!format_ok(format)) return TF_ERR_BAD_DTYPE;
  if (!pair_ok(y, scale) || !pair_ok(y_col, scale_col)) return TF_ERR_NULL_POINTER;
  if (y && ld_scale < ceil_div(cols, TF_MXFP8_BLOCK)) return TF_ERR_BAD_SIZE;
  if (y && !tf_mul_fits(rows, ld_scale)) return TF_ERR_OVERFLOW;
  if (y_col) {
    if (ld_scale_col < cols || !band_aligned(row_begin, row_end, rows, TF_MXFP8_BLOCK)) return TF_ERR_BAD_SIZE;
    if (!tf_mul_fits(ceil_div(rows, TF_MXFP8_BLOCK), ld_scale_col)) return TF_ERR_OVERFLOW;
  }
  if (row_end == row_begin || cols == 0 || (!y && !y_col)) return TF_OK;
  const tf_mxfp8_args a = {x, dtype, rows, cols, ld_x, format, y, scale, ld_scale, y_col, scale_col, ld_scale_col};
#if TF_X86
  const tf_isa isa = tf_cpu_isa();
  if (isa >= TF_ISA_AVX2) {
    (isa >= TF_ISA_AVX512 ? tf_mxfp8_band_avx512 : tf_mxfp8_band_avx2)(&a, row_begin, row_end);
    return TF_OK;
  }
#endif
  mx_band(&a, row_begin, row_end);
  return TF_OK;
}

/* ---- Float8 block scaling ---------------------------------------------------------------------- */

typedef struct block_args {
  const void *x;
  tf_dtype dtype;
  int64_t rows, cols, ld_x;
  tf_fp8_format format;
  int block_dim;
  float epsilon;
  int pow2;
  uint8_t *y;
  float *scale_inv;
  int64_t ld_scale;
  uint8_t *y_t;
  float *scale_inv_t;
  int64_t ld_scale_t;
} block_args;

/* y_t[c * ld_t + r] = codes[r][c] for the nr x nc tile. */
TF_ISA_INLINE void transpose_codes(const uint8_t codes[TF_FP8_BLOCK_LEN][BLOCK_TILE_COLS], int64_t nr,
                                   int64_t nc, uint8_t *restrict y_t, int64_t ld_t) {
  for (int64_t c = 0; c < nc; ++c)
    for (int64_t r = 0; r < nr; ++r) y_t[c * ld_t + r] = codes[r][c];
}

TF_ISA_INLINE void block_band_body(const block_args *a, int64_t row_begin, int64_t row_end) {
  float tile[TF_FP8_BLOCK_LEN][BLOCK_TILE_COLS];
  uint8_t codes[TF_FP8_BLOCK_LEN][BLOCK_TILE_COLS];
  int32_t amax[BLOCK_TILE_COLS];
  float multiplier[BLOCK_TILE_COLS];
  const float fp8_max = tf_fp8_max(a->format);
  const float input_max = tf_block_input_max(a->dtype);
  for (int64_t g = row_begin; g < row_end; g = (g / TF_FP8_BLOCK_LEN + 1) * TF_FP8_BLOCK_LEN) {
    const int64_t nr = min64(row_end, (g / TF_FP8_BLOCK_LEN + 1) * TF_FP8_BLOCK_LEN) - g;
    const int64_t mb = g / TF_FP8_BLOCK_LEN;
    for (int64_t c0 = 0; c0 < a->cols; c0 += BLOCK_TILE_COLS) {
      const int64_t nc = min64(BLOCK_TILE_COLS, a->cols - c0);
      const int64_t kb = c0 / TF_FP8_BLOCK_LEN;
      uint8_t *y_t = a->y_t ? a->y_t + c0 * a->rows + g : 0;
      for (int64_t r = 0; r < nr; ++r) load_f32(a->x, a->dtype, (g + r) * a->ld_x + c0, nc, tile[r]);
      if (a->block_dim == 2) {
        uint32_t m = 0;
        for (int64_t r = 0; r < nr; ++r) {
          const uint32_t row = tf_f32_bits(row_amax(tile[r], nc));
          m = row > m ? row : m;
        }
        const float scale = tf_fp8_block_scale(tf_f32_from_bits(m), fp8_max, a->epsilon, a->pow2, input_max);
        const float inv = 1.0f / scale;
        if (a->y) a->scale_inv[mb * a->ld_scale + kb] = inv;
        if (a->y_t) a->scale_inv_t[kb * a->ld_scale_t + mb] = inv;
        for (int64_t r = 0; r < nr; ++r) {
          encode(tile[r], nc, scale, a->format, codes[r]);
          if (a->y)
            for (int64_t c = 0; c < nc; ++c) a->y[(g + r) * a->cols + c0 + c] = codes[r][c];
        }
        if (y_t) transpose_codes((const uint8_t(*)[BLOCK_TILE_COLS])codes, nr, nc, y_t, a->rows);
        continue;
      }
      if (a->y) {
        for (int64_t r = 0; r < nr; ++r) {
          const float scale = tf_fp8_block_scale(row_amax(tile[r], nc), fp8_max, a->epsilon, a->pow2, input_max);
          a->scale_inv[kb * a->ld_scale + g + r] = 1.0f / scale;
          encode(tile[r], nc, scale, a->format, a->y + (g + r) * a->cols + c0);
        }
      }
      if (y_t) {
        for (int64_t c = 0; c < nc; ++c) amax[c] = 0;
        for (int64_t r = 0; r < nr; ++r) column_amax(tile[r], nc, amax);
        for (int64_t c = 0; c < nc; ++c) {
          multiplier[c] = tf_fp8_block_scale(tf_f32_from_bits((uint32_t)amax[c]), fp8_max, a->epsilon, a->pow2, input_max);
          a->scale_inv_t[mb * a->ld_scale_t + c0 + c] = 1.0f / multiplier[c];
        }
        for (int64_t r = 0; r < nr; ++r) encode_columns(tile[r], nc, multiplier, a->format, codes[r]);
        transpose_codes((const uint8_t(*)[BLOCK_TILE_COLS])codes, nr, nc, y_t, a->rows);
      }
    }
  }
}

TF_ISA_CLONES(block_band, (const block_args *a, int64_t row_begin, int64_t row_end), (a, row_begin, row_end))

tf_status tf_fp8_block_quantize(const void *x, tf_dtype dtype, int64_t rows, int64_t cols, int64_t ld_x,
                                int64_t row_begin, int64_t row_end, tf_fp8_format format, int block_dim,
                                float epsilon, int pow2, uint8_t *y, float *scale_inv, int64_t ld_scale,
                                uint8_t *y_t, float *scale_inv_t, int64_t ld_scale_t) {
  const tf_status s = check_input(x, dtype, rows, cols, ld_x, row_begin, row_end);
  if (s != TF_OK) return s;
  if (!format_ok(format)) return TF_ERR_BAD_DTYPE;
  if (block_dim != 1 && block_dim != 2) return TF_ERR_BAD_ARGUMENT;
  if (!(epsilon >= 0.0f && epsilon <= FLT_MAX)) return TF_ERR_BAD_ARGUMENT;
  if (!pair_ok(y, scale_inv) || !pair_ok(y_t, scale_inv_t)) return TF_ERR_NULL_POINTER;
  const int64_t row_blocks = ceil_div(rows, TF_FP8_BLOCK_LEN), col_blocks = ceil_div(cols, TF_FP8_BLOCK_LEN);
  if (y) {
    const int64_t needed = block_dim == 1 ? rows : col_blocks;
    if (ld_scale < needed) return TF_ERR_BAD_SIZE;
    if (!tf_mul_fits(block_dim == 1 ? col_blocks : row_blocks, ld_scale)) return TF_ERR_OVERFLOW;
  }
  if (y_t) {
    const int64_t needed = block_dim == 1 ? cols : row_blocks;
    if (ld_scale_t < needed) return TF_ERR_BAD_SIZE;
    if (!tf_mul_fits(block_dim == 1 ? row_blocks : col_blocks, ld_scale_t)) return TF_ERR_OVERFLOW;
  }
  if ((y_t || block_dim == 2) && !band_aligned(row_begin, row_end, rows, TF_FP8_BLOCK_LEN)) return TF_ERR_BAD_SIZE;
  if (row_end == row_begin || cols == 0 || (!y && !y_t)) return TF_OK;
  const block_args a = {x,  dtype,  rows, cols,      ld_x,     format, block_dim,  epsilon,
                        pow2, y, scale_inv, ld_scale, y_t, scale_inv_t, ld_scale_t};
  block_band(&a, row_begin, row_end);
  return TF_OK;
}

/* ---- dequantize -------------------------------------------------------------------------------- */

typedef struct dequantize_args {
  const uint8_t *y;
  tf_fp8_format format;
  int64_t cols;
  const void *scale;
  tf_block_scale_kind kind;
  int64_t scale_cols, block_rows, block_cols;
  int scale_transposed;
  void *x;
  tf_dtype dtype;
} dequantize_args;

enum { DEQUANTIZE_CHUNK = 1024 };

TF_ISA_INLINE float scale_at(const dequantize_args *a, int64_t i, int64_t j) {
  const int64_t index = a->scale_transposed ? j * a->scale_cols + i : i * a->scale_cols + j;
  return a->kind == TF_BLOCK_SCALE_E8M0 ? tf_e8m0_decode(((const uint8_t *)a->scale)[index])
                                        : ((const float *)a->scale)[index];
}

TF_ISA_INLINE void dequantize_band_body(const dequantize_args *a, int64_t row_begin, int64_t row_end) {
  float scale[DEQUANTIZE_CHUNK];
  float value[DEQUANTIZE_CHUNK];
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t c0 = 0; c0 < a->cols; c0 += DEQUANTIZE_CHUNK) {
      const int64_t n = min64(DEQUANTIZE_CHUNK, a->cols - c0);
      const uint8_t *restrict y = a->y + r * a->cols + c0;
      if (a->block_cols == 1 && !a->scale_transposed) { /* a scale per column: a contiguous run of them */
        const int64_t at = r / a->block_rows * a->scale_cols + c0;
        if (a->kind == TF_BLOCK_SCALE_E8M0) {
          const uint8_t *restrict codes = (const uint8_t *)a->scale + at;
          for (int64_t c = 0; c < n; ++c) scale[c] = tf_e8m0_decode(codes[c]);
        } else {
          const float *restrict values = (const float *)a->scale + at;
          for (int64_t c = 0; c < n; ++c) scale[c] = values[c];
        }
      } else {
        for (int64_t c = 0; c < n;) { /* one scale per run of a block's columns: no division per element */
          const int64_t j = (c0 + c) / a->block_cols, end = min64(n, (j + 1) * a->block_cols - c0);
          const float s = scale_at(a, r / a->block_rows, j);
          for (; c < end; ++c) scale[c] = s;
        }
      }
      if (a->format == TF_FP8_E4M3) {
        for (int64_t c = 0; c < n; ++c) value[c] = tf_fp8_e4m3_decode(y[c]) * scale[c];
      } else {
        for (int64_t c = 0; c < n; ++c) value[c] = tf_fp8_e5m2_decode(y[c]) * scale[c];
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

tf_status tf_block_dequantize(const uint8_t *y, tf_fp8_format format, int64_t rows, int64_t cols,
                              int64_t row_begin, int64_t row_end, const void *scale,
                              tf_block_scale_kind kind, int64_t scale_rows, int64_t scale_cols,
                              int64_t block_rows, int64_t block_cols, int scale_transposed, void *x,
                              tf_dtype dtype) {
  if (!format_ok(format) || !dtype_ok(dtype)) return TF_ERR_BAD_DTYPE;
  if (kind != TF_BLOCK_SCALE_E8M0 && kind != TF_BLOCK_SCALE_F32) return TF_ERR_BAD_ARGUMENT;
  if (rows < 0 || cols < 0 || scale_rows < 0 || scale_cols < 0 || block_rows < 1 || block_cols < 1)
    return TF_ERR_BAD_SIZE;
  if (!tf_range_ok(row_begin, row_end, rows)) return TF_ERR_BAD_SIZE;
  if (!tf_mul_fits(rows, cols) || !tf_mul_fits(rows * cols, tf_dtype_size(dtype))) return TF_ERR_OVERFLOW;
  if (!tf_mul_fits(scale_rows, scale_cols)) return TF_ERR_OVERFLOW;
  const int64_t row_blocks = ceil_div(rows, block_rows), col_blocks = ceil_div(cols, block_cols);
  const int64_t need_rows = scale_transposed ? col_blocks : row_blocks;
  const int64_t need_cols = scale_transposed ? row_blocks : col_blocks;
  if (scale_rows < need_rows || scale_cols < need_cols) return TF_ERR_BAD_SIZE;
  if (row_end == row_begin || cols == 0) return TF_OK;
  if (!y || !x || !scale) return TF_ERR_NULL_POINTER;
  const dequantize_args a = {y, format, cols, scale, kind, scale_cols, block_rows, block_cols,
                             scale_transposed, x, dtype};
  dequantize_band(&a, row_begin, row_end);
  return TF_OK;
}
