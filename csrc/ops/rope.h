/*
 * Rotary position embedding (RoPE) on the CPU, forward and backward, with TransformerEngine's
 * semantics (transformer_engine.pytorch.attention.rope.apply_rotary_pos_emb).
 *
 * x holds tokens of `heads` heads of `dim` channels, in one of three layouts:
 *   sbhd [s, b, h, d] and bshd [b, s, h, d]: `batch` sequences of `seq` positions each;
 *   thd  [t, h, d]: `seq` = t tokens, packed sequences delimited by cu_seqlens.
 * Every view is given as four element strides in the order (s or t, b, h, d), whatever the layout
 * (the b stride is ignored in thd), so q and k may be views of a fused QKV projection.
 *
 * The first rot_dim channels of each head are rotated in pairs (a, b): (j, j + rot_dim/2) for
 * j < rot_dim/2, or (2i, 2i + 1) when interleaved. With f the float32 angles of the token's
 * position (freqs, one per channel):
 *   y[a] = x[a] cos f[a] - x[b] sin f[a],   y[b] = x[b] cos f[b] + x[a] sin f[b];
 * the other channels are copied bit for bit. The backward is the exact transpose of that map,
 *   dx[a] = dy[a] cos f[a] + dy[b] sin f[b],  dx[b] = dy[b] cos f[b] - dy[a] sin f[a],
 * which is the rotation by -f when f[a] = f[b] (RotaryPositionEmbedding's angles). Math is float32,
 * the output is rounded once to the input's dtype.
 *
 * Positions: token s of a sequence (thd: s counted from the sequence's start) uses the angles of
 * position s + start_positions[sequence] (start_positions may be NULL). With context parallelism
 * (cp_size > 1) each rank holds two halves of length L/2 of every sequence (L its local length,
 * even): local s < L/2 is position s + cp_rank L/2, and s >= L/2 is position
 * (2 cp_size - cp_rank - 1) L/2 + (s - L/2). In thd, cu_seqlens are the global (padded)
 * boundaries: the local tokens of sequence i are [cu_seqlens[i] / cp_size, cu_seqlens[i+1] / cp_size).
 *
 * freqs is a contiguous float32 array [freq_rows, freq_batch, rot_dim]: freq_batch 1 broadcasts
 * over the sequences, freq_batch == batch gives each sequence its own angles.
 *
 * A call handles the tokens [token_begin, token_end) of tf_rope_tokens(p) (sbhd/bshd: token
 * b * seq + s; thd: token t), so the binding can spread token ranges over threads; results do not
 * depend on the split. Every size, stride, cu_seqlens and start_positions entry is checked
 * (tf_rope_check) before x is read.
 */
#ifndef TF_OPS_ROPE_H
#define TF_OPS_ROPE_H

#include <stdint.h>

#include "../common/tf_dtype.h"
#include "../common/tf_status.h"

typedef enum tf_rope_format {
  TF_ROPE_SBHD = 0,
  TF_ROPE_BSHD = 1,
  TF_ROPE_THD = 2
} tf_rope_format;

typedef struct tf_rope_problem {
  tf_rope_format format;
  int64_t seq;     /* sbhd/bshd: positions per sequence; thd: tokens in x */
  int64_t batch;   /* sbhd/bshd: sequences; thd: sequences (cu_seqlens has batch + 1 entries) */
  int64_t heads;
  int64_t dim;     /* channels per head */
  int64_t rot_dim; /* channels rotated: even, at most dim */
  int interleaved; /* 0: pairs (j, j + rot_dim/2); 1: pairs (2i, 2i + 1) */
  const float *freqs;
  int64_t freq_rows;  /* positions freqs covers */
  int64_t freq_batch; /* 1, or batch */
  const int32_t *cu_seqlens;      /* thd only (NULL otherwise): batch + 1 boundaries */
  const int32_t *start_positions; /* batch offsets added to the positions, or NULL */
  int64_t cp_size;                /* >= 1 */
  int64_t cp_rank;                /* in [0, cp_size) */
} tf_rope_problem;

/* The tokens of a problem: batch * seq for sbhd/bshd, seq for thd (0 for a NULL or bad problem). */
int64_t tf_rope_tokens(const tf_rope_problem *p);

/*
 * Checks a problem: sizes non-negative and their products within int64; rot_dim even and at most
 * dim; cp_rank in [0, cp_size); start_positions only with cp_size 1; freq_batch 1 or batch;
 * thd: cu_seqlens present, starting at 0, non-decreasing, ending at seq * cp_size, and with
 * cp_size > 1 every entry a multiple of 2 cp_size; sbhd/bshd with cp_size > 1: seq even;
 * every position a token uses below freq_rows (start_positions non-negative).
 * TF_ERR_BAD_SIZE for sizes and positions, TF_ERR_BAD_ARGUMENT for the rest, TF_ERR_OVERFLOW for
 * products beyond int64, TF_ERR_NULL_POINTER when a needed array is NULL.
 */
tf_status tf_rope_check(const tf_rope_problem *p);

/* tf_rope_check without reading cu_seqlens or start_positions (device arrays, for the CUDA kernels,
   which write NaN on the tokens those arrays misplace): for sbhd/bshd without start_positions, all of it. */
tf_status tf_rope_check_shape(const tf_rope_problem *p);

/* A view of x (or y) with these strides: dtype float32, bfloat16 or float16, every stride non-negative,
   its extent in bytes within int64. */
tf_status tf_rope_check_view(const tf_rope_problem *p, tf_dtype dtype, const int64_t strides[4]);

/* y = RoPE(x) over tokens [token_begin, token_end); x and y have dtype and the given strides. */
tf_status tf_rope_forward(const tf_rope_problem *p, tf_dtype dtype, const void *x,
                          const int64_t x_strides[4], void *y, const int64_t y_strides[4],
                          int64_t token_begin, int64_t token_end);

/* dx = RoPE^T(dy) over tokens [token_begin, token_end). */
tf_status tf_rope_backward(const tf_rope_problem *p, tf_dtype dtype, const void *dy,
                           const int64_t dy_strides[4], void *dx, const int64_t dx_strides[4],
                           int64_t token_begin, int64_t token_end);

#endif /* TF_OPS_ROPE_H */
