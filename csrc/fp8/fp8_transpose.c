#include "fp8_transpose.h"

#include <string.h>

#include "../common/tf_checks.h"

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

/* A block of n rows by m columns one byte at a time (the ragged edges). */
static void block_bytes(const uint8_t *x, int64_t ld_x, int64_t n, int64_t m, uint8_t *y, int64_t ld_y) {
  for (int64_t c = 0; c < m; ++c)
    for (int64_t r = 0; r < n; ++r) y[c * ld_y + r] = x[r * ld_x + c];
}

tf_status tf_fp8_transpose(const uint8_t *x, int64_t rows, int64_t cols, int64_t row_begin,
                           int64_t row_end, uint8_t *y) {
  if (rows < 0 || cols < 0 || !tf_range_ok(row_begin, row_end, rows)) return TF_ERR_BAD_SIZE;
  if (!tf_mul_fits(rows, cols)) return TF_ERR_OVERFLOW;
  if (row_end == row_begin || cols == 0) return TF_OK;
  if (!x || !y) return TF_ERR_NULL_POINTER;
  /* 64 x 64 tiles (4 KiB of x and of y stay in L1), whole 8 x 8 blocks inside, bytes at the edges */
  enum { TILE = 64 };
  for (int64_t r0 = row_begin; r0 < row_end; r0 += TILE) {
    const int64_t rn = row_end - r0 < TILE ? row_end - r0 : TILE;
    for (int64_t c0 = 0; c0 < cols; c0 += TILE) {
      const int64_t cn = cols - c0 < TILE ? cols - c0 : TILE;
      const uint8_t *xt = x + r0 * cols + c0;
      uint8_t *yt = y + c0 * rows + r0;
      const int64_t rw = rn - rn % 8, cw = cn - cn % 8;
      for (int64_t r = 0; r < rw; r += 8)
        for (int64_t c = 0; c < cw; c += 8) block_8x8(xt + r * cols + c, cols, yt + c * rows + r, rows);
      block_bytes(xt + rw * cols, cols, rn - rw, cn, yt + rw, rows);              /* bottom rows */
      block_bytes(xt + cw, cols, rw, cn - cw, yt + cw * rows, rows);              /* right columns */
    }
  }
  return TF_OK;
}
