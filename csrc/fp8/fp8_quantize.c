#include "fp8_quantize.h"

#include "../common/cpu_features.h"
#include "../common/tf_checks.h"
#include "fp8_kernels.h"

/* Element loads as float32, one per input dtype. */
#define TF_LOAD_F32(p, i) (((const float *)(p))[i])
#define TF_LOAD_BF16(p, i) tf_bf16_to_f32(((const uint16_t *)(p))[i])
#define TF_LOAD_F16(p, i) tf_f16_to_f32(((const uint16_t *)(p))[i])

/* Element stores from float32, rounded to nearest even. */
#define TF_STORE_F32(p, i, v) (((float *)(p))[i] = (v))
#define TF_STORE_F32_BITS(p, i, v) (((uint32_t *)(p))[i] = tf_f32_bits(v))
#define TF_STORE_BF16(p, i, v) (((uint16_t *)(p))[i] = tf_f32_to_bf16(v))
#define TF_STORE_F16(p, i, v) (((uint16_t *)(p))[i] = tf_f32_to_f16(v))

#define TF_ABS_BITS(v) (tf_f32_bits(v) & 0x7FFFFFFFu)

typedef void (*dequantize_fn)(const uint8_t *, int64_t, int64_t, float, void *);

#define DEFINE_QUANTIZE(NAME, LOAD, ENCODE)                                             \
  static uint32_t NAME(const void *restrict x, int64_t begin, int64_t end, float scale, \
                       uint8_t *restrict y) {                                           \
    uint32_t amax = 0;                                                                  \
    for (int64_t i = begin; i < end; ++i) {                                             \
      const float v = LOAD(x, i);                                                       \
      const uint32_t a = TF_ABS_BITS(v);                                                \
      amax = a > amax ? a : amax;                                                       \
      y[i] = ENCODE(v * scale);                                                         \
    }                                                                                   \
    return amax;                                                                        \
  }

#define DEFINE_AMAX(NAME, LOAD)                                              \
  static uint32_t NAME(const void *restrict x, int64_t begin, int64_t end) { \
    uint32_t amax = 0;                                                       \
    for (int64_t i = begin; i < end; ++i) {                                  \
      const uint32_t a = TF_ABS_BITS(LOAD(x, i));                            \
      amax = a > amax ? a : amax;                                            \
    }                                                                        \
    return amax;                                                             \
  }

/*
 * Each output is one of 256 values, the code's decoded value times scale_inv rounded to the output
 * dtype: a call computes them once and then copies one per element with the active set's lookup
 * (AVX-512: 32 codes a step), from the same 256 values.
 */
#define DEFINE_DEQUANTIZE(NAME, DECODE, STORE, T, LOOKUP)                                  \
  static void NAME(const uint8_t *restrict y, int64_t begin, int64_t end, float scale_inv, \
                   void *restrict x) {                                                     \
    T table[256];                                                                          \
    for (int c = 0; c < 256; ++c) STORE(table, c, DECODE((uint8_t)c) * scale_inv);         \
    tf_fp8_kernels_active()->LOOKUP(y, begin, end, table, (T *)x);                         \
  }

void tf_fp8_lookup16_portable(const uint8_t *restrict y, int64_t begin, int64_t end,
                              const uint16_t *restrict table, uint16_t *restrict x) {
  for (int64_t i = begin; i < end; ++i) x[i] = table[y[i]];
}

void tf_fp8_lookup32_portable(const uint8_t *restrict y, int64_t begin, int64_t end,
                              const uint32_t *restrict table, uint32_t *restrict x) {
  for (int64_t i = begin; i < end; ++i) x[i] = table[y[i]];
}

/*
 * One TF_FP8_CT_TILE x TF_FP8_CT_TILE tile at a time: the tile is encoded once
 * into a small buffer from row-contiguous reads, written out row-major, then
 * written out transposed with contiguous stores into y_t's rows.
 */
#define DEFINE_CAST_TRANSPOSE(NAME, LOAD, ENCODE)                                              \
  static uint32_t NAME(const void *restrict x, int64_t ld_x, int64_t rows, int64_t cols,       \
                       float scale, uint8_t *restrict y, int64_t ld_y, uint8_t *restrict y_t,  \
                       int64_t ld_t) {                                                         \
    uint32_t amax = 0;                                                                         \
    uint8_t tile[TF_FP8_CT_TILE][TF_FP8_CT_TILE];                                              \
    for (int64_t r0 = 0; r0 < rows; r0 += TF_FP8_CT_TILE) {                                    \
      const int64_t nr = rows - r0 < TF_FP8_CT_TILE ? rows - r0 : TF_FP8_CT_TILE;              \
      for (int64_t c0 = 0; c0 < cols; c0 += TF_FP8_CT_TILE) {                                  \
        const int64_t nc = cols - c0 < TF_FP8_CT_TILE ? cols - c0 : TF_FP8_CT_TILE;            \
        for (int64_t r = 0; r < nr; ++r) {                                                     \
          const int64_t row = r0 + r;                                                          \
          for (int64_t c = 0; c < nc; ++c) {                                                   \
            const float v = LOAD(x, row * ld_x + c0 + c);                                      \
            const uint32_t a = TF_ABS_BITS(v);                                                 \
            amax = a > amax ? a : amax;                                                        \
            tile[r][c] = ENCODE(v * scale);                                                    \
          }                                                                                    \
          for (int64_t c = 0; c < nc; ++c) y[row * ld_y + c0 + c] = tile[r][c];                \
        }                                                                                      \
        for (int64_t c = 0; c < nc; ++c)                                                       \
          for (int64_t r = 0; r < nr; ++r) y_t[(c0 + c) * ld_t + r0 + r] = tile[r][c];         \
      }                                                                                        \
    }                                                                                          \
    return amax;                                                                               \
  }

/*
 * The quantize table kernels of 16-bit input, a block at a time: the largest |x| bit pattern in one loop
 * (which the compiler vectorizes), the lookups in another.
 */
enum { TABLE_BLOCK = 1024 };

static uint32_t quantize_table_16(const void *restrict x, int64_t begin, int64_t end,
                                  const uint8_t *restrict table, uint8_t *restrict y, tf_dtype d) {
  const uint16_t *restrict h = (const uint16_t *)x;
  uint16_t m = 0;
  for (int64_t b = begin; b < end; b += TABLE_BLOCK) {
    const int64_t e = end - b < TABLE_BLOCK ? end : b + TABLE_BLOCK;
    for (int64_t i = b; i < e; ++i) {
      const uint16_t a = h[i] & 0x7FFFu;
      m = a > m ? a : m;
    }
    for (int64_t i = b; i < e; ++i) y[i] = table[h[i]];
  }
  const uint32_t amax = tf_fp8_amax_of_16bit_max(m, d);
  return amax == UINT32_MAX ? tf_fp8_kernels_portable.amax[d](x, begin, end) : amax;
}

static uint32_t quantize_table_bf16(const void *x, int64_t begin, int64_t end, const uint8_t *table,
                                    uint8_t *y) {
  return quantize_table_16(x, begin, end, table, y, TF_BFLOAT16);
}
static uint32_t quantize_table_f16(const void *x, int64_t begin, int64_t end, const uint8_t *table,
                                   uint8_t *y) {
  return quantize_table_16(x, begin, end, table, y, TF_FLOAT16);
}

DEFINE_QUANTIZE(quantize_f32_e4m3, TF_LOAD_F32, tf_fp8_e4m3_encode)
DEFINE_QUANTIZE(quantize_f32_e5m2, TF_LOAD_F32, tf_fp8_e5m2_encode)
DEFINE_QUANTIZE(quantize_bf16_e4m3, TF_LOAD_BF16, tf_fp8_e4m3_encode)
DEFINE_QUANTIZE(quantize_bf16_e5m2, TF_LOAD_BF16, tf_fp8_e5m2_encode)
DEFINE_QUANTIZE(quantize_f16_e4m3, TF_LOAD_F16, tf_fp8_e4m3_encode)
DEFINE_QUANTIZE(quantize_f16_e5m2, TF_LOAD_F16, tf_fp8_e5m2_encode)

DEFINE_AMAX(amax_f32, TF_LOAD_F32)
DEFINE_AMAX(amax_bf16, TF_LOAD_BF16)
DEFINE_AMAX(amax_f16, TF_LOAD_F16)

DEFINE_DEQUANTIZE(dequantize_e4m3_f32, tf_fp8_e4m3_decode, TF_STORE_F32_BITS, uint32_t, lookup32)
DEFINE_DEQUANTIZE(dequantize_e5m2_f32, tf_fp8_e5m2_decode, TF_STORE_F32_BITS, uint32_t, lookup32)
DEFINE_DEQUANTIZE(dequantize_e4m3_bf16, tf_fp8_e4m3_decode, TF_STORE_BF16, uint16_t, lookup16)
DEFINE_DEQUANTIZE(dequantize_e5m2_bf16, tf_fp8_e5m2_decode, TF_STORE_BF16, uint16_t, lookup16)
DEFINE_DEQUANTIZE(dequantize_e4m3_f16, tf_fp8_e4m3_decode, TF_STORE_F16, uint16_t, lookup16)
DEFINE_DEQUANTIZE(dequantize_e5m2_f16, tf_fp8_e5m2_decode, TF_STORE_F16, uint16_t, lookup16)

DEFINE_CAST_TRANSPOSE(cast_transpose_f32_e4m3, TF_LOAD_F32, tf_fp8_e4m3_encode)
DEFINE_CAST_TRANSPOSE(cast_transpose_f32_e5m2, TF_LOAD_F32, tf_fp8_e5m2_encode)
DEFINE_CAST_TRANSPOSE(cast_transpose_bf16_e4m3, TF_LOAD_BF16, tf_fp8_e4m3_encode)
DEFINE_CAST_TRANSPOSE(cast_transpose_bf16_e5m2, TF_LOAD_BF16, tf_fp8_e5m2_encode)
DEFINE_CAST_TRANSPOSE(cast_transpose_f16_e4m3, TF_LOAD_F16, tf_fp8_e4m3_encode)
DEFINE_CAST_TRANSPOSE(cast_transpose_f16_e5m2, TF_LOAD_F16, tf_fp8_e5m2_encode)

const tf_fp8_kernel_set tf_fp8_kernels_portable = {
    .quantize = {{quantize_f32_e4m3, quantize_f32_e5m2},
                 {quantize_bf16_e4m3, quantize_bf16_e5m2},
                 {quantize_f16_e4m3, quantize_f16_e5m2}},
    .amax = {amax_f32, amax_bf16, amax_f16},
    .cast_transpose = {{cast_transpose_f32_e4m3, cast_transpose_f32_e5m2},
                       {cast_transpose_bf16_e4m3, cast_transpose_bf16_e5m2},
                       {cast_transpose_f16_e4m3, cast_transpose_f16_e5m2}},
    .quantize_table = {quantize_table_bf16, quantize_table_f16},
    .lookup16 = tf_fp8_lookup16_portable,
    .lookup32 = tf_fp8_lookup32_portable};

/* Indexed [dtype][format]; dtype and format are checked before indexing. */
static const dequantize_fn dequantize_table[3][2] = {
    {dequantize_e4m3_f32, dequantize_e5m2_f32},
    {dequantize_e4m3_bf16, dequantize_e5m2_bf16},
    {dequantize_e4m3_f16, dequantize_e5m2_f16}};

const tf_fp8_kernel_set *tf_fp8_kernels_active(void) {
  const tf_isa isa = tf_cpu_isa();
  if (tf_fp8_kernels_avx512 && isa >= TF_ISA_AVX512) return tf_fp8_kernels_avx512;
  if (tf_fp8_kernels_avx2 && isa >= TF_ISA_AVX2) return tf_fp8_kernels_avx2;
  return &tf_fp8_kernels_portable;
}

static int dtype_ok(tf_dtype dtype) {
  return dtype == TF_FLOAT32 || dtype == TF_BFLOAT16 || dtype == TF_FLOAT16;
}

static int format_ok(tf_fp8_format format) {
  return format == TF_FP8_E4M3 || format == TF_FP8_E5M2;
}

tf_status tf_fp8_quantize(const void *x, tf_dtype dtype, int64_t begin, int64_t end,
                          float scale, tf_fp8_format format, uint8_t *y, uint32_t *amax_bits) {
  if (!amax_bits) return TF_ERR_NULL_POINTER;
  if (!dtype_ok(dtype) || !format_ok(format)) return TF_ERR_BAD_DTYPE;
  if (begin < 0 || begin > end) return TF_ERR_BAD_SIZE;
  if (end > begin && (!x || !y)) return TF_ERR_NULL_POINTER;
  *amax_bits = tf_fp8_kernels_active()->quantize[dtype][format](x, begin, end, scale, y);
  return TF_OK;
}

tf_status tf_fp8_amax(const void *x, tf_dtype dtype, int64_t begin, int64_t end,
                      uint32_t *amax_bits) {
  if (!amax_bits) return TF_ERR_NULL_POINTER;
  if (!dtype_ok(dtype)) return TF_ERR_BAD_DTYPE;
  if (begin < 0 || begin > end) return TF_ERR_BAD_SIZE;
  if (end > begin && !x) return TF_ERR_NULL_POINTER;
  *amax_bits = tf_fp8_kernels_active()->amax[dtype](x, begin, end);
  return TF_OK;
}

tf_status tf_fp8_dequantize(const uint8_t *y, tf_fp8_format format, int64_t begin, int64_t end,
                            float scale_inv, void *x, tf_dtype dtype) {
  if (!dtype_ok(dtype) || !format_ok(format)) return TF_ERR_BAD_DTYPE;
  if (begin < 0 || begin > end) return TF_ERR_BAD_SIZE;
  if (end > begin && (!x || !y)) return TF_ERR_NULL_POINTER;
  dequantize_table[dtype][format](y, begin, end, scale_inv, x);
  return TF_OK;
}

tf_status tf_fp8_cast_transpose(const void *x, tf_dtype dtype, int64_t rows, int64_t cols,
                                int64_t x_row_stride, int64_t row_begin, int64_t row_end,
                                float scale, tf_fp8_format format, uint8_t *y, uint8_t *y_t,
                                uint32_t *amax_bits) {
  if (!amax_bits) return TF_ERR_NULL_POINTER;
  if (!dtype_ok(dtype) || !format_ok(format)) return TF_ERR_BAD_DTYPE;
  if (rows < 0 || cols < 0 || x_row_stride < cols) return TF_ERR_BAD_SIZE;
  if (!tf_range_ok(row_begin, row_end, rows)) return TF_ERR_BAD_SIZE;
  /* The largest index read is (rows - 1) * x_row_stride + cols - 1; written, rows * cols - 1. */
  if (!tf_mul_fits(rows, x_row_stride) || !tf_mul_fits(rows, cols)) return TF_ERR_OVERFLOW;
  if (!tf_mul_fits(rows * x_row_stride, tf_dtype_size(dtype))) return TF_ERR_OVERFLOW;
  if (row_end > row_begin && cols > 0 && (!x || !y || !y_t)) return TF_ERR_NULL_POINTER;
  if (row_end == row_begin || cols == 0) {
    *amax_bits = 0;
    return TF_OK;
  }
  /* The band as a block of its own: its first row, its rows of y and its columns of y_t. */
  const char *band = (const char *)x + row_begin * x_row_stride * tf_dtype_size(dtype);
  *amax_bits = tf_fp8_kernels_active()->cast_transpose[dtype][format](
      band, x_row_stride, row_end - row_begin, cols, scale, y + row_begin * cols, cols,
      y_t + row_begin, rows);
  return TF_OK;
}

static int table_dtype_ok(tf_dtype dtype) { return dtype == TF_BFLOAT16 || dtype == TF_FLOAT16; }

/* On the avx512 tier the fast encoder outruns a lookup (csrc/README.md): no table there. */
int tf_fp8_table_pays(tf_dtype dtype, int64_t elements) {
  return table_dtype_ok(dtype) && elements >= TF_FP8_TABLE_MIN_ELEMENTS &&
         tf_fp8_kernels_active() != tf_fp8_kernels_avx512;
}

tf_status tf_fp8_table_build(tf_dtype dtype, float scale, tf_fp8_format format, int64_t begin,
                             int64_t end, uint8_t *table) {
  if (!table_dtype_ok(dtype) || !format_ok(format)) return TF_ERR_BAD_DTYPE;
  if (!tf_range_ok(begin, end, TF_FP8_TABLE_ENTRIES)) return TF_ERR_BAD_SIZE;
  if (end > begin && !table) return TF_ERR_NULL_POINTER;
  /* The bit patterns themselves, a block at a time, through the quantize kernel in force. */
  enum { BLOCK = 1024 };
  uint16_t bits[BLOCK];
  const tf_fp8_quantize_fn encode = tf_fp8_kernels_active()->quantize[dtype][format];
  for (int64_t b = begin; b < end; b += BLOCK) {
    const int64_t n = end - b < BLOCK ? end - b : BLOCK;
    for (int64_t k = 0; k < n; ++k) bits[k] = (uint16_t)(b + k);
    encode(bits, 0, n, scale, table + b);
  }
  return TF_OK;
}

tf_status tf_fp8_quantize_table(const void *x, tf_dtype dtype, int64_t begin, int64_t end,
                                const uint8_t *table, uint8_t *y, uint32_t *amax_bits) {
  if (!amax_bits) return TF_ERR_NULL_POINTER;
  if (!table_dtype_ok(dtype)) return TF_ERR_BAD_DTYPE;
  if (begin < 0 || begin > end) return TF_ERR_BAD_SIZE;
  if (end > begin && (!x || !y || !table)) return TF_ERR_NULL_POINTER;
  *amax_bits = tf_fp8_kernels_active()->quantize_table[dtype - TF_BFLOAT16](x, begin, end, table, y);
  return TF_OK;
}
