/*
 * The cross-entropy C core (csrc/ops/cross_entropy.h) on its own: statistics and gradients against a
 * double-precision reference, split over vocabulary ranges as tensor-parallel ranks hold them, the
 * 16-bit input and output paths, ignored rows, and the argument checks (sizes, pointers, targets).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "check.h"
#include "common/tf_dtype.h"
#include "ops/cross_entropy.h"

#define ROWS 7
#define VOCAB 1100 /* more than two of the kernel's 512-element tiles */
#define IGNORE (-100)

static float uniform(unsigned *state, float lo, float hi) {
  *state = *state * 1103515245u + 12345u;
  return lo + (hi - lo) * (float)((*state >> 8) & 0xFFFFFF) / 16777216.0f;
}

static float x_at(const float *x, int64_t r, int64_t c) { return x[r * VOCAB + c]; }

/* The loss and the gradient row of row r in double, from the definition. */
static double reference(const float *x, int64_t r, int64_t t, double smoothing, double *grad) {
  double m = -INFINITY, d = 0.0, sum = 0.0;
  for (int64_t c = 0; c < VOCAB; ++c) m = fmax(m, x_at(x, r, c));
  for (int64_t c = 0; c < VOCAB; ++c) d += exp(x_at(x, r, c) - m), sum += x_at(x, r, c);
  const double lse = m + log(d);
  for (int64_t c = 0; c < VOCAB; ++c)
    grad[c] = exp(x_at(x, r, c) - lse) - smoothing / VOCAB - (c == t ? 1.0 - smoothing : 0.0);
  /* The smoothing term only with smoothing: a -inf logit makes sum -inf (and the smoothed loss inf). */
  return lse - (1.0 - smoothing) * x_at(x, r, t) - (smoothing > 0.0 ? smoothing / VOCAB * sum : 0.0);
}

/* The statistics of `parts` vocabulary shards combined as the Python layer combines them. */
static void sharded(const float *x, const int64_t *target, int parts, double smoothing, float *loss, float *grad) {
  float stats[8][ROWS * 4];
  const int64_t cols = VOCAB / parts;
  float *shard = malloc(sizeof(float) * ROWS * cols);
  for (int p = 0; p < parts; ++p) {
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t c = 0; c < cols; ++c) shard[r * cols + c] = x_at(x, r, p * cols + c);
    CHECK(tf_cross_entropy_stats(shard, TF_FLOAT32, ROWS, cols, target, p * cols, VOCAB, IGNORE, 0, ROWS,
                                 stats[p]) == TF_OK, "stats of shard %d", p);
  }
  float lse[ROWS], scale[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) {
    float m = -INFINITY, d = 0.0f, xt = 0.0f, sum = 0.0f;
    for (int p = 0; p < parts; ++p) m = fmaxf(m, stats[p][4 * r]);
    for (int p = 0; p < parts; ++p) {
      d += stats[p][4 * r + 1] * expf(stats[p][4 * r] - m);
      xt += stats[p][4 * r + 2];
      sum += stats[p][4 * r + 3];
    }
    lse[r] = m + logf(d);
    loss[r] = lse[r] - (float)(1.0 - smoothing) * xt - (smoothing > 0.0 ? (float)(smoothing / VOCAB) * sum : 0.0f);
    if (target[r] == IGNORE) loss[r] = 0.0f;
    scale[r] = 1.0f;
  }
  for (int p = 0; p < parts; ++p) {
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t c = 0; c < cols; ++c) shard[r * cols + c] = x_at(x, r, p * cols + c);
    float *g = malloc(sizeof(float) * ROWS * cols);
    CHECK(tf_cross_entropy_backward(shard, TF_FLOAT32, ROWS, cols, target, p * cols, VOCAB, IGNORE, lse, scale,
                                    (float)(smoothing / VOCAB), (float)(1.0 - smoothing), 0, ROWS, g,
                                    TF_FLOAT32) == TF_OK, "backward of shard %d", p);
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t c = 0; c < cols; ++c) grad[r * VOCAB + p * cols + c] = g[r * cols + c];
    free(g);
  }
  free(shard);
}

static void test_against_reference(void) {
  unsigned state = 7;
  float *x = malloc(sizeof(float) * ROWS * VOCAB);
  for (int64_t i = 0; i < ROWS * VOCAB; ++i) x[i] = uniform(&state, -30.0f, 30.0f);
  x[3 * VOCAB + 5] = -INFINITY; /* a masked-out logit: probability 0 */
  const int64_t target[ROWS] = {0, VOCAB - 1, 549, 550, IGNORE, 5 + 1, 1023};
  float *grad = malloc(sizeof(float) * ROWS * VOCAB);
  double *ref = malloc(sizeof(double) * VOCAB);
  const double smoothings[] = {0.0, 0.1};
  const int parts[] = {1, 2, 4};
  for (int si = 0; si < 2; ++si) {
    for (int pi = 0; pi < 3; ++pi) {
      float loss[ROWS];
      sharded(x, target, parts[pi], smoothings[si], loss, grad);
      for (int64_t r = 0; r < ROWS; ++r) {
        if (target[r] == IGNORE) {
          int zero = 1;
          for (int64_t c = 0; c < VOCAB; ++c) zero &= grad[r * VOCAB + c] == 0.0f;
          CHECK(loss[r] == 0.0f && zero, "ignored row %lld", (long long)r);
          continue;
        }
        const double want = reference(x, r, target[r], smoothings[si], ref);
        CHECK(want == loss[r] || fabs(loss[r] - want) <= 1e-5 * (1.0 + fabs(want)) + 2e-4, "loss row %lld: %g vs %g (parts %d)",
              (long long)r, loss[r], want, parts[pi]);
        double worst = 0.0;
        for (int64_t c = 0; c < VOCAB; ++c) worst = fmax(worst, fabs(grad[r * VOCAB + c] - ref[c]));
        CHECK(worst <= 1e-6, "grad row %lld off by %g (parts %d)", (long long)r, worst, parts[pi]);
      }
      CHECK(grad[3 * VOCAB + 5] == -(float)(smoothings[si] / VOCAB), "a -inf logit has probability 0");
    }
  }
  free(x), free(grad), free(ref);
}

static void test_16bit(void) {
  unsigned state = 11;
  uint16_t xb[2 * 600], dx[2 * 600];
  float xf[2 * 600], stats_b[8], stats_f[8];
  for (int i = 0; i < 2 * 600; ++i) {
    xb[i] = tf_f32_to_bf16(uniform(&state, -8.0f, 8.0f));
    xf[i] = tf_bf16_to_f32(xb[i]);
  }
  const int64_t target[2] = {17, 599};
  CHECK(tf_cross_entropy_stats(xb, TF_BFLOAT16, 2, 600, target, 0, 600, IGNORE, 0, 2, stats_b) == TF_OK, "bf16");
  CHECK(tf_cross_entropy_stats(xf, TF_FLOAT32, 2, 600, target, 0, 600, IGNORE, 0, 2, stats_f) == TF_OK, "f32");
  int same = 1;
  for (int i = 0; i < 8; ++i) same &= stats_b[i] == stats_f[i];
  CHECK(same, "bf16 input reads the same values as their float32 widening");
  const float lse[2] = {stats_f[0] + logf(stats_f[1]), stats_f[4] + logf(stats_f[5])}, scale[2] = {0.5f, 2.0f};
  CHECK(tf_cross_entropy_backward(xb, TF_BFLOAT16, 2, 600, target, 0, 600, IGNORE, lse, scale, 0.0f, 1.0f, 0, 2, dx,
                                  TF_BFLOAT16) == TF_OK, "bf16 backward");
  float g[2 * 600];
  CHECK(tf_cross_entropy_backward(xf, TF_FLOAT32, 2, 600, target, 0, 600, IGNORE, lse, scale, 0.0f, 1.0f, 0, 2, g,
                                  TF_FLOAT32) == TF_OK, "f32 backward");
  same = 1;
  for (int i = 0; i < 2 * 600; ++i) same &= dx[i] == tf_f32_to_bf16(g[i]);
  CHECK(same, "a bf16 gradient is the float32 one rounded once");
}

static void test_checks(void) {
  float x[8] = {0}, stats[8], lse[2] = {0}, scale[2] = {1, 1}, dx[8];
  const int64_t good[2] = {0, IGNORE}, high[2] = {0, 8}, negative[2] = {-1, 0};
  CHECK(tf_cross_entropy_stats(x, TF_FLOAT32, 2, 4, high, 0, 8, IGNORE, 0, 2, stats) == TF_ERR_BAD_ARGUMENT,
        "a target past the vocabulary");
  CHECK(tf_cross_entropy_stats(x, TF_FLOAT32, 2, 4, negative, 0, 8, IGNORE, 0, 2, stats) == TF_ERR_BAD_ARGUMENT,
        "a negative target that is not ignore_index");
  CHECK(tf_cross_entropy_backward(x, TF_FLOAT32, 2, 4, high, 0, 8, IGNORE, lse, scale, 0, 1, 0, 2, dx,
                                  TF_FLOAT32) == TF_ERR_BAD_ARGUMENT, "backward checks targets too");
  CHECK(tf_cross_entropy_stats(x, TF_FLOAT32, 2, 4, good, 5, 8, IGNORE, 0, 2, stats) == TF_ERR_BAD_SIZE,
        "a shard past the vocabulary's end");
  CHECK(tf_cross_entropy_stats(x, TF_FLOAT32, 2, 4, good, -1, 8, IGNORE, 0, 2, stats) == TF_ERR_BAD_SIZE,
        "a negative vocab_start");
  CHECK(tf_cross_entropy_stats(x, TF_FLOAT32, 2, 4, good, INT64_MAX - 4, INT64_MAX, IGNORE, 0, 2, stats) == TF_OK,
        "the last shard of the largest vocabulary (no overflow in the range check)");
  CHECK(tf_cross_entropy_stats(x, TF_FLOAT32, 2, 4, good, 0, 8, IGNORE, 1, 3, stats) == TF_ERR_BAD_SIZE,
        "rows past the end");
  CHECK(tf_cross_entropy_stats(x, TF_FLOAT32, INT64_MAX / 2, 4, good, 0, 8, IGNORE, 0, 0, stats) == TF_ERR_OVERFLOW,
        "rows x cols overflowing");
  CHECK(tf_cross_entropy_stats(x, TF_FLOAT32, 2, 4, NULL, 0, 8, IGNORE, 0, 2, stats) == TF_ERR_NULL_POINTER,
        "no target");
  CHECK(tf_cross_entropy_stats(x, TF_FLOAT32, 2, 4, good, 0, 8, IGNORE, 0, 2, NULL) == TF_ERR_NULL_POINTER,
        "no stats");
  CHECK(tf_cross_entropy_backward(x, TF_FLOAT32, 2, 4, good, 0, 8, IGNORE, NULL, scale, 0, 1, 0, 2, dx,
                                  TF_FLOAT32) == TF_ERR_NULL_POINTER, "no lse");
  CHECK(tf_cross_entropy_stats(x, (tf_dtype)99, 2, 4, good, 0, 8, IGNORE, 0, 2, stats) == TF_ERR_BAD_DTYPE,
        "an unknown dtype");
  CHECK(tf_cross_entropy_backward(x, TF_FLOAT32, 2, 4, good, 0, 8, IGNORE, lse, scale, 0, 1, 0, 2, dx,
                                  (tf_dtype)99) == TF_ERR_BAD_DTYPE, "an unknown gradient dtype");
}

int main(void) {
  test_against_reference();
  test_16bit();
  test_checks();
  return check_report();
}
