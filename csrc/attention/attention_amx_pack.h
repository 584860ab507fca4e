/*
 * Operand packing of the AMX attention kernels: rows of a bf16 or E4M3
 * operand into the bf16 tiles of attention_amx.h. E4M3 values are exact in
 * bf16, so they are decoded without their descale, which the kernels apply
 * to the float32 results.
 */
#ifndef TF_ATTENTION_AMX_PACK_H
#define TF_ATTENTION_AMX_PACK_H

#include "attention_amx.h"
#include "attention_internal.h"
#include "attention_tile.h"

/* The AMX kernels' tiles are 16 floats wide: they take the tile helpers with 16-float vectors. */
#if TF_ATTN_VW != 16
#error "the AMX attention kernels need TF_ATTN_VW == 16"
#endif

/*
 * The rows a packer reads lie a sequence stride apart, which the hardware
 * prefetchers do not follow: tf_amx_pack_transposed asks for each row this
 * many rows before it packs it.
 */
#define TF_AMX_PACK_AHEAD 8

typedef uint16_t tf_v16h __attribute__((vector_size(32)));

/* 16 floats rounded to bf16 bits as tf_f32_to_bf16 does (nearest even, NaN kept quiet), in vector lanes. */
TF_ATTN_INLINE tf_v16h tf_amx_to_bf16(tf_vf x) {
  tf_vfu u;
  memcpy(&u, &x, sizeof u);
  const tf_vfu rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const tf_vfu nan = (tf_vfu)((u & 0x7FFFFFFFu) > 0x7F800000u);
  const tf_vfu bits = (((u >> 16) | 0x40u) & nan) | (rounded & ~nan);
  return __builtin_convertvector(bits, tf_v16h);
}

/* bf16 bits of element i of the row at offset of a BF16 or E4M3 operand (exact). */
static inline uint16_t tf_amx_elem(const tf_attn_operand *op, int64_t offset, int64_t i) {
  if (op->elem == TF_ATTN_BF16) return ((const uint16_t *)op->data)[offset + i];
  return tf_f32_to_bf16(tf_fp8_e4m3_decode(((const uint8_t *)op->data)[offset + i]));
}

/* Row at offset (D elements) into dst[0, width), zero past D. */
static inline void tf_amx_pack_row(const tf_attn_operand *op, int64_t offset, int64_t D,
                                   int64_t width, uint16_t *restrict dst) {
  if (op->elem == TF_ATTN_BF16) {
    memcpy(dst, (const uint16_t *)op->data + offset, (size_t)D * sizeof(uint16_t));
  } else {
    for (int64_t i = 0; i < D; ++i) dst[i] = tf_amx_elem(op, offset, i);
  }
  for (int64_t i = D; i < width; ++i) dst[i] = 0;
}

/*
 * Rows j in [0, n) (offsets first + j * stride) as the B operand of a product
 * over the row's elements, x^T: pair row r, column j holds elements 2r and
 * 2r + 1 of row j. dst is [width / 2][cols][2]; rows j in [n, cols) and
 * elements past D are zero.
 */
static inline void tf_amx_pack_transposed(const tf_attn_operand *op, int64_t first, int64_t stride,
                                          int64_t n, int64_t cols, int64_t D, int64_t width,
                                          uint16_t *restrict dst) {
  /* Each pair is one 32-bit word: a transpose of words, column j from row j. */
  for (int64_t j = 0; j < cols; ++j) {
    if (j + TF_AMX_PACK_AHEAD < n) tf_attn_prefetch_row(op, first + (j + TF_AMX_PACK_AHEAD) * stride, D, 0);
    uint16_t pair[2];
    for (int64_t r = 0; r < width / 2; ++r) {
      const int64_t d = 2 * r;
      if (j < n && op->elem == TF_ATTN_BF16 && d + 1 < D) {
        memcpy(pair, (const uint16_t *)op->data + first + j * stride + d, sizeof pair);
      } else {
        pair[0] = j < n && d < D ? tf_amx_elem(op, first + j * stride, d) : 0;
        pair[1] = j < n && d + 1 < D ? tf_amx_elem(op, first + j * stride, d + 1) : 0;
      }
      memcpy(dst + (r * cols + j) * 2, pair, sizeof pair);
    }
  }
}

/*
 * Rows j in [0, n) as the B operand of a product over the rows: pair row r,
 * column d holds element d of rows 2r and 2r + 1. dst is [rows / 2][width][2]
 * (rows even); rows in [n, rows) and elements past D are zero.
 */
static inline void tf_amx_pack_pairs(const tf_attn_operand *op, int64_t first, int64_t stride,
                                     int64_t n, int64_t rows, int64_t D, int64_t width,
                                     uint16_t *restrict dst) {
  for (int64_t j = 0; j < rows; j += 2) {
    /* Rows j and j + 1 interleaved: even and odd halfwords of pair row j / 2. */
    uint16_t *restrict even = dst + (j / 2) * width * 2, *restrict odd = even + 1;
    if (op->elem == TF_ATTN_BF16 && j + 1 < n) {
      const uint16_t *a = (const uint16_t *)op->data + first + j * stride, *b = a + stride;
      for (int64_t d = 0; d < D; ++d) {
        even[2 * d] = a[d];
        odd[2 * d] = b[d];
      }
    } else {
      for (int64_t d = 0; d < D; ++d) {
        even[2 * d] = j < n ? tf_amx_elem(op, first + j * stride, d) : 0;
        odd[2 * d] = j + 1 < n ? tf_amx_elem(op, first + (j + 1) * stride, d) : 0;
      }
    }
    for (int64_t d = D; d < width; ++d) even[2 * d] = odd[2 * d] = 0;
  }
}

#endif /* TF_ATTENTION_AMX_PACK_H */
