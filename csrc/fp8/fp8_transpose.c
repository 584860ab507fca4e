#include "fp8_transpose.h"

#include "fp8_kernels.h"
#include "fp8_quantize.h"

#include <string.h>

#include "../common/cpu_features.h"
#include "../common/tf_checks.h"

#if TF_X86
#include <emmintrin.h>

/*
 * A 16 x 16 block of bytes in SSE2 registers (x86-64's baseline, so no dispatch): interleaving
 * rows i and i + 8 byte by byte rotates each byte's 8-bit (row, column) address left by one bit,
 * so four rounds swap row and column. 64 unpacks for 256 bytes; the 8 x 8 word path below took
 * about 200 shifts and masks for 64.
 */
static void block_16x16(const uint8_t *x, int64_t ld_x, uint8_t *y, int64_t ld_y) {
  __m128i a[16], b[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm_loadu_si128((const __m128i *)(x + i * ld_x));
  for (int round = 0; round < 4; ++round) {
    for (int i = 0; i < 8; ++i) {
      b[2 * i] = _mm_unpacklo_epi8(a[i], a[i + 8]);
      b[2 * i + 1] = _mm_unpackhi_epi8(a[i], a[i + 8]);
    }
    memcpy(a, b, sizeof a);
  }
  for (int i = 0; i < 16; ++i) _mm_storeu_si128((__m128i *)(y + i * ld_y), a[i]);
}
#define BLOCK 16
#define block_transpose block_16x16
#else
/*
 * An 8 x 8 block of bytes through eight 64-bit words: each row is loaded whole and each column
 * stored whole, so the strided accesses are 8 bytes wide (byte-wide ones run four times slower).
 */
static void block_8x8(const uint8_t *x, int64_t ld_x, uint8_t *y, int64_t ld_y) {
  uint64_t row[8], col[8] = {0};
  for (int i = 0; i < 8; ++i) memcpy(&row[i], x + i * ld_x, 8);
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) col[j] |= (row[i] >> (8 * j) & 0xFFu) << (8 * i);
  for (int j = 0; j < 8; ++j) memcpy(y + j * ld_y, &col[j], 8);
}
#define BLOCK 8
#define block_transpose block_8x8
#endif

/* A block of n rows by m columns one byte at a time (the ragged edges). */
static void block_bytes(const uint8_t *x, int64_t ld_x, int64_t n, int64_t m, uint8_t *y, int64_t ld_y) {
  for (int64_t c = 0; c < m; ++c)
    for (int64_t r = 0; r < n; ++r) y[c * ld_y + r] = x[r * ld_x + c];
}

enum { TILE = 64 };

/* A tile of n rows by m columns, whole blocks inside, bytes at the edges. */
static void tile_blocks(const uint8_t *x, int64_t ld_x, int64_t n, int64_t m, uint8_t *y, int64_t ld_y) {
  const int64_t nw = n - n % BLOCK, mw = m - m % BLOCK;
  for (int64_t r = 0; r < nw; r += BLOCK)
    for (int64_t c = 0; c < mw; c += BLOCK) block_transpose(x + r * ld_x + c, ld_x, y + c * ld_y + r, ld_y);
  block_bytes(x + nw * ld_x, ld_x, n - nw, m, y + nw, ld_y); /* bottom rows */
  block_bytes(x + mw, ld_x, nw, m - mw, y + mw * ld_y, ld_y); /* right columns */
}

/*
 * A whole TILE x TILE tile through two 4 KiB buffers: its rows copied in whole, transposed there,
 * the result copied out whole, so each cache line of x and of y is touched once. In place, the
 * blocks touch every line four times, 16 bytes at a time, and with power-of-two strides (a
 * 2048-column matrix) a tile's 64 lines share two cache sets and are evicted in between: 2048 x
 * 2048 took three times as long as a copy of the bytes.
 */
static void tile_buffered(const uint8_t *x, int64_t ld_x, uint8_t *y, int64_t ld_y) {
  _Alignas(64) uint8_t in[TILE * TILE], out[TILE * TILE];
  for (int i = 0; i < TILE; ++i) memcpy(in + i * TILE, x + i * ld_x, TILE);
  tile_blocks(in, TILE, TILE, TILE, out, TILE);
  for (int i = 0; i < TILE; ++i) memcpy(y + i * ld_y, out + i * TILE, TILE);
}

/* Rows [row_begin, row_end) and columns [c_begin, cols) a tile at a time. */
static void tile_range(const uint8_t *x, int64_t rows, int64_t cols, int64_t row_begin, int64_t row_end,
                       int64_t c_begin, uint8_t *y) {
  for (int64_t r0 = row_begin; r0 < row_end; r0 += TILE) {
    const int64_t rn = row_end - r0 < TILE ? row_end - r0 : TILE;
    for (int64_t c0 = c_begin; c0 < cols; c0 += TILE) {
      const int64_t cn = cols - c0 < TILE ? cols - c0 : TILE;
      const uint8_t *xt = x + r0 * cols + c0;
      uint8_t *yt = y + c0 * rows + r0;
      if (rn == TILE && cn == TILE)
        tile_buffered(xt, cols, yt, rows);
      else
        tile_blocks(xt, cols, rn, cn, yt, rows);
    }
  }
}

tf_status tf_fp8_transpose(const uint8_t *x, int64_t rows, int64_t cols, int64_t row_begin,
                           int64_t row_end, uint8_t *y) {
  if (rows < 0 || cols < 0 || !tf_range_ok(row_begin, row_end, rows)) return TF_ERR_BAD_SIZE;
  if (!tf_mul_fits(rows, cols)) return TF_ERR_OVERFLOW;
  if (row_end == row_begin || cols == 0) return TF_OK;
  if (!x || !y) return TF_ERR_NULL_POINTER;
#if TF_X86
  if (tf_cpu_isa() >= TF_ISA_AVX512) { /* whole panels on AVX-512, then their right edge here */
    const int64_t panel_rows = (row_end - row_begin) / TF_FP8_CT_BAND * TF_FP8_CT_BAND;
    const int64_t done = tf_fp8_transpose_panels_avx512(x + row_begin * cols, cols, panel_rows, cols,
                                                        y + row_begin, rows);
    if (done > 0) {
      tile_range(x, rows, cols, row_begin, row_begin + panel_rows, done, y);
      row_begin += panel_rows;
    }
  }
#endif
  tile_range(x, rows, cols, row_begin, row_end, 0, y);
  return TF_OK;
}
