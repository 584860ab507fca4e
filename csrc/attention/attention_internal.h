/*
 * Shared by attention_fwd.c and attention_bwd.c: sequence segments, operand
 * checks, and tile loads/stores between strided operands and float tiles.
 */
#ifndef TF_ATTENTION_INTERNAL_H
#define TF_ATTENTION_INTERNAL_H

#include <math.h>
#include <string.h>

#include "../fp8/fp8_format.h"
#include "attention.h"

/*
 * Query rows of the forward's blocks: two units of one head (consecutive
 * query tiles) go together when a call holds both, so every key and value
 * tile is read once for twice the queries.
 */
#define TF_ATTN_FWD_ROWS (2 * TF_ATTN_BLOCK_Q)
/*
 * Row stride of its transposed tiles (q^T, scores): one cache line more than
 * the rows, so the rows of a strip spread over the L1 sets instead of
 * mapping onto a few of them as a power-of-two stride would.
 */
#define TF_ATTN_FWD_LD (TF_ATTN_FWD_ROWS + 16)

/*
 * Most key tiles the backward's vector path takes in one walk over the query
 * tiles (its AVX2 build; attention_bwd_body.h): each query tile's rows are
 * then loaded, and its dQ rows updated, once for that many key tiles.
 */
#define TF_ATTN_BWD_KEY_TILES 2
/*
 * Its bf16 products' build takes four: the example GPT's 256 keys in one walk,
 * whose dQ rows are then stored once, without the float32 accumulator.
 */
#define TF_ATTN_BF16_BWD_KEY_TILES 4

/*
 * One sequence's rows: rows [start, start + span) of dim 1 of batch entry
 * `batch` belong to it, the first `valid` of them are real tokens. Packed
 * layouts have one extra segment for the tokens past cu_seqlens[N] (valid 0).
 */
typedef struct tf_attn_segment {
  int64_t batch, start, span, valid;
} tf_attn_segment;

int64_t tf_attn_num_segments(const tf_attn_problem *p);
tf_attn_segment tf_attn_q_segment(const tf_attn_problem *p, int64_t seg);
tf_attn_segment tf_attn_kv_segment(const tf_attn_problem *p, int64_t seg);
/* Longest query segment, which sets the number of query tiles per (segment, head). */
int64_t tf_attn_max_q_span(const tf_attn_problem *p);
/* Query tiles (TF_ATTN_BLOCK_Q rows) per (segment, head): those of the longest query segment. */
int64_t tf_attn_q_tiles(const tf_attn_problem *p);
/* Longest kv segment, which sets the number of key tiles of the split backward. */
int64_t tf_attn_max_kv_span(const tf_attn_problem *p);

/* Head dim rounded up to the 16-float vectors of the tile kernels. */
int64_t tf_attn_padded_dim(const tf_attn_problem *p);

/* Checks the problem and that op (of shape [B, S, H, D]) has valid strides and an extent that fits int64. */
tf_status tf_attn_check_operand(const tf_attn_problem *p, const tf_attn_operand *op, int64_t seq,
                                int64_t heads, int is_output);

/* Element offset of row `row` (dim 1), head h, of batch entry b. */
static inline int64_t tf_attn_row_offset(const tf_attn_operand *op, int64_t b, int64_t row,
                                         int64_t h) {
  return b * op->stride_b + row * op->stride_s + h * op->stride_h;
}

/* lse/delta index of (segment row `row` of dim 1, head h, batch b). */
static inline int64_t tf_attn_stat_index(const tf_attn_problem *p, int64_t b, int64_t h,
                                         int64_t row) {
  return (b * p->heads_q + h) * p->seq_q + row;
}

/* dst[i] = scale * element i of the row at src (n elements), as float. */
static inline void tf_attn_load_row(const tf_attn_operand *op, int64_t offset, int64_t n,
                                    float scale, float *restrict dst) {
  switch (op->elem) {
    case TF_ATTN_F32: {
      const float *restrict s = (const float *)op->data + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = s[i] * scale;
      break;
    }
    case TF_ATTN_BF16: {
      const uint16_t *restrict s = (const uint16_t *)op->data + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = tf_bf16_to_f32(s[i]) * scale;
      break;
    }
    case TF_ATTN_F16: {
      const uint16_t *restrict s = (const uint16_t *)op->data + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = tf_f16_to_f32(s[i]) * scale;
      break;
    }
    case TF_ATTN_E4M3: {
      const uint8_t *restrict s = (const uint8_t *)op->data + offset;
      const float sc = scale * op->descale;
      for (int64_t i = 0; i < n; ++i) dst[i] = tf_fp8_e4m3_decode(s[i]) * sc;
      break;
    }
  }
}

/* Stores n floats times scale into the row at offset, rounded to the operand's type. */
static inline void tf_attn_store_row(const tf_attn_operand *op, int64_t offset, int64_t n,
                                     float scale, const float *restrict src) {
  switch (op->elem) {
    case TF_ATTN_F32: {
      float *restrict d = (float *)op->data + offset;
      for (int64_t i = 0; i < n; ++i) d[i] = src[i] * scale;
      break;
    }
    case TF_ATTN_BF16: {
      uint16_t *restrict d = (uint16_t *)op->data + offset;
      for (int64_t i = 0; i < n; ++i) d[i] = tf_f32_to_bf16(src[i] * scale);
      break;
    }
    case TF_ATTN_F16: {
      uint16_t *restrict d = (uint16_t *)op->data + offset;
      for (int64_t i = 0; i < n; ++i) d[i] = tf_f32_to_f16(src[i] * scale);
      break;
    }
    case TF_ATTN_E4M3:
      break; /* never an output: rejected by tf_attn_check_operand */
  }
}

/*
 * Asks for the n elements of the row at offset to be brought into L2 (a hint
 * only), to be read or, with `write`, written. Not into L1: the rows of one
 * head are a power-of-two stride apart, so L1 would keep only a few of them.
 */
static inline void tf_attn_prefetch_row(const tf_attn_operand *op, int64_t offset, int64_t n,
                                        int write) {
  const int64_t size = op->elem == TF_ATTN_F32 ? 4 : op->elem == TF_ATTN_E4M3 ? 1 : 2;
  const char *row = (const char *)op->data + offset * size;
  for (int64_t byte = 0; byte < n * size; byte += 64) {
    if (write)
      __builtin_prefetch(row + byte, 1, 2);
    else
      __builtin_prefetch(row + byte, 0, 2);
  }
}

/* Zeroes n elements of the row at offset. */
static inline void tf_attn_zero_row(const tf_attn_operand *op, int64_t offset, int64_t n) {
  const int64_t size = op->elem == TF_ATTN_F32 ? 4 : 2;
  memset((char *)op->data + offset * size, 0, (size_t)(n * size));
}

/*
 * A forward unit's query rows [r0, r0 + nr) of segment qs against the keys of ks: returns how many
 * of them, from the first, are computed (valid rows that see at least one key) and sets *kv_end to
 * the keys those rows see ([0, *kv_end) of ks). The other rows of the block (padding, or rows
 * that see no key) are written here: zero output and lse = -inf.
 */
static inline int64_t tf_attn_fwd_live_rows(const tf_attn_problem *p, const tf_attn_operand *out,
                                            float *lse, tf_attn_segment qs, tf_attn_segment ks,
                                            int64_t h, int64_t r0, int64_t nr, int64_t *kv_end) {
  const int64_t left = qs.valid - r0;
  const int64_t nv = left < 0 ? 0 : left > nr ? nr : left;
  const int64_t seen = p->causal && r0 + nv < ks.valid ? r0 + nv : ks.valid;
  *kv_end = nv == 0 ? 0 : seen;
  const int64_t rows = *kv_end > 0 ? nv : 0;
  for (int64_t i = rows; i < nr; ++i) {
    const int64_t row = qs.start + r0 + i;
    tf_attn_zero_row(out, tf_attn_row_offset(out, qs.batch, row, h), p->head_dim);
    lse[tf_attn_stat_index(p, qs.batch, h, row)] = -INFINITY;
  }
  return rows;
}

#endif /* TF_ATTENTION_INTERNAL_H */
