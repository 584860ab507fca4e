/*
 * The MoE permutation C core (csrc/ops/moe_permute.h) on its own: the row_id_maps of a worked example,
 * random routings against plain double-precision loops (permute, weighted unpermute and its backward,
 * dropped tokens, padding slots), the chunk sort, and the argument checks (sizes, pointers, bad map
 * entries, int32 overflow of the row numbers).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/tf_dtype.h"
#include "ops/moe_permute.h"

static unsigned rng = 12345u;
static unsigned next(void) { return rng = rng * 1103515245u + 12345u, (rng >> 8) & 0xFFFFFF; }
static float uniform(void) { return (float)next() / 16777216.0f * 2.0f - 1.0f; }

static tf_moe_rows rows_of(void *data, int64_t rows, int64_t cols, int64_t elem) {
  tf_moe_rows m = {data, rows, cols, cols, elem};
  return m;
}

/* 5 tokens, 3 experts: destinations are expert-major, each token's slots in descending order. */
static void test_worked_example(void) {
  const uint8_t mask[15] = {1, 1, 0, 1, 0, 1, 0, 0, 1, 1, 1, 0, 0, 0, 0};
  const int32_t want[35] = {3, 0, -1, 1, 0, -1, 2, 5, 1, -1, 2, 0, -1, 2, 6, -1, -1, 2, -1, -1, 1,
                            4, 2, -1, 1, 0, -1, 2, -1, -1, -1, -1, -1, -1, 0};
  int64_t counts[3], kept = -1;
  int32_t map[35];
  CHECK(tf_moe_mask_row_id_map(mask, 5, 3, 3, 1, 7, counts, map, &kept) == TF_OK && kept == 7, "mask map");
  CHECK(memcmp(map, want, sizeof want) == 0, "the worked example's map");
  /* num_out_tokens 4 drops rows 4, 5, 6 (the tail of the expert-major order). */
  CHECK(tf_moe_mask_row_id_map(mask, 5, 3, 3, 1, 4, counts, map, &kept) == TF_OK && kept == 4, "dropping");
  CHECK(map[0] == 3 && map[1] == 0 && map[6] == 2 && map[7 + 0] == 1 && map[7 + 6] == 1 && map[14 + 6] == 0 &&
            map[21] == 2 && map[21 + 6] == 1, "dropped slots leave the map");
  /* The transposed mask through strides gives the same map. */
  uint8_t maskT[15];
  for (int t = 0; t < 5; ++t)
    for (int e = 0; e < 3; ++e) maskT[e * 5 + t] = mask[t * 3 + e];
  CHECK(tf_moe_mask_row_id_map(maskT, 5, 3, 1, 5, 7, counts, map, &kept) == TF_OK && memcmp(map, want, sizeof want) == 0,
        "strided mask");
  /* Index map: stable sort of (t, k) by expert; choice 1 of token 0 and choice 0 of token 2 share expert 1. */
  const int32_t idx[6] = {2, 1, 0, 2, 1, 0};
  int32_t imap[6];
  CHECK(tf_moe_index_row_id_map(idx, 3, 2, 3, 6, counts, imap) == TF_OK, "index map");
  const int32_t iwant[6] = {4, 0, 3, 2, 5, 1}; /* [k][t] */
  CHECK(memcmp(imap, iwant, sizeof iwant) == 0, "index map values");
  CHECK(tf_moe_index_row_id_map(idx, 3, 2, 3, 3, counts, imap) == TF_OK && imap[0] == -1 && imap[2] == -1 &&
            imap[4] == -1 && imap[1] == 0 && imap[3] == 2 && imap[5] == 1, "index map drops the rows past num_out_tokens");
}

#define T 37
#define E 6
#define H 300 /* more than one of the unpermute's 256-float tiles */

static void test_random_mask(tf_dtype dtype) {
  const int64_t es = tf_dtype_size(dtype);
  uint8_t mask[T * E];
  for (int i = 0; i < T * E; ++i) mask[i] = next() % 3 == 0;
  for (int e = 0; e < E; ++e) mask[5 * E + e] = 0; /* a token routed nowhere */
  for (int e = 0; e < E; ++e) mask[6 * E + e] = 1; /* one routed everywhere */
  int routed = 0;
  for (int i = 0; i < T * E; ++i) routed += mask[i];
  const int out_rows = routed - 3; /* drop three */
  int64_t counts[E], kept;
  int32_t *map = malloc(sizeof(int32_t) * T * (2 * E + 1));
  CHECK(tf_moe_mask_row_id_map(mask, T, E, E, 1, out_rows, counts, map, &kept) == TF_OK && kept == out_rows,
        "random map");
  /* Reference destinations. */
  int dst[T][E], next_row = 0;
  for (int e = 0; e < E; ++e)
    for (int t = 0; t < T; ++t) dst[t][e] = mask[t * E + e] ? (next_row < out_rows ? next_row : -1) : -1, next_row += mask[t * E + e];
  void *x = malloc(es * T * H), *px = malloc(es * out_rows * H), *y = malloc(es * T * H);
  void *w = malloc(es * T * E), *pw = malloc(es * out_rows), *g = malloc(es * T * H);
  void *dx = malloc(es * out_rows * H), *dw = malloc(es * T * E), *uw = malloc(es * T * E);
  for (int i = 0; i < T * H; ++i) {
    const float v = uniform(), gv = uniform();
    if (dtype == TF_FLOAT32) ((float *)x)[i] = v, ((float *)g)[i] = gv;
    else if (dtype == TF_BFLOAT16) ((uint16_t *)x)[i] = tf_f32_to_bf16(v), ((uint16_t *)g)[i] = tf_f32_to_bf16(gv);
    else ((uint16_t *)x)[i] = tf_f32_to_f16(v), ((uint16_t *)g)[i] = tf_f32_to_f16(gv);
  }
  for (int i = 0; i < T * E; ++i) {
    const float v = (i % 7 == 3) ? 0.0f : uniform(); /* some zero probs: padding slots */
    if (dtype == TF_FLOAT32) ((float *)w)[i] = v;
    else if (dtype == TF_BFLOAT16) ((uint16_t *)w)[i] = tf_f32_to_bf16(v);
    else ((uint16_t *)w)[i] = tf_f32_to_f16(v);
  }
#define VAL(p, i) (dtype == TF_FLOAT32 ? ((float *)(p))[i] : dtype == TF_BFLOAT16 ? tf_bf16_to_f32(((uint16_t *)(p))[i]) : tf_f16_to_f32(((uint16_t *)(p))[i]))
  const tf_moe_map m = {map, TF_MOE_MAP_MASK, T, E};
  const tf_moe_rows wr = rows_of(w, T, E, es);
  CHECK(tf_moe_permute(m, rows_of(x, T, H, es), &wr, rows_of(px, out_rows, H, es), pw, 0, 20) == TF_OK &&
            tf_moe_permute(m, rows_of(x, T, H, es), &wr, rows_of(px, out_rows, H, es), pw, 20, T) == TF_OK,
        "permute in two token ranges");
  int bad = 0;
  for (int t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e) {
      if (dst[t][e] < 0) continue;
      const int zero = VAL(w, t * E + e) == 0.0f;
      bad += VAL(pw, dst[t][e]) != VAL(w, t * E + e);
      for (int h = 0; h < H; ++h) bad += VAL(px, dst[t][e] * H + h) != (zero ? 0.0f : VAL(x, t * H + h));
    }
  CHECK(bad == 0, "permuted rows and probs (%d wrong), zero rows at zero probs", bad);
  /* Unpermute with weights against double. */
  CHECK(tf_moe_unpermute(m, rows_of(px, out_rows, H, es), dtype, &wr, dtype, rows_of(y, T, H, es), 0, T) == TF_OK,
        "unpermute");
  const double tol = dtype == TF_FLOAT32 ? 1e-5 : dtype == TF_BFLOAT16 ? 1e-2 : 2e-3;
  double worst = 0.0;
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      double ref = 0.0;
      for (int e = 0; e < E; ++e)
        if (dst[t][e] >= 0) ref += (double)VAL(px, dst[t][e] * H + h) * VAL(w, t * E + e);
      worst = fmax(worst, fabs(VAL(y, t * H + h) - ref) / (1.0 + fabs(ref)));
    }
  CHECK(worst < tol, "unpermute against double: %g", worst);
  /* Without weights: the sum of the slots. */
  CHECK(tf_moe_unpermute(m, rows_of(px, out_rows, H, es), dtype, NULL, dtype, rows_of(y, T, H, es), 0, T) == TF_OK,
        "unpermute without weights");
  worst = 0.0;
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      double ref = 0.0;
      for (int e = 0; e < E; ++e)
        if (dst[t][e] >= 0) ref += VAL(px, dst[t][e] * H + h);
      worst = fmax(worst, fabs(VAL(y, t * H + h) - ref) / (1.0 + fabs(ref)));
    }
  CHECK(worst < tol, "unweighted unpermute against double: %g", worst);
  /* Backward with weights. */
  CHECK(tf_moe_unpermute_backward(m, rows_of(g, T, H, es), rows_of(px, out_rows, H, es), dtype, wr, dtype,
                                  rows_of(dx, out_rows, H, es), rows_of(dw, T, E, es), 0, T) == TF_OK,
        "unpermute backward");
  double worst_dx = 0.0, worst_dw = 0.0;
  for (int t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e) {
      double dot = 0.0;
      if (dst[t][e] >= 0)
        for (int h = 0; h < H; ++h) {
          const double ref = (double)VAL(g, t * H + h) * VAL(w, t * E + e);
          worst_dx = fmax(worst_dx, fabs(VAL(dx, dst[t][e] * H + h) - ref) / (1.0 + fabs(ref)));
          dot += (double)VAL(px, dst[t][e] * H + h) * VAL(g, t * H + h);
        }
      worst_dw = fmax(worst_dw, fabs(VAL(dw, t * E + e) - dot) / (1.0 + fabs(dot)));
    }
  CHECK(worst_dx < tol && worst_dw < tol * 4, "backward against double: dx %g, dw %g", worst_dx, worst_dw);
  /* The permuted probs sent back. */
  CHECK(tf_moe_unpermute_probs(m, rows_of(pw, out_rows, 1, es), rows_of(uw, T, E, es), 0, T) == TF_OK, "probs back");
  bad = 0;
  for (int t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e) bad += VAL(uw, t * E + e) != (dst[t][e] >= 0 ? VAL(w, t * E + e) : 0.0f);
  CHECK(bad == 0, "unpermuted probs (%d wrong)", bad);
#undef VAL
  free(map), free(x), free(px), free(y), free(w), free(pw), free(g), free(dx), free(dw), free(uw);
}

/* Index map: topk 2, unpermute sums k = 0, 1 with float32 weights. */
static void test_index_unpermute(void) {
  enum { N = 9, K = 2, X = 4, C = 5 };
  int32_t idx[N * K], map[N * K];
  int64_t counts[X];
  for (int i = 0; i < N * K; ++i) idx[i] = (int32_t)(next() % X);
  CHECK(tf_moe_index_row_id_map(idx, N, K, X, N * K - 4, counts, map) == TF_OK, "index map");
  float x[N][C], px[N * K][C], w[N][K], y[N][C];
  for (int t = 0; t < N; ++t)
    for (int c = 0; c < C; ++c) x[t][c] = uniform();
  for (int t = 0; t < N; ++t)
    for (int k = 0; k < K; ++k) w[t][k] = uniform();
  const tf_moe_map m = {map, TF_MOE_MAP_INDEX, N, K};
  CHECK(tf_moe_permute(m, rows_of(x, N, C, 4), NULL, rows_of(px, N * K - 4, C, 4), NULL, 0, N) == TF_OK, "permute");
  const tf_moe_rows wr = rows_of(w, N, K, 4);
  CHECK(tf_moe_unpermute(m, rows_of(px, N * K - 4, C, 4), TF_FLOAT32, &wr, TF_FLOAT32, rows_of(y, N, C, 4), 0, N) == TF_OK,
        "unpermute");
  double worst = 0.0;
  int dropped = 0;
  for (int t = 0; t < N; ++t) {
    for (int k = 0; k < K; ++k) dropped += map[k * N + t] == -1;
    for (int c = 0; c < C; ++c) {
      double ref = 0.0;
      for (int k = 0; k < K; ++k)
        if (map[k * N + t] >= 0) ref += (double)x[t][c] * w[t][k];
      worst = fmax(worst, fabs(y[t][c] - ref));
    }
  }
  CHECK(dropped == 4 && worst < 1e-6, "index round trip: %d dropped, error %g", dropped, worst);
}

static void test_chunk_sort(void) {
  const int64_t sizes[4] = {2, 0, 3, 1}, order[4] = {2, 3, 1, 0};
  int64_t scratch[4];
  int32_t map[6];
  CHECK(tf_moe_chunk_sort_map(sizes, order, 4, 6, scratch, map) == TF_OK, "chunk map");
  const int32_t want[6] = {4, 5, 0, 1, 2, 3};
  CHECK(memcmp(map, want, sizeof want) == 0, "chunk map values");
  const float in[6] = {10, 11, 20, 21, 22, 30};
  float out[6], back[6];
  CHECK(tf_moe_sort_rows(map, 1, rows_of((void *)in, 6, 1, 4), rows_of(out, 6, 1, 4), 0, 6) == TF_OK &&
            out[0] == 20 && out[2] == 22 && out[3] == 30 && out[4] == 10 && out[5] == 11, "chunks sorted");
  CHECK(tf_moe_sort_rows(map, 0, rows_of(out, 6, 1, 4), rows_of(back, 6, 1, 4), 0, 6) == TF_OK &&
            memcmp(back, in, sizeof in) == 0, "and back");
  const int64_t twice[4] = {2, 2, 1, 0}, far[4] = {0, 1, 2, 4}, big[4] = {2, 0, 3, 2};
  CHECK(tf_moe_chunk_sort_map(sizes, twice, 4, 6, scratch, map) == TF_ERR_BAD_ARGUMENT, "a repeated chunk");
  CHECK(tf_moe_chunk_sort_map(sizes, far, 4, 6, scratch, map) == TF_ERR_BAD_ARGUMENT, "a chunk out of range");
  CHECK(tf_moe_chunk_sort_map(big, order, 4, 6, scratch, map) == TF_ERR_BAD_SIZE, "sizes past the tokens");
  CHECK(tf_moe_chunk_sort_map(sizes, order, 4, 7, scratch, map) == TF_ERR_BAD_SIZE, "sizes short of the tokens");
  const int32_t wild[6] = {0, 1, 2, 3, 4, 6};
  CHECK(tf_moe_sort_rows(wild, 1, rows_of((void *)in, 6, 1, 4), rows_of(out, 6, 1, 4), 0, 6) == TF_ERR_BAD_ARGUMENT,
        "a map entry past the rows");
}

static void test_checks(void) {
  const uint8_t mask[4] = {1, 0, 1, 1};
  int64_t counts[2], kept;
  int32_t map[10];
  float x[4] = {1, 2, 3, 4}, out[6], y[4];
  CHECK(tf_moe_mask_row_id_map(mask, 2, 2, 2, 1, 3, counts, map, &kept) == TF_OK, "a small map");
  const tf_moe_map m = {map, TF_MOE_MAP_MASK, 2, 2};
  CHECK(tf_moe_permute(m, rows_of(x, 2, 2, 4), NULL, rows_of(out, 2, 2, 4), NULL, 0, 2) == TF_ERR_BAD_ARGUMENT,
        "a destination past the output's rows");
  CHECK(tf_moe_permute(m, rows_of(x, 2, 2, 4), NULL, rows_of(out, 3, 2, 4), NULL, 0, 3) == TF_ERR_BAD_SIZE,
        "tokens past the map");
  CHECK(tf_moe_permute(m, rows_of(x, 3, 1, 4), NULL, rows_of(out, 3, 1, 4), NULL, 0, 2) == TF_ERR_BAD_SIZE,
        "input rows not the map's tokens");
  CHECK(tf_moe_permute(m, rows_of(NULL, 2, 2, 4), NULL, rows_of(out, 3, 2, 4), NULL, 0, 2) == TF_ERR_NULL_POINTER,
        "no input");
  map[2 * 2] = 3; /* token 0 claims 3 slots of 2 experts */
  CHECK(tf_moe_unpermute(m, rows_of(out, 3, 2, 4), TF_FLOAT32, NULL, TF_FLOAT32, rows_of(y, 2, 2, 4), 0, 2) ==
            TF_ERR_BAD_ARGUMENT, "a slot count past the experts");
  map[2 * 2] = 1;
  map[2] = 5; /* token 0's expert column out of range */
  CHECK(tf_moe_unpermute(m, rows_of(out, 3, 2, 4), TF_FLOAT32, NULL, TF_FLOAT32, rows_of(y, 2, 2, 4), 0, 2) ==
            TF_ERR_BAD_ARGUMENT, "an expert past the experts");
  CHECK(tf_moe_unpermute(m, rows_of(out, 3, 2, 4), (tf_dtype)9, NULL, TF_FLOAT32, rows_of(y, 2, 2, 4), 0, 2) ==
            TF_ERR_BAD_DTYPE, "an unknown dtype");
  CHECK(tf_moe_unpermute(m, rows_of(out, 3, 2, 2), TF_FLOAT32, NULL, TF_FLOAT32, rows_of(y, 2, 2, 2), 0, 2) ==
            TF_ERR_BAD_DTYPE, "an element size not the dtype's");
  tf_moe_rows huge = rows_of(x, INT64_MAX / 2, 4, 4);
  CHECK(tf_moe_sort_rows((const int32_t *)map, 1, huge, huge, 0, 0) == TF_ERR_OVERFLOW, "rows x cols overflowing");
  CHECK(tf_moe_mask_row_id_map(mask, INT64_MAX / 2, 2, 2, 1, 0, counts, map, &kept) == TF_ERR_OVERFLOW,
        "a map size overflowing");
  const int32_t neg[2] = {0, -1};
  CHECK(tf_moe_index_row_id_map(neg, 2, 1, 2, 2, counts, map) == TF_ERR_BAD_ARGUMENT, "a negative expert index");
  CHECK(tf_moe_index_row_id_map(neg, INT64_MAX, 2, 2, 2, counts, map) == TF_ERR_OVERFLOW, "tokens x topk overflowing");
  CHECK(tf_moe_mask_row_id_map(mask, 0, 2, 2, 1, 0, NULL, NULL, &kept) == TF_OK && kept == 0, "no tokens");
  CHECK(tf_moe_mask_row_id_map(mask, 2, 2, 2, 1, -1, counts, map, &kept) == TF_ERR_BAD_SIZE, "negative num_out");
}

int main(void) {
  test_worked_example();
  test_random_mask(TF_FLOAT32);
  test_random_mask(TF_BFLOAT16);
  test_random_mask(TF_FLOAT16);
  test_index_unpermute();
  test_chunk_sort();
  test_checks();
  return check_report();
}
