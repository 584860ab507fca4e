/*
 * FP8 cast-transpose on AVX-512 (F + BW + VL), in panels of 128 rows.
 *
 * The AVX2 kernels read x a tile (128 rows of 64 columns) at a time: short runs at a large,
 * usually power-of-two row stride, which the hardware prefetchers hardly follow and which fall
 * into the same few cache sets. Here a panel of 128 rows by up to PANEL_COLS columns is first
 * encoded row by row, by the AVX-512 quantize kernel, into a buffer that stays in L2 (long
 * sequential runs of x), each row copied on to y as it is encoded; then each 128 x 64 block of
 * the buffer goes out, transposed in registers, as 64 runs of 128 bytes (two whole cache lines)
 * of y_t's rows. y and y_t are written with non-temporal stores where they are 64-byte aligned:
 * on Zen 4, ordinary stores made the kernel 1.5 to 2 times slower.
 *
 * The ragged right and bottom edges (fewer than 64 columns or 128 rows) go to the AVX2 kernels
 * as blocks of their own: the same bytes. The FP8 byte transpose (fp8_transpose.c) uses the same
 * panels and blocks for its whole panels.
 */
#include "fp8_kernels.h"
#include "fp8_quantize.h"

#include "../common/cpu_features.h"

#if TF_X86
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#define TF_AVX512_INLINE static inline __attribute__((always_inline)) TF_TARGET_AVX512

/*
 * Panels are ROWS high and at most PANEL_COLS wide: reading x in shorter runs than whole rows of
 * 4096 columns measured slower. The buffer's row stride is one cache line more than a panel row,
 * so that a block's rows fall into different L1 sets.
 */
enum { ROWS = TF_FP8_CT_BAND, BLOCK = 64, PANEL_COLS = 4096 };

TF_AVX512_INLINE void store64(uint8_t *p, __m512i v, int stream) {
  if (stream)
    _mm512_stream_si512((void *)p, v);
  else
    _mm512_storeu_si512(p, v);
}

/*
 * Transposes 16 rows of 64 bytes (row r in t[r]) within each 128-bit lane, with four rounds of
 * interleaves: afterwards lane L of out[j] holds column 16L + j, rows 0..15.
 */
TF_AVX512_INLINE void transpose_16x64(const __m512i t[16], __m512i out[16]) {
  __m512i s1[16], s2[16], s3[16];
  for (int k = 0; k < 8; ++k) { /* 16-bit units: rows 2k, 2k+1 of one column */
    s1[2 * k] = _mm512_unpacklo_epi8(t[2 * k], t[2 * k + 1]);
    s1[2 * k + 1] = _mm512_unpackhi_epi8(t[2 * k], t[2 * k + 1]);
  }
  for (int m = 0; m < 4; ++m) /* 32-bit units: rows 4m..4m+3; s2[4m + q] holds columns 4q..4q+3 */
    for (int h = 0; h < 2; ++h) {
      s2[4 * m + 2 * h] = _mm512_unpacklo_epi16(s1[4 * m + h], s1[4 * m + 2 + h]);
      s2[4 * m + 2 * h + 1] = _mm512_unpackhi_epi16(s1[4 * m + h], s1[4 * m + 2 + h]);
    }
  for (int p = 0; p < 2; ++p) /* 64-bit units: rows 8p..8p+7; s3[8p + t] holds columns 2t, 2t+1 */
    for (int q = 0; q < 4; ++q) {
      s3[8 * p + 2 * q] = _mm512_unpacklo_epi32(s2[8 * p + q], s2[8 * p + 4 + q]);
      s3[8 * p + 2 * q + 1] = _mm512_unpackhi_epi32(s2[8 * p + q], s2[8 * p + 4 + q]);
    }
  for (int k = 0; k < 8; ++k) { /* whole columns, rows 0..15 */
    out[2 * k] = _mm512_unpacklo_epi64(s3[k], s3[8 + k]);
    out[2 * k + 1] = _mm512_unpackhi_epi64(s3[k], s3[8 + k]);
  }
}

/* A 4 x 4 transpose of 128-bit lanes: lane g of out[l] is lane l of a[g]. */
TF_AVX512_INLINE void transpose_lanes(const __m512i a[4], __m512i out[4]) {
  const __m512i u0 = _mm512_shuffle_i64x2(a[0], a[1], 0x88), u1 = _mm512_shuffle_i64x2(a[0], a[1], 0xDD);
  const __m512i u2 = _mm512_shuffle_i64x2(a[2], a[3], 0x88), u3 = _mm512_shuffle_i64x2(a[2], a[3], 0xDD);
  out[0] = _mm512_shuffle_i64x2(u0, u2, 0x88);
  out[1] = _mm512_shuffle_i64x2(u1, u3, 0x88);
  out[2] = _mm512_shuffle_i64x2(u0, u2, 0xDD);
  out[3] = _mm512_shuffle_i64x2(u1, u3, 0xDD);
}

/*
 * The columns of one ROWS x 64 block of codes (row r at p + r * ld_p) to y_t's rows. Each
 * group of 16 rows is transposed within lanes into part[g]; the lanes of four groups then make 64
 * bytes of a column whole, and each column goes out as one run of ROWS bytes.
 */
TF_AVX512_INLINE void block_out(const uint8_t *p, int64_t ld_p, uint8_t *y_t, int64_t ld_t, int stream) {
  __m512i part[ROWS / 16][16];
  for (int g = 0; g < ROWS / 16; ++g) {
    __m512i rows[16];
    for (int r = 0; r < 16; ++r) rows[r] = _mm512_load_si512(p + (16 * g + r) * ld_p);
    transpose_16x64(rows, part[g]);
  }
  for (int j = 0; j < 16; ++j) {
    __m512i col[ROWS / 64][4]; /* col[h][l]: rows 64h..64h+63 of column 16l + j */
    for (int h = 0; h < ROWS / 64; ++h) {
      const __m512i a[4] = {part[4 * h][j], part[4 * h + 1][j], part[4 * h + 2][j], part[4 * h + 3][j]};
      transpose_lanes(a, col[h]);
    }
    for (int l = 0; l < 4; ++l)
      for (int h = 0; h < ROWS / 64; ++h) store64(y_t + (16 * l + j) * ld_t + 64 * h, col[h][l], stream);
  }
}

/*
 * The panel of rows [r0, r0 + ROWS) and columns [c0, c0 + width), width a multiple of 64: each row
 * encoded into the buffer `panel` (row stride ld_p) and, while it is in L1, copied to y in one sequential run; then the
 * panel's columns go out a block at a time. Returns the amax bits.
 */
TF_AVX512_INLINE uint32_t panel_out(uint8_t *panel, int64_t ld_p, const char *x, int64_t size, int64_t ld_x,
                                    int64_t r0, int64_t c0,
                                    int64_t width, float scale, tf_fp8_quantize_fn quantize, uint8_t *y,
                                    int64_t ld_y, int stream_y, uint8_t *y_t, int64_t ld_t, int stream_t) {
  uint32_t amax = 0;
  for (int r = 0; r < ROWS; ++r) {
    uint8_t *codes = panel + r * ld_p;
    const uint32_t a = quantize(x + ((r0 + r) * ld_x + c0) * size, 0, width, scale, codes);
    amax = a > amax ? a : amax;
    for (int64_t c = 0; c < width; c += BLOCK)
      store64(y + (r0 + r) * ld_y + c0 + c, _mm512_load_si512(codes + c), stream_y);
  }
  for (int64_t c = 0; c < width; c += BLOCK) block_out(panel + c, ld_p, y_t + (c0 + c) * ld_t + r0, ld_t, stream_t);
  return amax;
}

TF_AVX512_INLINE int aligned64(const void *p, int64_t ld) { return (uintptr_t)p % 64 == 0 && ld % 64 == 0; }

TF_AVX512_INLINE uint32_t max_u32(uint32_t a, uint32_t b) { return a > b ? a : b; }

TF_AVX512_INLINE uint32_t cast_transpose_block(const void *x, int64_t ld_x, int64_t rows, int64_t cols,
                                               float scale, uint8_t *y, int64_t ld_y, uint8_t *y_t,
                                               int64_t ld_t, tf_dtype d, tf_fp8_format f) {
  const int64_t size = tf_dtype_size(d);
  const int64_t full_rows = rows - rows % ROWS, full_cols = cols - cols % BLOCK;
  const int stream_y = aligned64(y, ld_y), stream_t = aligned64(y_t, ld_t);
  const tf_fp8_quantize_fn quantize = tf_fp8_kernels_avx512->quantize[d][f];
  const tf_fp8_cast_transpose_fn edge = tf_fp8_kernels_avx2->cast_transpose[d][f];
  /* The panel buffer, at most 520 KiB, lives for the call (without it the AVX2 kernel does it all). */
  const int64_t ld_p = (full_cols < PANEL_COLS ? full_cols : PANEL_COLS) + 64;
  uint8_t *panel = full_rows > 0 && full_cols > 0 ? aligned_alloc(64, (size_t)(ROWS * ld_p)) : NULL;
  if (!panel) return edge(x, ld_x, rows, cols, scale, y, ld_y, y_t, ld_t);
  uint32_t amax = 0;
  for (int64_t r0 = 0; r0 < full_rows; r0 += ROWS)
    for (int64_t c0 = 0; c0 < full_cols; c0 += PANEL_COLS) {
      const int64_t width = full_cols - c0 < PANEL_COLS ? full_cols - c0 : PANEL_COLS;
      amax = max_u32(amax, panel_out(panel, ld_p, (const char *)x, size, ld_x, r0, c0, width, scale, quantize,
                                     y, ld_y, stream_y, y_t, ld_t, stream_t));
    }
  free(panel);
  if (stream_y || stream_t) _mm_sfence(); /* the streamed stores are visible before the caller's next step */
  if (full_cols < cols) /* right edge of the whole-panel rows */
    amax = max_u32(amax, edge((const char *)x + full_cols * size, ld_x, full_rows, cols - full_cols, scale,
                              y + full_cols, ld_y, y_t + full_cols * ld_t, ld_t));
  if (full_rows < rows) /* bottom rows, every column */
    amax = max_u32(amax, edge((const char *)x + full_rows * ld_x * size, ld_x, rows - full_rows, cols, scale,
                              y + full_rows * ld_y, ld_y, y_t + full_rows, ld_t));
  return amax;
}

/*
 * The byte transpose's whole panels (fp8_transpose.h): the same panels and blocks as cast-transpose,
 * with the rows copied into the buffer instead of encoded and no row-major output.
 */
TF_TARGET_AVX512 int64_t tf_fp8_transpose_panels_avx512(const uint8_t *x, int64_t ld_x, int64_t rows,
                                                        int64_t cols, uint8_t *y_t, int64_t ld_t) {
  const int64_t full_cols = cols - cols % BLOCK;
  const int stream_t = aligned64(y_t, ld_t);
  const int64_t ld_p = (full_cols < PANEL_COLS ? full_cols : PANEL_COLS) + 64;
  uint8_t *panel = rows >= ROWS && full_cols > 0 ? aligned_alloc(64, (size_t)(ROWS * ld_p)) : NULL;
  if (!panel) return 0;
  for (int64_t r0 = 0; r0 + ROWS <= rows; r0 += ROWS)
    for (int64_t c0 = 0; c0 < full_cols; c0 += PANEL_COLS) {
      const int64_t width = full_cols - c0 < PANEL_COLS ? full_cols - c0 : PANEL_COLS;
      for (int r = 0; r < ROWS; ++r) memcpy(panel + r * ld_p, x + (r0 + r) * ld_x + c0, (size_t)width);
      for (int64_t c = 0; c < width; c += BLOCK)
        block_out(panel + c, ld_p, y_t + (c0 + c) * ld_t + r0, ld_t, stream_t);
    }
  free(panel);
  if (stream_t) _mm_sfence();
  return full_cols;
}

#define DEFINE_CAST_TRANSPOSE(NAME, DTYPE, FORMAT)                                                    \
  TF_TARGET_AVX512 uint32_t NAME(const void *x, int64_t ld_x, int64_t rows, int64_t cols, float scale, \
                                 uint8_t *y, int64_t ld_y, uint8_t *y_t, int64_t ld_t) {               \
    return cast_transpose_block(x, ld_x, rows, cols, scale, y, ld_y, y_t, ld_t, DTYPE, FORMAT);       \
  }

DEFINE_CAST_TRANSPOSE(tf_fp8_cast_transpose_avx512_f32_e4m3, TF_FLOAT32, TF_FP8_E4M3)
DEFINE_CAST_TRANSPOSE(tf_fp8_cast_transpose_avx512_f32_e5m2, TF_FLOAT32, TF_FP8_E5M2)
DEFINE_CAST_TRANSPOSE(tf_fp8_cast_transpose_avx512_bf16_e4m3, TF_BFLOAT16, TF_FP8_E4M3)
DEFINE_CAST_TRANSPOSE(tf_fp8_cast_transpose_avx512_bf16_e5m2, TF_BFLOAT16, TF_FP8_E5M2)
DEFINE_CAST_TRANSPOSE(tf_fp8_cast_transpose_avx512_f16_e4m3, TF_FLOAT16, TF_FP8_E4M3)
DEFINE_CAST_TRANSPOSE(tf_fp8_cast_transpose_avx512_f16_e5m2, TF_FLOAT16, TF_FP8_E5M2)

#endif
