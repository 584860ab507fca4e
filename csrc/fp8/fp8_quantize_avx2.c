/*
 * The FP8 quantizer kernels on AVX2 + F16C, 8 lanes at a time, 32 elements a step.
 *
 * Two lane-wise encoders, neither with a table or a branch, and a kernel picks one per call:
 *
 * The fast one, for a positive finite scale (the scales of every FP8 recipe), works on |x| * scale
 * and takes each element's sign from x (which x * scale keeps when scale > 0):
 *   - |v| is clamped to the largest finite value by vminps, which is what saturation means for
 *     numbers and Inf, and which lets NaN through;
 *   - one float add and one subtract of a magic number M = 2^(e + 23 - mbits), e the exponent of
 *     |v| but at least the smallest normal one's, round |v| to the FP8 grid (ties to even, the
 *     subnormal steps included: below the smallest normal value M stays put);
 *   - the rounded value is exact in float16, so F16C's vcvtps2ph turns it into bits from which
 *     the code is a shift: E5M2 is float16's upper byte, and E4M3, scaled by 2^-8 beforehand
 *     (folded into the scale), lines up with float16 bits 7..14, subnormals included;
 *   - bfloat16 and float16 amax is taken on the 16-bit patterns, which order like the values.
 * The generic one serves any other scale (zero, negative, Inf, NaN, or too small to scale by
 * 2^-8), where x * scale itself must be encoded:
 *   - |v| is clamped as above;
 *   - normal results round the float32 bit pattern to mbits mantissa bits (ties to even),
 *     carrying into the exponent;
 *   - results below the smallest normal come from one float add: |v| + C, where the float32
 *     step at C = 2^(24 - bias - mbits) is the FP8 subnormal step, rounds |v| to the FP8 grid
 *     (ties to even) and leaves the code in the low bits of the sum.
 * Both pack the codes to bytes with saturating packs that send NaN to 0x7F, and the signs from
 * the values themselves. Each gives the same result as the portable encoder for every input,
 * which tests/c/test_fp8_core.c checks over all 16-bit inputs and random float32 bit patterns,
 * with scales that take either encoder. float16 is widened by F16C's vcvtph2ps, which is exact
 * and quiets a signalling NaN like the portable conversion.
 *
 * The quantize table kernels (tf_fp8_table_build) run the same loop with a third mode in place
 * of an encoder: one scalar lookup an element, the amax on the 16-bit patterns as above.
 * Cast-transpose has no table kernels: its time goes to the tiles, not to the encoder.
 *
 * Only whole steps and whole cast-transpose tiles are done here; the few elements
 * past them are handed to the portable kernels, which give the same bytes.
 */
#include <float.h>
#include <string.h>

#include "fp8_kernels.h"
#include "fp8_quantize.h"

#include "../common/cpu_features.h"

#if TF_X86
#include "fp8_encode_avx2.h"

/* ---- The fast encoder's 32-element steps (its rounding: fp8_encode_avx2.h). ---- */

/* The kernels pass this as a constant, so each kernel is compiled once per encoder (or table). */
enum { GENERIC = 0, FAST = 1, TABLE = 2 };

/*
 * Fast-encodes the 32 elements at x + i (s: the fast multiplier) and folds |x| into *amax:
 * float32 lanes for float32 input, 16-bit lanes for bfloat16 and float16 (amax16_bits reads them).
 */
TF_AVX2_INLINE __m256i fast_encode32(const void *x, int64_t i, __m256 s, __m256i *amax, tf_dtype d,
                                     tf_fp8_format f) {
  const __m256i sign_bit = _mm256_set1_epi8((char)0x80);
  __m128i h[4];
  if (d == TF_FLOAT32) {
    __m256i xk[4];
    for (int k = 0; k < 4; ++k) {
      xk[k] = _mm256_loadu_si256((const __m256i *)((const float *)x + i + 8 * k));
      const __m256i a = _mm256_and_si256(xk[k], _mm256_set1_epi32(0x7FFFFFFF));
      *amax = _mm256_max_epu32(*amax, a);
      h[k] = fast_round8(_mm256_mul_ps(_mm256_castsi256_ps(a), s), f);
    }
    /* Signed packs keep each sign bit; per 128-bit lane they leave 4-byte groups 0 2 4 6 | 1 3 5 7. */
    const __m256i sign = _mm256_packs_epi16(_mm256_packs_epi32(xk[0], xk[1]), _mm256_packs_epi32(xk[2], xk[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(sign, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    return _mm256_or_si256(fast_codes32(h, f), _mm256_and_si256(ordered, sign_bit));
  }
  const __m256i x0 = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
  const __m256i x1 = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i + 16));
  const __m256i abs_mask = _mm256_set1_epi16(0x7FFF);
  const __m256i a0 = _mm256_and_si256(x0, abs_mask), a1 = _mm256_and_si256(x1, abs_mask);
  *amax = _mm256_max_epu16(*amax, _mm256_max_epu16(a0, a1));
  const __m256i a[2] = {a0, a1};
  for (int k = 0; k < 2; ++k) {
    __m256 lo, hi; /* elements 0..7 and 8..15 of a[k] as float32 */
    if (d == TF_BFLOAT16) {
      /* Quadwords 0 2 | 1 3, so that the in-lane interleaves give elements 0..7 and 8..15. */
      const __m256i q = _mm256_permute4x64_epi64(a[k], _MM_SHUFFLE(3, 1, 2, 0));
      lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), q));
      hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), q));
    } else {
      lo = _mm256_cvtph_ps(_mm256_castsi256_si128(a[k]));
      hi = _mm256_cvtph_ps(_mm256_extracti128_si256(a[k], 1));
    }
    h[2 * k] = fast_round8(_mm256_mul_ps(lo, s), f);
    h[2 * k + 1] = fast_round8(_mm256_mul_ps(hi, s), f);
  }
  /* Signed saturation keeps the sign; the pack leaves quadwords 0 2 | 1 3. */
  const __m256i sign = _mm256_permute4x64_epi64(_mm256_packs_epi16(x0, x1), _MM_SHUFFLE(3, 1, 2, 0));
  return _mm256_or_si256(fast_codes32(h, f), _mm256_and_si256(sign, sign_bit));
}

TF_AVX2_INLINE uint32_t hmax_u16(__m256i m) {
  __m128i r = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  r = _mm_max_epu16(r, _mm_srli_si128(r, 8));
  r = _mm_max_epu16(r, _mm_srli_si128(r, 4));
  r = _mm_max_epu16(r, _mm_srli_si128(r, 2));
  return (uint32_t)_mm_cvtsi128_si32(r) & 0xFFFFu;
}

/* The float32 amax bits of 16-bit lanes of |x| bit patterns, or UINT32_MAX: recount. */
TF_AVX2_INLINE uint32_t amax16_bits(__m256i amax, tf_dtype d) {
  return tf_fp8_amax_of_16bit_max(hmax_u16(amax), d);
}

/* ---- The table "encoder" (16-bit input, any scale; see tf_fp8_table_build). ---- */

/*
 * table[h[0..7]] as the 8 bytes of one little-endian word. Scalar loads, as vpgatherdd is slower
 * on the CPUs of this tier; written out because compilers assemble the word with a shift and an
 * or per byte, which leaves the loop bound by instruction count: here the indices come from two
 * 64-bit loads and each looked-up byte is loaded straight into AL or AH, 16 bits of the word at
 * a time (AH is only encodable without a REX prefix, hence the table pointer in RSI and the
 * indices in RCX and RDX). The "m" operand tells the compiler that the whole table is read.
 */
TF_AVX2_INLINE uint64_t lookup8(const uint16_t *h, const uint8_t *table) {
  uint64_t q0, q1, word;
  memcpy(&q0, h, 8);
  memcpy(&q1, h + 4, 8);
  __asm__(
      "movq %[q1], %%rcx\n\t" "shrq $48, %%rcx\n\t" "movzbl (%[t],%%rcx), %%eax\n\t"       /* h[7] */
      "shlq $8, %%rax\n\t"
      "movq %[q1], %%rdx\n\t" "shrq $32, %%rdx\n\t" "movzwl %%dx, %%edx\n\t"
      "movb (%[t],%%rdx), %%al\n\t"                                                        /* h[6] */
      "shlq $16, %%rax\n\t"
      "movl %k[q1], %%ecx\n\t" "shrl $16, %%ecx\n\t" "movb (%[t],%%rcx), %%ah\n\t"          /* h[5] */
      "movzwl %w[q1], %%edx\n\t" "movb (%[t],%%rdx), %%al\n\t"                             /* h[4] */
      "shlq $16, %%rax\n\t"
      "movq %[q0], %%rcx\n\t" "shrq $48, %%rcx\n\t" "movb (%[t],%%rcx), %%ah\n\t"          /* h[3] */
      "movq %[q0], %%rdx\n\t" "shrq $32, %%rdx\n\t" "movzwl %%dx, %%edx\n\t"
      "movb (%[t],%%rdx), %%al\n\t"                                                        /* h[2] */
      "shlq $16, %%rax\n\t"
      "movl %k[q0], %%ecx\n\t" "shrl $16, %%ecx\n\t" "movb (%[t],%%rcx), %%ah\n\t"          /* h[1] */
      "movzwl %w[q0], %%edx\n\t" "movb (%[t],%%rdx), %%al"                                 /* h[0] */
      : "=&a"(word)
      : [q0] "r"(q0), [q1] "r"(q1), [t] "S"(table), "m"(*(const uint8_t(*)[TF_FP8_TABLE_ENTRIES])table)
      : "rcx", "rdx");
  return word;
}

/* The |x| bit patterns of the 32 16-bit elements at h folded into *amax. */
TF_AVX2_INLINE void amax16_fold32(const uint16_t *h, __m256i *amax) {
  const __m256i abs_mask = _mm256_set1_epi16(0x7FFF);
  const __m256i a0 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)h), abs_mask);
  const __m256i a1 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(h + 16)), abs_mask);
  *amax = _mm256_max_epu16(*amax, _mm256_max_epu16(a0, a1));
}

/* ---- Either encoder. ---- */

/*
 * Encodes the 32 elements at x + i and folds their |x| into *amax (in 16-bit lanes for 16-bit
 * input under the fast encoder, as the amax bits otherwise). s is the scale, or the fast
 * multiplier under the fast encoder. (The table mode has loops of its own.)
 */
TF_AVX2_INLINE __m256i encode32(const void *x, int64_t i, __m256 s, __m256i *amax, tf_dtype d,
                                tf_fp8_format f, int mode) {
  if (mode == FAST) return fast_encode32(x, i, s, amax, d, f);
  __m256 v[4];
  for (int k = 0; k < 4; ++k) {
    const __m256 xk = load8(x, i + 8 * k, d);
    *amax = _mm256_max_epu32(*amax, abs_bits8(xk));
    v[k] = _mm256_mul_ps(xk, s);
  }
  return codes32(v, f);
}

/* The amax bits of an encode32 accumulator, or UINT32_MAX where the caller must recount. */
TF_AVX2_INLINE uint32_t amax_of(__m256i amax, tf_dtype d, int mode) {
  return mode != GENERIC && d != TF_FLOAT32 ? amax16_bits(amax, d) : hmax_u32(amax);
}

enum { PREFETCH_BYTES = 4096 };

TF_AVX2_INLINE uint32_t quantize_range(const void *x, int64_t begin, int64_t end, float scale,
                                       const uint8_t *table, uint8_t *y, tf_dtype d, tf_fp8_format f,
                                       int mode) {
  const __m256 s = _mm256_set1_ps(mode == FAST ? tf_fp8_fast_multiplier(scale, f) : scale);
  __m256i amax = _mm256_setzero_si256();
  const int64_t size = tf_dtype_size(d);
  int64_t i = begin;
  for (; end - i >= 32; i += 32) {
    /*
     * x 4 KiB ahead: with this much work per line the hardware prefetchers alone keep too few
     * reads in flight. A prefetch is a hint that never faults, so near the end of x the address
     * (computed as an integer) may lie past it; past this range it is what the thread's next
     * range reads.
     */
    const uintptr_t ahead = (uintptr_t)x + (uintptr_t)(i * size + PREFETCH_BYTES);
    for (int64_t line = 0; line < 32 * size; line += 64)
      _mm_prefetch((const char *)(ahead + (uintptr_t)line), _MM_HINT_T0);
    if (mode == TABLE) { /* the words go straight to y, not through a vector register */
      amax16_fold32((const uint16_t *)x + i, &amax);
      for (int k = 0; k < 4; ++k) {
        const uint64_t word = lookup8((const uint16_t *)x + i + 8 * k, table);
        memcpy(y + i + 8 * k, &word, 8);
      }
    } else {
      _mm256_storeu_si256((__m256i *)(y + i), encode32(x, i, s, &amax, d, f, mode));
    }
  }
  uint32_t head = amax_of(amax, d, mode);
  if (head == UINT32_MAX) head = tf_fp8_kernels_portable.amax[d](x, begin, i);
  const uint32_t tail = mode == TABLE
                            ? tf_fp8_kernels_portable.quantize_table[d - TF_BFLOAT16](x, i, end, table, y)
                            : tf_fp8_kernels_portable.quantize[d][f](x, i, end, scale, y);
  return head > tail ? head : tail;
}

#define DEFINE_QUANTIZE(NAME, DTYPE, FORMAT)                                                    \
  static TF_TARGET_AVX2 uint32_t NAME(const void *x, int64_t begin, int64_t end, float scale,    \
                                      uint8_t *y) {                                             \
    return tf_fp8_fast_scale(scale, FORMAT)                                                            \
               ? quantize_range(x, begin, end, scale, NULL, y, DTYPE, FORMAT, FAST)             \
               : quantize_range(x, begin, end, scale, NULL, y, DTYPE, FORMAT, GENERIC);         \
  }

/* The format is the table's business: TF_FP8_E4M3 below only fills the parameter. */
#define DEFINE_QUANTIZE_TABLE(NAME, DTYPE)                                                      \
  static TF_TARGET_AVX2 uint32_t NAME(const void *x, int64_t begin, int64_t end,                 \
                                      const uint8_t *table, uint8_t *y) {                       \
    return quantize_range(x, begin, end, 0.0f, table, y, DTYPE, TF_FP8_E4M3, TABLE);             \
  }

DEFINE_QUANTIZE(quantize_f32_e4m3, TF_FLOAT32, TF_FP8_E4M3)
DEFINE_QUANTIZE(quantize_f32_e5m2, TF_FLOAT32, TF_FP8_E5M2)
DEFINE_QUANTIZE(quantize_bf16_e4m3, TF_BFLOAT16, TF_FP8_E4M3)
DEFINE_QUANTIZE(quantize_bf16_e5m2, TF_BFLOAT16, TF_FP8_E5M2)
DEFINE_QUANTIZE(quantize_f16_e4m3, TF_FLOAT16, TF_FP8_E4M3)
DEFINE_QUANTIZE(quantize_f16_e5m2, TF_FLOAT16, TF_FP8_E5M2)
DEFINE_QUANTIZE_TABLE(quantize_table_bf16, TF_BFLOAT16)
DEFINE_QUANTIZE_TABLE(quantize_table_f16, TF_FLOAT16)

/* float32: two accumulators of float32 bits; bfloat16 and float16: 16-bit lanes, 32 a step. */
TF_AVX2_INLINE uint32_t amax_range(const void *x, int64_t begin, int64_t end, tf_dtype d) {
  __m256i m0 = _mm256_setzero_si256(), m1 = _mm256_setzero_si256();
  int64_t i = begin;
  uint32_t head;
  if (d == TF_FLOAT32) {
    for (; end - i >= 16; i += 16) {
      m0 = _mm256_max_epu32(m0, abs_bits8(load8_f32(x, i)));
      m1 = _mm256_max_epu32(m1, abs_bits8(load8_f32(x, i + 8)));
    }
    head = hmax_u32(_mm256_max_epu32(m0, m1));
  } else {
    const __m256i abs_mask = _mm256_set1_epi16(0x7FFF);
    for (; end - i >= 32; i += 32) {
      m0 = _mm256_max_epu16(m0, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i)), abs_mask));
      m1 = _mm256_max_epu16(m1, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i + 16)), abs_mask));
    }
    head = amax16_bits(_mm256_max_epu16(m0, m1), d);
    if (head == UINT32_MAX) head = tf_fp8_kernels_portable.amax[d](x, begin, i);
  }
  const uint32_t tail = tf_fp8_kernels_portable.amax[d](x, i, end);
  return head > tail ? head : tail;
}

#define DEFINE_AMAX(NAME, DTYPE)                                                  \
  static TF_TARGET_AVX2 uint32_t NAME(const void *x, int64_t begin, int64_t end) { \
    return amax_range(x, begin, end, DTYPE);                                      \
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

/*
 * Tiles are TALL (TF_FP8_CT_BAND, 128) rows high where the rows allow, else TF_FP8_CT_TILE (64):
 * the taller tile writes 128-byte runs of y_t's rows (bench_quantize at 16 Mi elements on Zen 1:
 * bfloat16 46-49% -> 53% of clone, float32 60-62% -> 63%); the shorter one keeps 64-row blocks on
 * this path.
 */
enum { TALL = TF_FP8_CT_BAND };

/*
 * One tile of `height` (TALL or TF_FP8_CT_TILE, a constant) rows by 32 * width columns at (r0, c0),
 * width 1 or 2: each row is encoded into `width` registers, stored to y and kept in an
 * L1 buffer; the buffer is transposed 16 rows by 32 columns at a time into a
 * second one, from which each column goes out as one run of `height` bytes of its row
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
                                        int64_t c0, int height, int width, int stream, tf_dtype d,
                                        tf_fp8_format f, int fast, __m256 s, __m256i *amax, uint8_t *y,
                                        int64_t ld_y, uint8_t *y_t, int64_t ld_t) {
  __m256i tile[2][TALL];        /* tile[k][r]: row r, columns 32k..32k+31 */
  __m256i tile_t[64][TALL / 32]; /* tile_t[c]: column c, `height` codes */
  for (int r = 0; r < height; ++r) {
    /* The next tile's part of the row: the hardware prefetchers follow few of the tile's rows. */
    const char *next = (const char *)x + ((r0 + r) * ld_x + c0 + 32 * width) * size;
    for (int64_t line = 0; line < 32 * width * size; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
    for (int k = 0; k < width; ++k) {
      tile[k][r] = encode32(x, (r0 + r) * ld_x + c0 + 32 * k, s, amax, d, f, fast);
      store32((__m256i *)(y + (r0 + r) * ld_y + c0) + k, tile[k][r], stream && width == 2);
    }
  }
  for (int k = 0; k < width; ++k)
    for (int h = 0; h < height / 16; ++h) {
      __m256i col[16];
      transpose_16x32(tile[k] + 16 * h, col);
      for (int j = 0; j < 16; ++j) {
        _mm_store_si128((__m128i *)tile_t[32 * k + j] + h, _mm256_castsi256_si128(col[j]));
        _mm_store_si128((__m128i *)tile_t[32 * k + 16 + j] + h, _mm256_extracti128_si256(col[j], 1));
      }
    }
  for (int c = 0; c < 32 * width; ++c)
    for (int k = 0; k < height / 32; ++k)
      store32((__m256i *)(y_t + (c0 + c) * ld_t + r0) + k, tile_t[c][k], stream);
}

/*
 * The whole tiles of rows [r0, r0 + height): 64 columns wide, then one 32 wide where 32 to 63
 * columns are left.
 */
TF_AVX2_INLINE void cast_transpose_band(const void *x, int64_t size, int64_t ld_x, int64_t r0, int height,
                                        int64_t wide_cols, int64_t full_cols, int stream, tf_dtype d,
                                        tf_fp8_format f, int fast, __m256 s, __m256i *amax, uint8_t *y,
                                        int64_t ld_y, uint8_t *y_t, int64_t ld_t) {
  for (int64_t c0 = 0; c0 < wide_cols; c0 += 64) {
    /* stream as a constant in each call, so the hot tile is compiled with its stores fixed */
    if (stream)
      cast_transpose_tile(x, size, ld_x, r0, c0, height, 2, 1, d, f, fast, s, amax, y, ld_y, y_t, ld_t);
    else
      cast_transpose_tile(x, size, ld_x, r0, c0, height, 2, 0, d, f, fast, s, amax, y, ld_y, y_t, ld_t);
  }
  if (wide_cols < full_cols)
    cast_transpose_tile(x, size, ld_x, r0, wide_cols, height, 1, stream, d, f, fast, s, amax, y, ld_y, y_t,
                        ld_t);
}

/*
 * Whole tiles, TALL rows high and then one TF_FP8_CT_TILE high where 64 to 127 rows are left;
 * the ragged right and bottom edges go to the portable kernel as blocks of their own.
 */
TF_AVX2_INLINE uint32_t cast_transpose_block(const void *x, int64_t ld_x, int64_t rows, int64_t cols,
                                             float scale, uint8_t *y, int64_t ld_y, uint8_t *y_t,
                                             int64_t ld_t, tf_dtype d, tf_fp8_format f, int fast) {
  const int64_t size = tf_dtype_size(d);
  const int64_t full_rows = rows - rows % TF_FP8_CT_TILE, wide_cols = cols - cols % 64;
  const int64_t full_cols = cols - cols % 32;
  const __m256 s = _mm256_set1_ps(fast ? tf_fp8_fast_multiplier(scale, f) : scale);
  __m256i amax_v = _mm256_setzero_si256();
  const int stream =
      (uintptr_t)y % 32 == 0 && ld_y % 32 == 0 && (uintptr_t)y_t % 32 == 0 && ld_t % 32 == 0;
  int64_t r0 = 0;
  for (; full_rows - r0 >= TALL; r0 += TALL)
    cast_transpose_band(x, size, ld_x, r0, TALL, wide_cols, full_cols, stream, d, f, fast, s, &amax_v, y,
                        ld_y, y_t, ld_t);
  if (r0 < full_rows)
    cast_transpose_band(x, size, ld_x, r0, TF_FP8_CT_TILE, wide_cols, full_cols, stream, d, f, fast, s,
                        &amax_v, y, ld_y, y_t, ld_t);
  if (stream) _mm_sfence(); /* the streamed stores are visible before the caller's next step */
  const tf_fp8_cast_transpose_fn edge = tf_fp8_kernels_portable.cast_transpose[d][f];
  uint32_t amax = amax_of(amax_v, d, fast), a;
  if (amax == UINT32_MAX) { /* a float16 NaN: recount the whole tiles in float32 bits */
    amax = 0;
    for (int64_t r = 0; r < full_rows; ++r) {
      a = tf_fp8_kernels_portable.amax[d](x, r * ld_x, r * ld_x + full_cols);
      amax = a > amax ? a : amax;
    }
  }
  if (full_cols < cols) { /* right edge of the whole-tile rows */
    a = edge((const char *)x + full_cols * size, ld_x, full_rows, cols - full_cols, scale, y + full_cols,
             ld_y, y_t + full_cols * ld_t, ld_t);
    amax = a > amax ? a : amax;
  }
  if (full_rows < rows) { /* bottom rows, every column */
    a = edge((const char *)x + full_rows * ld_x * size, ld_x, rows - full_rows, cols, scale,
             y + full_rows * ld_y, ld_y, y_t + full_rows, ld_t);
    amax = a > amax ? a : amax;
  }
  return amax;
}

#define DEFINE_CAST_TRANSPOSE(NAME, DTYPE, FORMAT)                                                  \
  static TF_TARGET_AVX2 uint32_t NAME(const void *x, int64_t ld_x, int64_t rows, int64_t cols,      \
                                      float scale, uint8_t *y, int64_t ld_y, uint8_t *y_t,          \
                                      int64_t ld_t) {                                               \
    return tf_fp8_fast_scale(scale, FORMAT)                                                                \
               ? cast_transpose_block(x, ld_x, rows, cols, scale, y, ld_y, y_t, ld_t, DTYPE, FORMAT, FAST) \
               : cast_transpose_block(x, ld_x, rows, cols, scale, y, ld_y, y_t, ld_t, DTYPE, FORMAT,    \
                                      GENERIC);                                                     \
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
                       {cast_transpose_f16_e4m3, cast_transpose_f16_e5m2}},
    .quantize_table = {quantize_table_bf16, quantize_table_f16},
    .lookup16 = tf_fp8_lookup16_portable,
    .lookup32 = tf_fp8_lookup32_portable};

const tf_fp8_kernel_set *const tf_fp8_kernels_avx2 = &avx2_kernels;

#else /* not x86-64 */

const tf_fp8_kernel_set *const tf_fp8_kernels_avx2 = 0;

#endif
