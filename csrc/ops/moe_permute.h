/*
 * MoE token permutation on the CPU (TransformerEngine's moe_permute / moe_unpermute /
 * moe_sort_chunks_by_index): the row_id_map construction, and the row gathers and scatters over it.
 *
 * Two row_id_map layouts, both int32, both row-major and contiguous:
 *   TF_MOE_MAP_MASK  (tokens x (2 experts + 1)), from a tokens x experts routing mask. Row t holds
 *     n = map[t][2E] routed slots: map[t][i] the destination row and map[t][E + i] the expert of slot
 *     i, for i < n, in descending destination (so descending expert) order; the other entries are -1.
 *     Destination rows are expert-major: all of expert 0's tokens in token order, then expert 1's...
 *   TF_MOE_MAP_INDEX (topk x tokens), from a tokens x topk expert-index table. map[k][t] is the
 *     destination of token t's k-th choice, or -1 when dropped. Destinations follow a stable sort of
 *     the flattened choices (t * topk + k) by expert.
 * In both, a destination at or past num_out_tokens is dropped (not in the map).
 *
 * A slot's weight column is its expert (mask) or k (index). Weights (probs) are a tokens x columns
 * matrix of float32, bfloat16 or float16. Rows of data are contiguous runs of `cols` elements with a
 * row stride in elements; gathers copy bytes, so FP8 codes and scales go through tf_moe_permute as
 * they are. Every call handles tokens [token_begin, token_end) so the caller may split the tokens
 * over threads; the writes of different tokens never overlap when the map is one these functions
 * built. A map entry outside its range gives TF_ERR_BAD_ARGUMENT.
 */
#ifndef TF_OPS_MOE_PERMUTE_H
#define TF_OPS_MOE_PERMUTE_H

#include <stdint.h>

#include "../common/tf_dtype.h"
#include "../common/tf_status.h"

typedef enum tf_moe_map_kind { TF_MOE_MAP_MASK = 0, TF_MOE_MAP_INDEX = 1 } tf_moe_map_kind;

/* A row_id_map and the shape it was built for. */
typedef struct tf_moe_map {
  const int32_t *data;
  tf_moe_map_kind kind;
  int64_t tokens;
  int64_t width; /* experts (mask) or topk (index) */
} tf_moe_map;

/* A rows x cols matrix of elements of elem_size bytes, rows row_stride elements apart. */
typedef struct tf_moe_rows {
  void *data;
  int64_t rows, cols, row_stride, elem_size;
} tf_moe_rows;

/* Mask map from routing_mask (nonzero byte = routed; element [t][e] at t * token_stride + e *
 * expert_stride). counts: experts int64 scratch. *kept: the rows the permuted tensor fills,
 * min(routed, num_out_tokens). TF_ERR_OVERFLOW when a row number would not fit int32. */
tf_status tf_moe_mask_row_id_map(const uint8_t *routing_mask, int64_t tokens, int64_t experts,
                                 int64_t token_stride, int64_t expert_stride, int64_t num_out_tokens,
                                 int64_t *counts, int32_t *map, int64_t *kept);

/* Index map from indices (tokens x topk, contiguous, each in [0, experts)); counts: experts int64
 * scratch. TF_ERR_BAD_ARGUMENT when an index is out of range. */
tf_status tf_moe_index_row_id_map(const int32_t *indices, int64_t tokens, int64_t topk, int64_t experts,
                                  int64_t num_out_tokens, int64_t *counts, int32_t *map);

/* out[dst] = in[t] for each slot of token t. With probs (tokens x width, may be NULL):
 * out_probs[dst] = probs[t][column], and a slot whose prob is zero (either sign) gets a zero row
 * (TE's marker of a padding slot). in.rows == map.tokens; out.cols == in.cols. */
tf_status tf_moe_permute(tf_moe_map map, tf_moe_rows in, const tf_moe_rows *probs, tf_moe_rows out,
                         void *out_probs, int64_t token_begin, int64_t token_end);

/* out[t] = sum over the slots of token t of in[dst] * w[t][column] (w == NULL: weight 1), the terms
 * added in float32 in the map's slot order (mask: descending expert; index: k = 0, 1, ...), rounded
 * once to dtype. out.rows == map.tokens. */
tf_status tf_moe_unpermute(tf_moe_map map, tf_moe_rows in, tf_dtype dtype, const tf_moe_rows *w,
                           tf_dtype w_dtype, tf_moe_rows out, int64_t token_begin, int64_t token_end);

/* Backward of tf_moe_unpermute with weights: act_grad[dst] = grad[t] * w[t][column] (rounded to
 * dtype) and w_grad[t][column] = sum_h fwd_in[dst][h] * grad[t][h] (the exact float products added in
 * double, h ascending, rounded once to w_dtype: a float32 running sum over a hidden size of thousands
 * drifts by more than TE's tree-reduced sum); w_grad entries of no slot are 0. */
tf_status tf_moe_unpermute_backward(tf_moe_map map, tf_moe_rows grad, tf_moe_rows fwd_in, tf_dtype dtype,
                                    tf_moe_rows w, tf_dtype w_dtype, tf_moe_rows act_grad, tf_moe_rows w_grad,
                                    int64_t token_begin, int64_t token_end);

/* out[t][column] = permuted[dst] per slot, zero elsewhere (the probs of tf_moe_permute sent back).
 * permuted holds one element per row. */
tf_status tf_moe_unpermute_probs(tf_moe_map map, tf_moe_rows permuted, tf_moe_rows out, int64_t token_begin,
                                 int64_t token_end);

/* map[t] = destination of row t when the rows, split in chunks of split_sizes, are reordered to
 * chunk order sorted_index (a permutation of [0, splits)). The sizes must add up to tokens. */
tf_status tf_moe_chunk_sort_map(const int64_t *split_sizes, const int64_t *sorted_index, int64_t splits,
                                int64_t tokens, int64_t *scratch, int32_t *map);

/* forward: out[map[t]] = in[t]; backward: out[t] = in[map[t]]. in.rows == out.rows == tokens. */
tf_status tf_moe_sort_rows(const int32_t *map, int forward, tf_moe_rows in, tf_moe_rows out, int64_t token_begin,
                           int64_t token_end);

#endif /* TF_OPS_MOE_PERMUTE_H */
