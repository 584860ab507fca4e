/*
 * The FP8 quantizer kernels on AVX2 + F16C, 8 lanes at a time, 32 elements a step.
 *
 * The encoder is fp8_format.h's, lane-wise and without a table or a branch:
 *   - |v| is clamped to the largest finite value by vminps, which is what
 *     saturation means for numbers and Inf, and which lets NaN through;
 *   - normal results round the float32 bit pattern to mbits mantissa bits
 *     (ties to even), carrying into the exponent;
 *   - results below the smallest normal come from one float add: |v| + C,
 *     where the float32 step at C = 2^(24 - bias - mbits) is the FP8
 *     subnormal step, rounds |v| to the FP8 grid (ties to even) and leaves
 *     the code in the low bits of the sum;
 *   - packing the 32-bit codes to bytes saturates NaN's to 0x7F, and the
 *     signs are packed from the values themselves.
 * Each step gives the same result as the portable encoder for every input,
 * which tests/c/test_fp8_core.c checks over all 16-bit inputs and random
 * float32 bit patterns. float16 is widened by F16C's vcvtph2ps, which is
 * exact and quiets a signalling NaN like the portable conversion.
 *
 * Only whole steps and whole cast-transpose tiles are done here; the few elements
 * past them are handed to the portable kernels, which give the same bytes.
 */
#include "fp8_kernels.h"
#include "fp8_quantize.h"

#include "../common/cpu_features.h"

#if TF_X86
#include <immintrin.h>

#define TF_AVX2_INLINE static inline __attribute__((always_inline)) TF_TARGET_AVX2

/*
 * The codes of 8 values without their sign, less 2^mbits (the code of the
 * smallest normal value): -2^mbits..max_code - 2^mbits for numbers and Inf, a
 * value above 0x7F and below 0x7000 for NaN. The offset lets the sign of the
 * rounding sum choose between the normal and the subnormal result.
 */
TF_AVX2_INLINE __m256i magnitude8(__m256 v, uint32_t mbits, uint32_t bias, float max_value) {
  const uint32_t shift = 23u - mbits;
  const __m256 abs = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  /* vminps returns its second operand when either is NaN: numbers and Inf saturate, NaN stays. */
  const __m256i c = _mm256_castps_si256(_mm256_min_ps(_mm256_set1_ps(max_value), abs));
  /*
   * Normal: round to nearest even at bit `shift`, less the smallest normal. t < 0 exactly when
   * c lies more than half a step below the smallest normal; in that half step both results are 0.
   */
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(c, (int)shift), _mm256_set1_epi32(1));
  const uint32_t round_rebias = ((1u << (shift - 1u)) - 1u) - ((128u - bias) << 23);
  const __m256i t = _mm256_add_epi32(_mm256_add_epi32(c, _mm256_set1_epi32((int)round_rebias)), odd);
  const __m256i normal = _mm256_srai_epi32(t, (int)shift);
  /* Subnormal: the add rounds to the FP8 grid; the code is the sum's bits past C's. */
  const uint32_t magic_bits = (127u + 24u - bias - mbits) << 23;
  const __m256 magic = _mm256_castsi256_ps(_mm256_set1_epi32((int)magic_bits));
  const __m256 sum = _mm256_add_ps(_mm256_castsi256_ps(c), magic);
  const __m256i sub =
      _mm256_sub_epi32(_mm256_castps_si256(sum), _mm256_set1_epi32((int)(magic_bits + (1u << mbits))));
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(normal), _mm256_castsi256_ps(sub),
                                              _mm256_castsi256_ps(t)));
}

/* Mantissa bits of a format. The kernels pass the dtype and the format as constants, which fold. */
TF_AVX2_INLINE uint32_t format_mbits(tf_fp8_format f) { return f == TF_FP8_E4M3 ? 3u : 2u; }

TF_AVX2_INLINE __m256i magnitude8_of(__m256 v, tf_fp8_format f) {
  return f == TF_FP8_E4M3 ? magnitude8(v, 3u, 7u, TF_FP8_E4M3_MAX) : magnitude8(v, 2u, 15u, TF_FP8_E5M2_MAX);
}

/*
 * The 32 codes of v[0..3] (elements 0..31 in order) as 32 bytes. Packing to
 * 16 bits keeps the offset magnitudes, which then get 2^mbits back; packing to
 * bytes saturates a NaN's to 0x7F or above, and vpminub brings it to 0x7F. The
 * signs come from packing the values with signed saturation, which keeps each
 * one's sign bit.
 */
TF_AVX2_INLINE __m256i codes32(const __m256 v[4], tf_fp8_format f) {
  const __m256i offset = _mm256_set1_epi16((short)(1u << format_mbits(f)));
  const __m256i lo =
      _mm256_add_epi16(_mm256_packs_epi32(magnitude8_of(v[0], f), magnitude8_of(v[1], f)), offset);
  const __m256i hi =
      _mm256_add_epi16(_mm256_packs_epi32(magnitude8_of(v[2], f), magnitude8_of(v[3], f)), offset);
  const __m256i sign = _mm256_packs_epi16(
      _mm256_packs_epi32(_mm256_castps_si256(v[0]), _mm256_castps_si256(v[1])),
      _mm256_packs_epi32(_mm256_castps_si256(v[2]), _mm256_castps_si256(v[3])));
  const __m256i bytes = _mm256_or_si256(_mm256_min_epu8(_mm256_packus_epi16(lo, hi), _mm256_set1_epi8(0x7F)),
                                        _mm256_and_si256(sign, _mm256_set1_epi8((char)0x80)));
  /* The packs work per 128-bit lane: 4-byte groups 0 2 4 6 | 1 3 5 7 back in order. */
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* 8 elements from x + i as float32. */
TF_AVX2_INLINE __m256 load8_f32(const void *x, int64_t i) { return _mm256_loadu_ps((const float *)x + i); }
TF_AVX2_INLINE __m256 load8_bf16(const void *x, int64_t i) {
  const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
TF_AVX2_INLINE __m256 load8_f16(const void *x, int64_t i) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i)));
}

TF_AVX2_INLINE __m256 load8(const void *x, int64_t i, tf_dtype d) {
  return d == TF_FLOAT32 ? load8_f32(x, i) : d == TF_BFLOAT16 ? load8_bf16(x, i) : load8_f16(x, i);
}

TF_AVX2_INLINE __m256i abs_bits8(__m256 v) {
  return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7FFFFFFF));
}

TF_AVX2_INLINE uint32_t hmax_u32(__m256i m) {
  __m128i r = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  r = _mm_max_epu32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(1, 0, 3, 2)));
  r = _mm_max_epu32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(2, 3, 0, 1)));
  return (uint32_t)_mm_cvtsi128_si32(r);
}

/*
 * Encodes the 32 elements at x + i (scaled), folds their |x| bits into *amax
 * and returns their codes.
 */
TF_AVX2_INLINE __m256i encode32(const void *x, int64_t i, __m256 scale, __m256i *amax, tf_dtype d,
                                tf_fp8_format f) {
  __m256 v[4];
  for (int k = 0; k < 4; ++k) {
    const __m256 xk = load8(x, i + 8 * k, d);
    *amax = _mm256_max_epu32(*amax, abs_bits8(xk));
    v[k] = _mm256_mul_ps(xk, scale);
  }
  return codes32(v, f);
}

#define DEFINE_QUANTIZE(NAME, DTYPE, FORMAT)                                                 \
  static TF_TARGET_AVX2 uint32_t NAME(const void *x, int64_t begin, int64_t end, float scale, \
                                      uint8_t *y) {                                          \
    const __m256 s = _mm256_set1_ps(scale);                                                  \
    __m256i amax = _mm256_setzero_si256();                                                   \
    int64_t i = begin;                                                                       \
    for (; end - i >= 32; i += 32)                                                           \
      _mm256_storeu_si256((__m256i *)(y + i), encode32(x, i, s, &amax, DTYPE, FORMAT));      \
    const uint32_t tail = tf_fp8_kernels_portable.quantize[DTYPE][FORMAT](x, i, end, scale, y); \
    const uint32_t head = hmax_u32(amax);                                                    \
    return head > tail ? head : tail;                                                        \
  }

DEFINE_QUANTIZE(quantize_f32_e4m3, TF_FLOAT32, TF_FP8_E4M3)
DEFINE_QUANTIZE(quantize_f32_e5m2, TF_FLOAT32, TF_FP8_E5M2)
DEFINE_QUANTIZE(quantize_bf16_e4m3, TF_BFLOAT16, TF_FP8_E4M3)
DEFINE_QUANTIZE(quantize_bf16_e5m2, TF_BFLOAT16, TF_FP8_E5M2)
DEFINE_QUANTIZE(quantize_f16_e4m3, TF_FLOAT16, TF_FP8_E4M3)
DEFINE_QUANTIZE(quantize_f16_e5m2, TF_FLOAT16, TF_FP8_E5M2)

#define DEFINE_AMAX(NAME, DTYPE)                                                                \
  static TF_TARGET_AVX2 uint32_t NAME(const void *x, int64_t begin, int64_t end) {               \
    __m256i m0 = _mm256_setzero_si256(), m1 = _mm256_setzero_si256();                          \
    int64_t i = begin;                                                                          \
    for (; end - i >= 16; i += 16) {                                                            \
      m0 = _mm256_max_epu32(m0, abs_bits8(load8(x, i, DTYPE)));                                 \
      m1 = _mm256_max_epu32(m1, abs_bits8(load8(x, i + 8, DTYPE)));                             \
    }                                                                                           \
    const uint32_t tail = tf_fp8_kernels_portable.amax[DTYPE](x, i, end);                       \
    const uint32_t head = hmax_u32(_mm256_max_epu32(m0, m1));                                   \
    return head > tail ? head : tail;                                                           \
  }

DEFINE_AMAX(amax_f32, TF_FLOAT32)
DEFINE_AMAX(amax_bf16, TF_BFLOAT16)
DEFINE_AMAX(amax_f16, TF_FLOAT16)

/*
 * Transposes 16 rows of 32 bytes (row r in t[r]; bytes 0..15 and 16..31 are
 * two 16 x 16 blocks, one per 128-bit lane) with four rounds of interleaves:
 * afterwards out[j] holds column j of the first block in its low lane and
 * column 16 + j of the second in its high lane.
 */
TF_AVX2_INLINE void transpose_16x32(const __m256i t[16], __m256i out[16]) {
  __m256i s1[16], s2[16], s3[16];
  for (int k = 0; k < 8; ++k) { /* 16-bit units: rows 2k, 2k+1 of one column */
    s1[2 * k] = _mm256_unpacklo_epi8(t[2 * k], t[2 * k + 1]);
    s1[2 * k + 1] = _mm256_unpackhi_epi8(t[2 * k], t[2 * k + 1]);
  }
  for (int m = 0; m < 4; ++m) /* 32-bit units: rows 4m..4m+3; s2[4m + q] holds columns 4q..4q+3 */
    for (int h = 0; h < 2; ++h) {
      s2[4 * m + 2 * h] = _mm256_unpacklo_epi16(s1[4 * m + h], s1[4 * m + 2 + h]);
      s2[4 * m + 2 * h + 1] = _mm256_unpackhi_epi16(s1[4 * m + h], s1[4 * m + 2 + h]);
    }
  for (int p = 0; p < 2; ++p) /* 64-bit units: rows 8p..8p+7; s3[8p + t] holds columns 2t, 2t+1 */
    for (int q = 0; q < 4; ++q) {
      s3[8 * p + 2 * q] = _mm256_unpacklo_epi32(s2[8 * p + q], s2[8 * p + 4 + q]);
      s3[8 * p + 2 * q + 1] = _mm256_unpackhi_epi32(s2[8 * p + q], s2[8 * p + 4 + q]);
    }
  for (int k = 0; k < 8; ++k) { /* whole columns, rows 0..15 */
    out[2 * k] = _mm256_unpacklo_epi64(s3[k], s3[8 + k]);
    out[2 * k + 1] = _mm256_unpackhi_epi64(s3[k], s3[8 + k]);
  }
}

enum { TILE_ROWS = TF_FP8_CT_TILE };

/*
 * One tile of TILE_ROWS (64) rows by 32 * width columns at (r0, c0), width 1
 * or 2: each row is encoded into `width` registers, stored to y and kept in an
 * L1 buffer; the buffer is transposed 16 rows by 32 columns at a time into a
 * second one, from which each column goes out as one 64-byte run of its row
 * of y_t. With width 2, the rows of y get whole 64-byte runs too: no cache line
 * of y or y_t is left half written for a later tile, and with `stream` (set
 * when these runs are 32-byte aligned) they are written with non-temporal
 * stores, which skip reading the lines they overwrite and keep the large
 * outputs from evicting x's next rows.
 */
TF_AVX2_INLINE void store32(__m256i *p, __m256i v, int stream) {
  if (stream)
    _mm256_stream_si256(p, v);
  else
    _mm256_storeu_si256(p, v);
}

TF_AVX2_INLINE void cast_transpose_tile(const void *x, int64_t size, int64_t ld_x, int64_t r0,
                                        int64_t c0, int width, int stream, tf_dtype d,
                                        tf_fp8_format f, __m256 s, __m256i *amax, uint8_t *y, int64_t ld_y,
                                        uint8_t *y_t, int64_t ld_t) {
  __m256i tile[2][TILE_ROWS];        /* tile[k][r]: row r, columns 32k..32k+31 */
  __m256i tile_t[64][TILE_ROWS / 32]; /* tile_t[c]: column c, TILE_ROWS codes */
  for (int r = 0; r < TILE_ROWS; ++r) {
    /* The next tile's part of the row: the hardware prefetchers follow few of the 64 rows. */
    const char *next = (const char *)x + ((r0 + r) * ld_x + c0 + 32 * width) * size;
    for (int64_t line = 0; line < 32 * width * size; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
    for (int k = 0; k < width; ++k) {
      tile[k][r] = encode32(x, (r0 + r) * ld_x + c0 + 32 * k, s, amax, d, f);
      store32((__m256i *)(y + (r0 + r) * ld_y + c0) + k, tile[k][r], stream && width == 2);
    }
  }
  for (int k = 0; k < width; ++k)
    for (int h = 0; h < TILE_ROWS / 16; ++h) {
      __m256i col[16];
      transpose_16x32(tile[k] + 16 * h, col);
      for (int j = 0; j < 16; ++j) {
        _mm_store_si128((__m128i *)tile_t[32 * k + j] + h, _mm256_castsi256_si128(col[j]));
        _mm_store_si128((__m128i *)tile_t[32 * k + 16 + j] + h, _mm256_extracti128_si256(col[j], 1));
      }
    }
  for (int c = 0; c < 32 * width; ++c)
    for (int k = 0; k < TILE_ROWS / 32; ++k)
      store32((__m256i *)(y_t + (c0 + c) * ld_t + r0) + k, tile_t[c][k], stream);
}

/*
 * Whole tiles, 64 columns wide and then one 32 wide where 32 to 63 columns
 * are left; the ragged right and bottom edges go to the portable kernel as
 * blocks of their own.
 */
#define DEFINE_CAST_TRANSPOSE(NAME, DTYPE, FORMAT)                                               \
  static TF_TARGET_AVX2 uint32_t NAME(const void *x, int64_t ld_x, int64_t rows, int64_t cols,   \
                                      float scale, uint8_t *y, int64_t ld_y, uint8_t *y_t,       \
                                      int64_t ld_t) {                                            \
    const int64_t size = tf_dtype_size(DTYPE);                                                   \
    const int64_t full_rows = rows - rows % TILE_ROWS, wide_cols = cols - cols % 64;             \
    const int64_t full_cols = cols - cols % 32;                                                  \
    const __m256 s = _mm256_set1_ps(scale);                                                      \
    __m256i amax_v = _mm256_setzero_si256();                                                     \
    const int stream = (uintptr_t)y % 32 == 0 && ld_y % 32 == 0 && (uintptr_t)y_t % 32 == 0 &&   \
                       ld_t % 32 == 0;                                                           \
    for (int64_t r0 = 0; r0 < full_rows; r0 += TILE_ROWS) {                                      \
      for (int64_t c0 = 0; c0 < wide_cols; c0 += 64) {                                           \
        if (stream)                                                                              \
          cast_transpose_tile(x, size, ld_x, r0, c0, 2, 1, DTYPE, FORMAT, s, &amax_v, y, ld_y, y_t, ld_t); \
        else                                                                                     \
          cast_transpose_tile(x, size, ld_x, r0, c0, 2, 0, DTYPE, FORMAT, s, &amax_v, y, ld_y, y_t, ld_t); \
      }                                                                                          \
      if (wide_cols < full_cols)                                                                 \
        cast_transpose_tile(x, size, ld_x, r0, wide_cols, 1, stream, DTYPE, FORMAT, s, &amax_v, y, ld_y, \
                            y_t, ld_t);                                                          \
    }                                                                                            \
    if (stream) _mm_sfence(); /* the streamed stores are visible before the caller's next step */ \
    const tf_fp8_cast_transpose_fn edge = tf_fp8_kernels_portable.cast_transpose[DTYPE][FORMAT]; \
    uint32_t amax = hmax_u32(amax_v), a;                                                         \
    if (full_cols < cols) { /* right edge of the whole-tile rows */                              \
      a = edge((const char *)x + full_cols * size, ld_x, full_rows, cols - full_cols, scale,     \
               y + full_cols, ld_y, y_t + full_cols * ld_t, ld_t);                               \
      amax = a > amax ? a : amax;                                                                \
    }                                                                                            \
    if (full_rows < rows) { /* bottom rows, every column */                                      \
      a = edge((const char *)x + full_rows * ld_x * size, ld_x, rows - full_rows, cols, scale,   \
               y + full_rows * ld_y, ld_y, y_t + full_rows, ld_t);                               \
      amax = a > amax ? a : amax;                                                                \
    }                                                                                            \
    return amax;                                                                                 \
  }

DEFINE_CAST_TRANSPOSE(cast_transpose_f32_e4m3, TF_FLOAT32, TF_FP8_E4M3)
DEFINE_CAST_TRANSPOSE(cast_transpose_f32_e5m2, TF_FLOAT32, TF_FP8_E5M2)
DEFINE_CAST_TRANSPOSE(cast_transpose_bf16_e4m3, TF_BFLOAT16, TF_FP8_E4M3)
DEFINE_CAST_TRANSPOSE(cast_transpose_bf16_e5m2, TF_BFLOAT16, TF_FP8_E5M2)
DEFINE_CAST_TRANSPOSE(cast_transpose_f16_e4m3, TF_FLOAT16, TF_FP8_E4M3)
DEFINE_CAST_TRANSPOSE(cast_transpose_f16_e5m2, TF_FLOAT16, TF_FP8_E5M2)

static const tf_fp8_kernel_set avx2_kernels = {
    .quantize = {{quantize_f32_e4m3, quantize_f32_e5m2},
                 {quantize_bf16_e4m3, quantize_bf16_e5m2},
                 {quantize_f16_e4m3, quantize_f16_e5m2}},
    .amax = {amax_f32, amax_bf16, amax_f16},
    .cast_transpose = {{cast_transpose_f32_e4m3, cast_transpose_f32_e5m2},
                       {cast_transpose_bf16_e4m3, cast_transpose_bf16_e5m2},
                       {cast_transpose_f16_e4m3, cast_transpose_f16_e5m2}}};

const tf_fp8_kernel_set *const tf_fp8_kernels_avx2 = &avx2_kernels;

#else /* not x86-64 */

const tf_fp8_kernel_set *const tf_fp8_kernels_avx2 = 0;

#endif
