/*
 * Standalone test of the fused-op C core (csrc/ops, no torch): bias + each activation
 * (gelu, relu, qgelu, srelu, silu), the one-pass activation + bias gradient, the gated
 * activations (geglu, reglu, qgeglu, sreglu, swiglu), RMSNorm and LayerNorm against
 * double-precision references (edge values included: zeros, huge, infinite and NaN inputs),
 * band independence of the partial sums, FP8 output against the FP8 encoder, every x86-64
 * level's build against the baseline's bits, and every size, overflow and pointer check.
 * Run by tests/c/run_ops.sh under ASan and UBSan.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cpu_features.h"
#include "ops/activation.h"
#include "ops/norm.h"

#include "check.h"

static uint64_t rng_state = 0x243F6A8885A308D3ull;
static float rand_f(float scale) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  const uint32_t bits = (uint32_t)((rng_state * 0x2545F4914F6CDD1Dull) >> 40);
  return ((float)bits / (float)(1u << 24) * 2.0f - 1.0f) * scale;
}

/* The activations in double, written from their definitions (TransformerEngine's). */
static double gelu_ref(double x) { return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }

static double dgelu_ref(double x) {
  const double t = tanh(0.7978845608028654 * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x);
}

static double sigmoid_ref(double x) { return 1.0 / (1.0 + exp(-x)); }
static double none_ref(double x) { return x; }
static double dnone_ref(double x) {
  (void)x;
  return 1.0;
}
static double relu_ref(double x) { return x > 0.0 ? x : 0.0; } /* TE's fmaxf(x, 0): NaN gives 0 */
static double drelu_ref(double x) { return x > 0.0 ? 1.0 : 0.0; }
static double qgelu_ref(double x) { return x * sigmoid_ref(1.702 * x); }
static double dqgelu_ref(double x) {
  const double s = sigmoid_ref(1.702 * x);
  return s + 1.702 * x * s * (1.0 - s);
}
static double srelu_ref(double x) { return x > 0.0 ? x * x : 0.0; }
static double dsrelu_ref(double x) { return x > 0.0 ? 2.0 * x : 0.0; }
static double silu_ref(double x) { return x * sigmoid_ref(x); }
static double dsilu_ref(double x) {
  const double s = sigmoid_ref(x);
  return s + x * s * (1.0 - s);
}

typedef struct act_ref {
  tf_activation act;
  const char *name;
  double (*f)(double);
  double (*df)(double);
} act_ref;

static const act_ref ACTS[] = {
    {TF_ACT_NONE, "none", none_ref, dnone_ref},     {TF_ACT_GELU_TANH, "gelu", gelu_ref, dgelu_ref},
    {TF_ACT_RELU, "relu", relu_ref, drelu_ref},     {TF_ACT_QGELU, "qgelu", qgelu_ref, dqgelu_ref},
    {TF_ACT_SRELU, "srelu", srelu_ref, dsrelu_ref}, {TF_ACT_SILU, "silu", silu_ref, dsilu_ref},
};
enum { NUM_ACTS = sizeof(ACTS) / sizeof(ACTS[0]) };

/* g * act'(x): a select for the ReLU family (0 for x <= 0 whatever g), a product otherwise. */
static double grad_ref(const act_ref *a, double x, double g) {
  if (a->act == TF_ACT_RELU || a->act == TF_ACT_SRELU) return x > 0.0 ? g * a->df(x) : 0.0;
  return g * a->df(x);
}

/*
 * Whether a float32 result matches its double reference: NaN where the reference is NaN, the same
 * infinity where the reference rounds to one, else within tol * scale.
 */
static int matches(float got, double ref, double tol, double scale) {
  const float ref32 = (float)ref;
  if (isnan(ref32)) return isnan(got);
  if (isinf(ref32)) return got == ref32;
  return isfinite(got) && fabs((double)got - ref) <= tol * fmax(scale, fabs(ref));
}

/* Edge values: zeros, tiny, moderate, past the exp clamps, huge but finite in every float32 formula, infinite, NaN. */
static const float EDGES[] = {0.0f, -0.0f, 1e-30f, -1e-30f, 5.0f, -5.0f, 20.0f, -20.0f, 60.0f, -60.0f, 100.0f,
                              -100.0f, 1e12f, -1e12f, INFINITY, -INFINITY, NAN};
enum { NUM_EDGES = sizeof(EDGES) / sizeof(EDGES[0]) };

static tf_ops_output f32_out(float *data) {
  tf_ops_output o = {data, TF_FLOAT32, 0, TF_FP8_E4M3, 1.0f};
  return o;
}

enum { R = 37, C = 600 };

/* bias + act forward, and the backward in three bands whose partial sums give dbias, against double. */
static void test_bias_act_and_grad(const act_ref *ar) {
  static float x[R * C], b[C], y[R * C], dy[R * C], dx[R * C], part[3 * C], db[C];
  for (int i = 0; i < R * C; ++i) x[i] = rand_f(6.0f), dy[i] = rand_f(1.0f);
  for (int c = 0; c < C; ++c) b[c] = rand_f(1.0f);
  for (int i = 0; i < NUM_EDGES; ++i) x[i * (C + 1)] = EDGES[i], b[i] = 0.0f; /* x + b is the edge value */
  uint32_t amax = 0;
  const tf_ops_output out = f32_out(y);
  CHECK(tf_bias_act_forward(x, TF_FLOAT32, b, TF_FLOAT32, R, C, 0, R, ar->act, &out, &amax) == TF_OK, "%s forward",
        ar->name);
  int bad = 0;
  for (int i = 0; i < R * C; ++i) bad += !matches(y[i], ar->f((double)(x[i] + b[i % C])), 2e-6, 1.0);
  CHECK(bad == 0, "%s: %d outputs differ from the double reference", ar->name, bad);
  CHECK(amax == 0, "no amax for a non-FP8 output");

  /* Three bands, summed in order, give the dbias of the whole matrix (finite columns only). */
  const tf_ops_output gout = f32_out(dx);
  const int64_t cut[4] = {0, 10, 11, R};
  for (int k = 0; k < 3; ++k)
    CHECK(tf_act_bias_backward(dy, TF_FLOAT32, x, TF_FLOAT32, b, TF_FLOAT32, R, C, cut[k], cut[k + 1], ar->act, &gout,
                               part + k * C, &amax) == TF_OK, "%s backward band %d", ar->name, k);
  CHECK(tf_ops_sum_partials(part, 3, C, 0, C, db, TF_FLOAT32) == TF_OK, "sum partials");
  int bad_dx = 0, bad_db = 0;
  for (int c = 0; c < C; ++c) {
    double ref_db = 0.0;
    for (int r = 0; r < R; ++r) {
      const double g = grad_ref(ar, (double)(x[r * C + c] + b[c]), dy[r * C + c]);
      bad_dx += !matches(dx[r * C + c], g, 2e-6, 1.0);
      ref_db += g;
    }
    bad_db += !matches(db[c], ref_db, 1e-4, 1.0);
  }
  CHECK(bad_dx == 0, "%s: %d gradients differ from the double reference", ar->name, bad_dx);
  CHECK(bad_db == 0, "%s: %d dbias columns differ from the double reference", ar->name, bad_db);
}

static void test_fp8_output(void) {
  static float x[R * C];
  static uint8_t y[R * C];
  for (int i = 0; i < R * C; ++i) x[i] = rand_f(3.0f);
  const tf_ops_output out = {y, TF_FLOAT32, 1, TF_FP8_E5M2, 8.0f};
  uint32_t amax = 0;
  CHECK(tf_bias_act_forward(x, TF_FLOAT32, NULL, TF_FLOAT32, R, C, 0, R, TF_ACT_RELU, &out, &amax) == TF_OK,
        "fp8 forward");
  int mismatches = 0;
  float expect_amax = 0.0f;
  for (int i = 0; i < R * C; ++i) {
    const float v = x[i] > 0.0f ? x[i] : 0.0f;
    expect_amax = v > expect_amax ? v : expect_amax;
    mismatches += y[i] != tf_fp8_e5m2_encode(v * 8.0f);
  }
  CHECK(mismatches == 0, "%d FP8 codes differ from the encoder", mismatches);
  CHECK(amax == tf_f32_bits(expect_amax), "amax bits");
}

/* The gated activation of ar (geglu, reglu, qgeglu, sreglu, swiglu) forward and backward against double. */
static void test_gated(const act_ref *ar) {
  static float x[R * 2 * C], y[R * C], dy[R * C], dx[R * 2 * C];
  for (int i = 0; i < R * 2 * C; ++i) x[i] = rand_f(8.0f);
  for (int i = 0; i < R * C; ++i) dy[i] = rand_f(1.0f);
  for (int i = 0; i < NUM_EDGES; ++i) x[i * (2 * C + 1)] = EDGES[i]; /* edges in the activated half */
  x[2 * C + C + 1] = INFINITY, x[4 * C + C + 2] = NAN;               /* and in the gate */
  uint32_t amax = 0;
  const tf_ops_output out = f32_out(y), gout = f32_out(dx);
  CHECK(tf_gated_act_forward(x, TF_FLOAT32, R, C, 0, R, ar->act, &out, &amax) == TF_OK, "gated %s", ar->name);
  CHECK(tf_gated_act_backward(dy, TF_FLOAT32, x, TF_FLOAT32, R, C, 0, R, ar->act, &gout, &amax) == TF_OK,
        "gated %s backward", ar->name);
  int bad = 0, bad_a = 0, bad_g = 0;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const double a = x[r * 2 * C + c], g = x[r * 2 * C + C + c], d = dy[r * C + c];
      bad += !matches(y[r * C + c], ar->f(a) * g, 2e-6, fabs(g));
      bad_a += !matches(dx[r * 2 * C + c], grad_ref(ar, a, d * g), 2e-6, fabs(d * g));
      bad_g += !matches(dx[r * 2 * C + C + c], d * ar->f(a), 2e-6, 1.0);
    }
  CHECK(bad == 0 && bad_a == 0 && bad_g == 0, "gated %s: %d outputs, %d gradients of the activated half, %d of the "
        "gate differ from the double reference", ar->name, bad, bad_a, bad_g);
}

static void test_layernorm(void) {
  static float x[R * C], w[C], b[C], y[R * C], mean[R], rstd[R], dy[R * C], dx[R * C], pg[C], pb[C];
  for (int i = 0; i < R * C; ++i) x[i] = rand_f(2.0f) + 3.0f, dy[i] = rand_f(1.0f);
  for (int c = 0; c < C; ++c) w[c] = rand_f(1.0f), b[c] = rand_f(1.0f);
  uint32_t amax = 0;
  const tf_ops_output out = f32_out(y);
  CHECK(tf_layernorm_forward(x, TF_FLOAT32, w, b, TF_FLOAT32, 0, 1e-5f, R, C, 0, R, &out, mean, rstd, &amax) ==
        TF_OK, "layernorm");
  CHECK(tf_layernorm_backward(dy, TF_FLOAT32, x, TF_FLOAT32, mean, rstd, w, TF_FLOAT32, 0, R, C, 0, R, dx,
                              TF_FLOAT32, pg, pb) == TF_OK, "layernorm bwd");
  double worst = 0.0, worst_dx = 0.0;
  for (int r = 0; r < R; ++r) {
    double mu = 0.0, var = 0.0, sg = 0.0, sgx = 0.0;
    for (int c = 0; c < C; ++c) mu += x[r * C + c];
    mu /= C;
    for (int c = 0; c < C; ++c) var += (x[r * C + c] - mu) * (x[r * C + c] - mu);
    const double rs = 1.0 / sqrt(var / C + 1e-5);
    for (int c = 0; c < C; ++c) {
      const double xh = (x[r * C + c] - mu) * rs, g = (double)dy[r * C + c] * w[c];
      worst = fmax(worst, fabs(y[r * C + c] - (xh * w[c] + b[c])));
      sg += g, sgx += g * xh;
    }
    for (int c = 0; c < C; ++c) {
      const double xh = (x[r * C + c] - mu) * rs, g = (double)dy[r * C + c] * w[c];
      worst_dx = fmax(worst_dx, fabs(dx[r * C + c] - rs * (g - sg / C - xh * sgx / C)));
    }
  }
  CHECK(worst < 1e-5 && worst_dx < 1e-4, "layernorm error %g, dx %g", worst, worst_dx);
}

/*
 * Each x86-64 level's build of the kernels (common/tf_isa_clones.h) gives the baseline build's bits:
 * bias + each activation forward and backward with dbias, each gated activation forward and backward,
 * and LayerNorm and RMSNorm forward and backward, from
 * bf16 inputs, on rows longer than a tile and rows of one tile (the norms' short-row loop), neither a
 * multiple of any vector width. IR rows: one whole group of the norms' short-row loop and a part group.
 */
enum { IR = 11, IC_MAX = 1043, IOUT_MAX = 5 * IR * IC_MAX + 4 * IC_MAX + 4 * IR };

/* The inputs of both runners below (bf16): x holds up to IR x (2 * IC_MAX) for the gated kernels. */
static uint16_t in_x[2 * IR * IC_MAX], in_dy[IR * IC_MAX], in_w[IC_MAX], in_b[IC_MAX];
static tf_activation isa_act; /* the activation the runners run */

/* The number of outputs of run_all_ops for rows of `cols` columns. */
static int64_t outputs(int64_t cols) { return 5 * IR * cols + 4 * cols + 4 * IR; }

/* Every output of the kernels on IR x cols inputs, packed one after another into out. */
static void run_all_ops(int64_t cols, float *out) {
  const uint16_t *x = in_x, *dy = in_dy, *w = in_w, *b = in_b;
  float *y = out, *dx = y + IR * cols, *ln_y = dx + IR * cols, *ln_dx = ln_y + IR * cols;
  float *rms_dx = ln_dx + IR * cols;
  float *dbias = rms_dx + IR * cols, *dgamma = dbias + cols, *dbeta = dgamma + cols, *rms_dgamma = dbeta + cols;
  float *mean = rms_dgamma + cols, *rstd = mean + IR, *rms_y = rstd + IR, *rms_rstd = rms_y + IR;
  static float rms_full[IR * IC_MAX];
  uint32_t amax = 0;
  const tf_ops_output o_y = f32_out(y), o_dx = f32_out(dx), o_ln = f32_out(ln_y), o_rms = f32_out(rms_full);
  CHECK(tf_bias_act_forward(x, TF_BFLOAT16, b, TF_BFLOAT16, IR, cols, 0, IR, isa_act, &o_y, &amax) == TF_OK &&
        tf_act_bias_backward(dy, TF_BFLOAT16, x, TF_BFLOAT16, b, TF_BFLOAT16, IR, cols, 0, IR, isa_act, &o_dx, dbias,
                             &amax) == TF_OK &&
        tf_layernorm_forward(x, TF_BFLOAT16, w, b, TF_BFLOAT16, 0, 1e-5f, IR, cols, 0, IR, &o_ln, mean, rstd,
                             &amax) == TF_OK &&
        tf_layernorm_backward(dy, TF_BFLOAT16, x, TF_BFLOAT16, mean, rstd, w, TF_BFLOAT16, 0, IR, cols, 0, IR,
                              ln_dx, TF_FLOAT32, dgamma, dbeta) == TF_OK &&
        tf_rmsnorm_forward(x, TF_BFLOAT16, w, TF_BFLOAT16, 1, 1e-5f, IR, cols, 0, IR, &o_rms, rms_rstd, &amax) ==
            TF_OK &&
        tf_rmsnorm_backward(dy, TF_BFLOAT16, x, TF_BFLOAT16, rms_rstd, w, TF_BFLOAT16, 1, IR, cols, 0, IR, rms_dx,
                            TF_FLOAT32, rms_dgamma) == TF_OK,
        "isa %d: kernel status", (int)tf_cpu_isa());
  for (int r = 0; r < IR; ++r) rms_y[r] = rms_full[r * cols + cols - 1];
}

/* The gated activation forward and backward: x is IR x (2 * cols), y and dy IR x cols; 3 IR cols outputs. */
static void run_gated(int64_t cols, float *out) {
  uint32_t amax = 0;
  const tf_ops_output o_y = f32_out(out), o_dx = f32_out(out + IR * cols);
  CHECK(tf_gated_act_forward(in_x, TF_BFLOAT16, IR, cols, 0, IR, isa_act, &o_y, &amax) == TF_OK &&
            tf_gated_act_backward(in_dy, TF_BFLOAT16, in_x, TF_BFLOAT16, IR, cols, 0, IR, isa_act, &o_dx, &amax) ==
                TF_OK,
        "isa %d: gated activation %d status", (int)tf_cpu_isa(), (int)isa_act);
}

/* Runs `run` on the baseline build and on every level the CPU has; fails where any of its n outputs differ. */
static void check_builds_agree(const char *what, void (*run)(int64_t cols, float *out), int64_t cols, int64_t n) {
  static float base[IOUT_MAX], got[IOUT_MAX];
  CHECK(n <= IOUT_MAX, "%s: %lld outputs", what, (long long)n);
  CHECK(tf_set_cpu_isa_cap(TF_ISA_PORTABLE) == TF_OK, "cap");
  run(cols, base);
  for (int isa = 1; isa <= (int)tf_cpu_isa_detected(); ++isa) {
    CHECK(tf_set_cpu_isa_cap(isa) == TF_OK, "cap %d", isa);
    run(cols, got);
    int64_t differ = 0;
    for (int64_t i = 0; i < n; ++i) differ += memcmp(&got[i], &base[i], sizeof(float)) != 0;
    CHECK(differ == 0, "isa %d, %s, activation %d, %lld columns: %lld of %lld outputs differ from the baseline build",
          isa, what, (int)isa_act, (long long)cols, (long long)differ, (long long)n);
  }
  CHECK(tf_set_cpu_isa_cap(-1) == TF_OK, "uncap");
}

/* Values past the exp clamps (the sigmoid's selects) and large ones, in finite bf16 inputs. */
static void put_large_values(uint16_t *x, int64_t n) {
  static const float large[] = {100.0f, -100.0f, 60.0f, -60.0f, 1e12f, -1e12f};
  for (int i = 0; i < 6; ++i) x[(i * 97) % n] = tf_f32_to_bf16(large[i]);
}

static void test_isa_builds_agree(int64_t cols) {
  for (int i = 0; i < IR * cols; ++i)
    in_x[i] = tf_f32_to_bf16(rand_f(4.0f) + 1.0f), in_dy[i] = tf_f32_to_bf16(rand_f(1.0f));
  for (int c = 0; c < cols; ++c) in_w[c] = tf_f32_to_bf16(rand_f(1.0f)), in_b[c] = tf_f32_to_bf16(rand_f(1.0f));
  put_large_values(in_x, IR * cols);
  for (int k = 0; k < NUM_ACTS; ++k) {
    isa_act = ACTS[k].act;
    check_builds_agree("fused ops", run_all_ops, cols, outputs(cols));
  }
}

static void test_gated_isa_builds_agree(int64_t cols) {
  for (int i = 0; i < 2 * IR * cols; ++i) in_x[i] = tf_f32_to_bf16(rand_f(6.0f));
  for (int i = 0; i < IR * cols; ++i) in_dy[i] = tf_f32_to_bf16(rand_f(1.0f));
  put_large_values(in_x, 2 * IR * cols);
  for (int k = 1; k < NUM_ACTS; ++k) {
    isa_act = ACTS[k].act;
    check_builds_agree("gated", run_gated, cols, 3 * IR * cols);
  }
}

static void test_checks(void) {
  float x[4] = {0}, y[4], part[2];
  uint32_t amax = 0;
  const tf_ops_output out = f32_out(y);
  const tf_ops_output bad_out = {y, (tf_dtype)7, 0, TF_FP8_E4M3, 1.0f};
  const tf_ops_output null_out = f32_out(NULL);
  CHECK(tf_bias_act_forward(x, TF_FLOAT32, NULL, TF_FLOAT32, -1, 2, 0, 0, TF_ACT_NONE, &out, &amax) ==
        TF_ERR_BAD_SIZE, "negative rows");
  CHECK(tf_bias_act_forward(x, TF_FLOAT32, NULL, TF_FLOAT32, 2, 2, 1, 3, TF_ACT_NONE, &out, &amax) ==
        TF_ERR_BAD_SIZE, "row range past the end");
  CHECK(tf_bias_act_forward(x, TF_FLOAT32, NULL, TF_FLOAT32, INT64_MAX / 2, 3, 0, 0, TF_ACT_NONE, &out, &amax) ==
        TF_ERR_OVERFLOW, "rows * cols overflows");
  CHECK(tf_gated_act_forward(x, TF_FLOAT32, 1, INT64_MAX / 2 + 1, 0, 0, TF_ACT_SILU, &out, &amax) ==
        TF_ERR_OVERFLOW, "2 * cols overflows");
  CHECK(tf_bias_act_forward(x, TF_FLOAT32, NULL, TF_FLOAT32, 2, 2, 0, 2, TF_ACT_COUNT, &out, &amax) ==
        TF_ERR_BAD_ARGUMENT, "unknown activation");
  CHECK(tf_act_bias_backward(x, TF_FLOAT32, x, TF_FLOAT32, NULL, TF_FLOAT32, 2, 2, 0, 2, (tf_activation)-1, &out,
                             NULL, &amax) == TF_ERR_BAD_ARGUMENT, "negative activation code");
  CHECK(tf_gated_act_forward(x, TF_FLOAT32, 2, 1, 0, 2, TF_ACT_NONE, &out, &amax) == TF_ERR_BAD_ARGUMENT,
        "a gated activation needs an activation");
  CHECK(tf_gated_act_backward(x, TF_FLOAT32, x, TF_FLOAT32, 2, 1, 0, 2, TF_ACT_COUNT, &out, &amax) ==
        TF_ERR_BAD_ARGUMENT, "unknown gated activation");
  CHECK(tf_gated_act_forward(NULL, TF_FLOAT32, 2, 1, 0, 2, TF_ACT_RELU, &out, &amax) == TF_ERR_NULL_POINTER,
        "gated input NULL");
  CHECK(tf_bias_act_forward(x, (tf_dtype)5, NULL, TF_FLOAT32, 2, 2, 0, 2, TF_ACT_NONE, &out, &amax) ==
        TF_ERR_BAD_DTYPE, "unknown dtype");
  CHECK(tf_bias_act_forward(x, TF_FLOAT32, NULL, TF_FLOAT32, 2, 2, 0, 2, TF_ACT_NONE, &bad_out, &amax) ==
        TF_ERR_BAD_DTYPE, "unknown output dtype");
  CHECK(tf_bias_act_forward(x, TF_FLOAT32, NULL, TF_FLOAT32, 2, 2, 0, 2, TF_ACT_NONE, &null_out, &amax) ==
        TF_ERR_NULL_POINTER, "null output");
  CHECK(tf_bias_act_forward(x, TF_FLOAT32, NULL, TF_FLOAT32, 2, 2, 0, 2, TF_ACT_NONE, &out, NULL) ==
        TF_ERR_NULL_POINTER, "null amax");
  CHECK(tf_bias_act_forward(NULL, TF_FLOAT32, NULL, TF_FLOAT32, 2, 2, 1, 1, TF_ACT_NONE, &out, &amax) == TF_OK,
        "an empty band needs no data");
  CHECK(tf_ops_sum_partials(part, -1, 2, 0, 2, y, TF_FLOAT32) == TF_ERR_BAD_SIZE, "negative parts");
  CHECK(tf_ops_sum_partials(part, 1, 2, 1, 3, y, TF_FLOAT32) == TF_ERR_BAD_SIZE, "column range");
  CHECK(tf_rmsnorm_forward(x, TF_FLOAT32, x, TF_FLOAT32, 0, -1.0f, 2, 2, 0, 2, &out, part, &amax) ==
        TF_ERR_BAD_ARGUMENT, "negative eps");
  CHECK(tf_rmsnorm_forward(x, TF_FLOAT32, x, TF_FLOAT32, 0, NAN, 2, 2, 0, 2, &out, part, &amax) ==
        TF_ERR_BAD_ARGUMENT, "NaN eps");
  CHECK(tf_layernorm_backward(x, TF_FLOAT32, x, TF_FLOAT32, NULL, part, x, TF_FLOAT32, 0, 2, 2, 0, 2, y,
                              TF_FLOAT32, part, part) == TF_ERR_NULL_POINTER, "layernorm backward without mean");
}

int main(void) {
  for (int k = 0; k < NUM_ACTS; ++k) test_bias_act_and_grad(&ACTS[k]);
  test_fp8_output();
  for (int k = 1; k < NUM_ACTS; ++k) test_gated(&ACTS[k]);
  test_layernorm();
  test_isa_builds_agree(IC_MAX);
  test_isa_builds_agree(333);
  test_gated_isa_builds_agree(IC_MAX);
  test_gated_isa_builds_agree(333);
  test_checks();
  return check_report();
}
